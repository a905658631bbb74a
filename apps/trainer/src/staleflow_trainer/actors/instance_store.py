"""What one rollout instance asks of the trajectory server (TS): its work (:meth:`route`) and
the results it writes back (:meth:`write`), over one kept connection (``AsyncStoreLink``).

A request whose connection broke may have been carried out or not: its answer was lost. It is
neither given up nor simply sent again (the store refuses a second ``finish`` of a trajectory
it already finished): the store's view decides. The ids a broken request carried are
*uncertain*; the request is made once more (on a new connection if that one broke), and where
the store refuses an uncertain id, the id's location in the store says whether the lost request
had landed:

* a route landed if the store places the trajectory on this instance (its payload is then
  read with ``get``);
* a ``finish`` landed if the trajectory is finished, a ``return_partial`` if it is queued.

A request not sent or not answered within ``timeout_s`` counts as one whose connection broke
(its ids are uncertain); a connection or handshake that takes longer sends nothing.

What cannot be settled because the store cannot be reached (the request broke on the new
connection too) comes back *unresolved*: the caller keeps those results and writes them later,
so a result is never dropped because a connection broke. Only the store's own refusal of the
records (``StateError``, ``InvalidRecord``, a message too large) refuses them; any other
failure (the transport, a store at its connection limit, a handshake refused) leaves them
unresolved.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import structlog

from engine_adapters import GenerateRequest
from staleflow_trainer.actors.ts_link import AsyncStoreLink, NotConnected
from trajectory_server import LocationState, Segment
from trajectory_server.errors import (
    InvalidRecord,
    MessageTooLarge,
    StateError,
    TransportError,
)

log = structlog.get_logger("staleflow.rollout")

T = TypeVar("T")
#: a record to write (a ``Segment``, or a ``Completion`` for ``finish``) and what the caller
#: keeps beside it
Item = tuple[Segment, Any]
#: the store examined the request and refused its records (nothing was carried out)
REFUSED = (StateError, InvalidRecord, MessageTooLarge)


def generate_request(t: Any, target_length: int | None) -> GenerateRequest:
    """The engine request for a trajectory routed here (``t``: the store's ``Trajectory``
    record): its prompt, sampling parameters and the output the store already holds (a
    partial's prefix); ``target_length``: where a sim engine ends it (None: a real engine, or
    the store's record had none). The request takes the record's token arrays and its
    ``SamplingParams`` (the engine's own record) as they are: the very sampling object the
    store sent."""
    return GenerateRequest(
        trajectory_id=t.trajectory_id,
        prompt_token_ids=t.prompt_token_ids,
        sampling=t.sampling,
        generated_token_ids=t.generated_token_ids,
        generated_logprobs=t.generated_logprobs,
        generated_versions=t.generated_versions,
        target_length=target_length,
    )


class StoreUnreachable(TransportError):
    """The TS could not be reached for a request, on a new connection either."""


class InstanceStore:
    """The TS as one rollout instance uses it (see the module docstring)."""

    def __init__(
        self,
        instance_id: str,
        address: Sequence[Any],
        token: str | None,
        *,
        timeout_s: float = 60.0,
    ) -> None:
        self.instance_id = instance_id
        self.link = AsyncStoreLink(address, token, timeout_s=timeout_s)
        self._uncertain: set[str] = set()  # carried by a request whose answer was lost
        self._log = log.bind(instance=instance_id)

    async def connect(self) -> None:
        """Open the connection now (a TS that cannot be reached fails the caller at once)."""
        await self.link.run(lambda ts: ts.ping())

    async def close(self) -> None:
        await self.link.drop(closing=True)

    async def _call(self, op: Callable[[Any], Awaitable[T]], ids: Sequence[str]) -> T:
        """``op`` on the link. A failure other than the store's refusal makes ``ids``
        uncertain (unless nothing was sent) and the call is made once more (on a new
        connection if that one broke); if that fails too, :class:`StoreUnreachable`. Once the
        call is answered, ``ids`` are settled."""
        for attempt in (0, 1):
            try:
                out = await self.link.run(op, retry=False)
            except REFUSED:
                raise
            except Exception as e:
                if not isinstance(e, NotConnected):  # sent: it may have been carried out
                    self._uncertain.update(ids)
                if attempt:
                    raise StoreUnreachable(
                        f"the trajectory server cannot be reached: {e!r:.200}",
                        instance_id=self.instance_id,
                    ) from e
                self._log.warning("ts_connection_broken", error=repr(e)[:200])
                continue
            self._uncertain.difference_update(ids)
            return out
        raise AssertionError("unreachable")  # pragma: no cover

    async def _settled(self, tid: str, landed: Callable[[Any], bool]) -> bool:
        """The store refused ``tid``: whether a request for it whose answer was lost had landed
        (``landed(location)``); False for an id that was not uncertain. Raises
        :class:`StoreUnreachable` (``tid`` stays uncertain)."""
        if tid not in self._uncertain:
            return False
        try:
            (loc,) = await self._call(lambda ts: ts.locate([tid]), ())
        except REFUSED:  # e.g. unknown to the store
            loc = None
        self._uncertain.discard(tid)
        return loc is not None and landed(loc)

    async def route(
        self, ids: Sequence[str], version: int
    ) -> tuple[list[Any], list[tuple[str, str]]]:
        """Route ``ids`` to this instance at ``version``: their payloads (``Trajectory``
        records), and the ids the store refused with its reason (or that it could not be
        reached for, when no request for them was carried out). Raises
        :class:`StoreUnreachable` if a route whose answer was lost may have landed."""
        iid = self.instance_id

        def op(batch: Sequence[str]) -> Callable[[Any], Awaitable[Any]]:
            return lambda ts: ts.route(iid, batch, version)

        def payload(tid: str) -> Callable[[Any], Awaitable[Any]]:
            return lambda ts: ts.get(tid)

        try:
            return list(await self._call(op(ids), ids)), []
        except StoreUnreachable as e:
            return [], self._not_taken(ids, e)
        except REFUSED as e:  # all or nothing: one by one
            self._log.warning("route_refused", error=str(e)[:200])
        payloads: list[Any] = []
        refused: list[tuple[str, str]] = []
        for k, tid in enumerate(ids):
            try:
                payloads.extend(await self._call(op([tid]), [tid]))
                continue
            except StoreUnreachable as e:
                return payloads, refused + self._not_taken(ids[k:], e)
            except REFUSED as e1:
                error = str(e1)[:200]
            if await self._settled(tid, _running_on(iid)):  # the lost route had landed
                try:
                    payloads.append(await self._call(payload(tid), ()))
                    continue
                except REFUSED as e2:  # gone meanwhile
                    error = str(e2)[:200]
            refused.append((tid, error))
        return payloads, refused

    def _not_taken(self, ids: Sequence[str], error: StoreUnreachable) -> list[tuple[str, str]]:
        """Ids of a route the TS could not be reached for, as refused (they stay queued there);
        raises ``error`` if the route may have landed for any of them."""
        if self._uncertain.intersection(ids):
            raise error
        return [(tid, str(error)[:200]) for tid in ids]

    async def write(
        self, items: Sequence[Item], *, finished: bool
    ) -> tuple[list[Item], list[tuple[Item, str]], list[Item]]:
        """``finish`` (``finished``: the records are ``Completion``) or ``return_partial`` the
        items' records: ``(written, refused with the store's reason, unresolved)``; the
        unresolved ones could not be written nor settled because the TS could not be reached,
        and are for a later call."""
        if not items:
            return [], [], []
        iid = self.instance_id

        def op(batch: Sequence[Segment]) -> Callable[[Any], Awaitable[Any]]:
            if finished:  # the store answers a count: the tokens it holds need not come back
                return lambda ts: ts.finish(iid, batch, echo=False)
            return lambda ts: ts.return_partial(iid, batch)

        try:
            await self._call(op([seg for seg, _ in items]), [seg.trajectory_id for seg, _ in items])
            return list(items), [], []
        except StoreUnreachable:
            return [], [], list(items)
        except REFUSED as e:  # all or nothing: one by one
            self._log.warning("ts_write_refused", finished=finished, error=str(e)[:200])
        written: list[Item] = []
        refused: list[tuple[Item, str]] = []
        landed = LocationState.FINISHED if finished else LocationState.QUEUED
        for k, item in enumerate(items):
            seg = item[0]
            try:
                await self._call(op([seg]), [seg.trajectory_id])
                written.append(item)
                continue
            except StoreUnreachable:
                return written, refused, list(items[k:])
            except REFUSED as e1:  # e.g. dropped meanwhile: output discarded
                error = str(e1)[:200]
            try:
                if await self._settled(seg.trajectory_id, lambda loc: loc.state is landed):
                    written.append(item)
                    continue
            except StoreUnreachable:
                return written, refused, list(items[k:])
            refused.append((item, error))
        return written, refused, []


def _running_on(instance_id: str) -> Callable[[Any], bool]:
    """Whether a location places the trajectory on ``instance_id``."""
    return lambda loc: loc.state is LocationState.RUNNING and loc.instance_id == instance_id
