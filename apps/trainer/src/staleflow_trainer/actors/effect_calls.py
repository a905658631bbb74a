"""How the control shell carries out the control core's simple effects: submit groups, route and
interrupt trajectories on instances, drop and free them in the trajectory server.

:class:`EffectCalls` is mixed into :class:`~staleflow_trainer.actors.shell_io.ShellIO`.
:meth:`~EffectCalls.carry_all` runs the calls to one instance one after another in its lane
(``actors.lanes``) and those to different instances at the same time; the cycle waits
``ANSWER_WAIT_S`` at most for them, and a call that answers later is handed on in a later cycle
(:meth:`~EffectCalls.take_late`): the instance is silent meanwhile (``actors.silence``) and routes
queued to it are taken back. An interrupt's answer carries the interrupted trajectories'
outcomes, handed on as ``Reported`` events. A trajectory server refusal for ids already dropped
or freed is tolerated; an instance found dead, or whose route or interrupt failed, leaves the
run (``ShellIO.lose``).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from engine_adapters import pack_ids, unpack_ids
from staleflow_trainer.actors.group_submit import GroupSubmitter
from staleflow_trainer.actors.io_bytes import ByteCounts, size
from staleflow_trainer.actors.lanes import ANSWER_WAIT_S, Lanes
from staleflow_trainer.actors.liveness import is_actor_death
from staleflow_trainer.actors.rollout_wire import interrupt_outcomes
from staleflow_trainer.actors.silence import Silence
from staleflow_trainer.control import effects as fx
from staleflow_trainer.control.events import InstanceLost, InstanceSilent, Outcome, Reported
from trajectory_server.errors import StateError, TrajectoryServerError

log = structlog.get_logger(__name__)


class EffectCalls:
    """Mixed into ``ShellIO``, which sets these attributes and provides the methods below."""

    rollouts: dict[str, Any]
    ts: Any
    groups: GroupSubmitter
    submitted: dict[str, int]
    lanes: Lanes
    silence: Silence
    wake: asyncio.Event
    _counts: ByteCounts
    _killed: set[str]
    _polls: dict[str, tuple[asyncio.Task[Any], Any, set[str], str]]
    _interrupted: list[tuple[str, list[Outcome]]]
    _ended: dict[str, set[str]]
    _late: list[InstanceLost]

    if TYPE_CHECKING:  # ShellIO's and BackgroundCalls'

        def spawn(self, coro: Any) -> None: ...
        def touch(self, iid: str) -> None: ...
        def end_instance(self, iid: str, what: str, error: BaseException) -> RuntimeError: ...
        def _limit(self, what: str) -> tuple[str, float]: ...
        async def _within(self, call: Any, what: str) -> Any: ...
        async def lose(self, iid: str, error: BaseException, at: float) -> InstanceLost | None: ...

    async def carry_all(
        self, effects: Sequence[fx.Effect], now: Callable[[], float]
    ) -> list[InstanceLost | Reported | InstanceSilent]:
        """Carry out simple effects: those for one instance (or none) one after another, in
        order, those for different instances at the same time (routes to a silent instance are
        taken back). Returned: the events of :meth:`take_late`, then for each instance found
        dead (it leaves the run, :meth:`lose`) its ``InstanceLost``."""
        chains: dict[str, list[fx.Effect]] = {}
        for e in effects:
            chains.setdefault(str(getattr(e, "instance_id", "")), []).append(e)
        queued = ((i, self.silence.queue(i, es) if i else es) for i, es in chains.items())
        chains = {i: es for i, es in queued if es}

        async def chain(es: list[fx.Effect]) -> tuple[str, BaseException] | None:
            first = None
            for e in es:
                lost = await self.carry(e)
                first = first or lost
            return first

        # an instance's chain runs in its lane; the cycle waits ANSWER_WAIT_S at most for
        # those of instances with no call out before, for none behind one, and for the TS's
        waited: dict[str, asyncio.Task[tuple[str, BaseException] | None]] = {}
        ts_chain = chains.pop("", [])
        for iid, es in chains.items():
            behind = self.lanes.busy(iid)
            self.touch(iid)  # queued: an answer to a poll sent before lacks its effect
            t = self.lanes.run(iid, functools.partial(chain, es))
            if behind:
                self._spawn_late(t, now)
            else:
                waited[iid] = t
        if ts_chain:
            await chain(ts_chain)
        if waited:
            await asyncio.wait(waited.values(), timeout=ANSWER_WAIT_S)
        got = [t.result() for t in waited.values() if t.done()]
        for iid, t in waited.items():
            if not t.done():
                self._late_answer(
                    iid, "+".join(sorted({type(e).__name__.lower() for e in chains[iid]}))
                )
                self._spawn_late(t, now)
        out = self.take_late(now())
        for iid, err in filter(None, got):
            if (lost := await self.lose(iid, err, now())) is not None:
                out.append(lost)
        return out

    def _late_answer(self, iid: str, call: str) -> None:
        log.warning("instance_answer_late", instance=iid, call=call, waited_s=ANSWER_WAIT_S,
                    lost_after_s=self._limit(call)[1])  # fmt: skip
        self.silence.overdue(iid)

    def _spawn_late(self, t: asyncio.Task[Any], now: Callable[[], float]) -> None:
        """A chain of calls the cycle did not wait for: an instance it ends is lost once it
        ends, and the event waits for the next cycle (:meth:`take_late`)."""

        async def late() -> None:
            got: tuple[str, BaseException] | None = await t
            if got is not None and (lost := await self.lose(got[0], got[1], now())):
                self._late.append(lost)
            self.wake.set()

        self.spawn(late())

    def take_late(self, at: float) -> list[InstanceLost | Reported | InstanceSilent]:
        """The outcomes that interrupts answered with (as ``Reported`` events, no snapshot: the
        instance's next poll does not repeat them), the instances silent or answering again,
        then the instances lost by calls that ended after their cycle, not yet handed on."""
        out: list[InstanceLost | Reported | InstanceSilent] = [
            Reported(at=at, instance_id=iid, outcomes=outcomes)
            for iid, outcomes in self._interrupted  # an instance lost later reports them first
        ]
        self.silence.answered(lambda i: self.lanes.busy(i) or i in self._polls)
        out += self.silence.take_events(at)
        out.extend(self._late)
        self._interrupted, self._late = [], []
        return out

    async def carry(self, e: fx.Effect) -> tuple[str, BaseException] | None:
        """Carry out one simple effect; returns ``(instance, error)`` if an instance died."""
        if isinstance(e, fx.SubmitGroups):
            await self._submit(e.groups)
            self.submitted.update((g.group_id, g.row) for g in e.groups)
        elif isinstance(e, fx.Route):
            h = self.rollouts.get(e.instance_id)
            sending = self.silence.sending(e)  # (not: taken back while it waited)
            if h is None or e.instance_id in self._killed or not sending:
                return None
            args = (e.version, pack_ids(e.trajectory_ids))
            self._counts.count("instances", size(args), "route")
            self.touch(e.instance_id)
            try:
                answer = await self._within(h.submit.remote(*args), "route")
                self._counts.count("instances", size(answer), "route_answer")
            except Exception as err:  # the instance died, or its state is now unknown
                if is_actor_death(err):
                    return e.instance_id, err
                return e.instance_id, self.end_instance(e.instance_id, "route", err)
            finally:
                self.touch(e.instance_id)
        elif isinstance(e, fx.Interrupt):
            h = self.rollouts.get(e.instance_id)
            if h is not None and e.instance_id not in self._killed:
                packed = pack_ids(e.trajectory_ids)
                self._counts.count("instances", size((packed, True)), "interrupt")
                self.touch(e.instance_id)
                try:
                    answer = await self._within(h.interrupt.remote(packed, True), "interrupt")
                    self._counts.count("instances", size(answer), "interrupt_answer")
                    self._took(e.instance_id, unpack_ids(packed), answer)
                except Exception as err:
                    if not is_actor_death(err):  # its state is unknown: it leaves the run
                        err = self.end_instance(e.instance_id, "interrupt", err)
                    if e.requeue:  # else its death shows at its next poll
                        return e.instance_id, err
                finally:
                    self.touch(e.instance_id)
            if not e.requeue:  # the output came back to the store: discard it there
                await self._ts_tolerant("drop", list(e.trajectory_ids), e.reason)
        elif isinstance(e, fx.Drop):
            await self._ts_tolerant("drop", list(e.trajectory_ids), e.reason)
        elif isinstance(e, fx.DropGroup):
            try:
                await self.ts.drop_group(e.group_id, e.reason)
            except TrajectoryServerError as err:
                log.debug("drop_group_noop", group_id=e.group_id, error=str(err)[:200])
        elif isinstance(e, fx.Release):
            await self._ts_tolerant("free", list(e.trajectory_ids))
        return None

    def _took(self, iid: str, ids: Sequence[str], answer: Sequence[Any]) -> None:
        """An interrupt's answer (``rollout_wire.interrupt_outcomes``), handed on later."""
        if got := interrupt_outcomes(iid, ids, answer):
            outcomes = [Outcome(trajectory_id=t, generated=g, finish=f) for t, g, f in got]
            self._interrupted.append((iid, outcomes))
            self._ended.setdefault(iid, set()).update(o.trajectory_id for o in outcomes)

    async def _submit(self, groups: Sequence[fx.GroupSpec]) -> None:
        await self.groups.submit(self.ts, groups)

    async def _ts_tolerant(self, op: str, ids: list[str], *args: Any) -> None:
        """A TS call on many ids that tolerates the ones already in the target state (a
        ``StateError``: dropped or freed before); any other refusal is logged as a warning."""
        if not ids:
            return
        fn = getattr(self.ts, op)
        try:
            await fn(ids, *args)
            return
        except TrajectoryServerError:
            pass
        for tid in ids:
            try:
                await fn([tid], *args)
            except StateError as err:
                log.debug(f"{op}_noop", trajectory_id=tid, error=str(err)[:200])
            except TrajectoryServerError as err:  # not about the id: the call itself failed
                log.warning(f"{op}_failed", trajectory_id=tid, error=repr(err)[:200])
