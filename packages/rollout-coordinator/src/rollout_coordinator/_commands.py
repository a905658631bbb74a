"""Commands the coordinator issues, and the pending-route book that orders them.

Theory of operation
-------------------
Three commands, each about one instance, executed by the caller (app or simulator), plus
``Drop`` for protocol aborts of trajectories no engine holds:

* ``Route(trajectory_id, instance_id, version)`` — hand a queued trajectory to an instance.
  ``version`` is the trajectory's V_traj: for a new trajectory, the version the instance will
  serve it at (its version after any sync in flight), reserved through the protocol before the
  command exists (``reserved_buffer`` says where); for a partial, its unchanged V_traj.
* ``Interrupt(instance_id, trajectory_ids, reason)`` — take those trajectories back to the
  trajectory server with their partial output (migration, bounce; ``requeue=True``) or
  abort them because the protocol did (staleness-driven, group/batch surplus, dropped group;
  ``requeue=False``, ``reason`` is the protocol's AbortReason).
* ``Sync(instance_id, to_version)`` — the instance pulls ``to_version`` from the parameter
  server; its running work is interrupted and re-queued (partial rollout keeps V_traj).

Commands on different instances are independent and may run concurrently. The only
dependency is *route after sync*: a route decided for an instance that is mid-sync is held in
:class:`PendingRoutes` and released (returned by the next cycle) once the caller reports the
sync done; if the sync fails, the held routes come back as *orphans* (their reservations
stand; the coordinator remembers their V_traj so they are not reserved twice).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import NamedTuple

import attrs


def _id_tuple(ids: Iterable[str]) -> tuple[str, ...]:
    return tuple(ids)


class InterruptReason(enum.StrEnum):
    """Why the coordinator itself interrupts (re-queue). Protocol aborts carry the protocol's
    ``AbortReason`` string (``stale``, ``group_surplus``, ...) and ``requeue=False``."""

    MIGRATION = "migration"  # starving instance vs a loaded one
    BOUNCE = "bounce"  # the engine would preempt it into an already long waiting queue


class Route(NamedTuple):
    """Hand a queued trajectory to an instance. A named tuple (typed, immutable, compared by
    value like the other commands): a cycle at cluster scale builds hundreds, and a tuple is
    the cheapest record to build."""

    trajectory_id: str
    instance_id: str
    version: int
    group_id: str = ""
    new: bool = False
    reserved_buffer: int | None = None
    tokens: int = 0  # prompt + already generated tokens (what it brings into the KV cache)


@attrs.frozen(kw_only=True, slots=True)
class Interrupt:
    """Stop trajectories on an instance. ``requeue=True``: return them to the trajectory server
    with their partial output (migration, bounce). ``requeue=False``: the protocol aborted them
    (``reason`` is its AbortReason); discard their output."""

    instance_id: str
    trajectory_ids: tuple[str, ...] = attrs.field(converter=_id_tuple)
    reason: str
    requeue: bool = True


@attrs.frozen(kw_only=True, slots=True)
class Drop:
    """The protocol aborted these trajectories and no engine holds them as far as the
    coordinator knows (queued in the trajectory server, or already finished): discard them."""

    trajectory_ids: tuple[str, ...] = attrs.field(converter=_id_tuple)
    reason: str


@attrs.frozen(kw_only=True, slots=True)
class Sync:
    instance_id: str
    to_version: int


Command = Route | Interrupt | Sync | Drop


class PendingRoutes:
    """Routes waiting for their instance's sync to complete (route-after-sync dependency)."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[str, list[Route]] = {}

    def hold(self, route: Route) -> None:
        self._held.setdefault(route.instance_id, []).append(route)

    def release(self, instance_id: str) -> list[Route]:
        """The sync finished: these routes may now run."""
        return self._held.pop(instance_id, [])

    def orphan(self, instance_id: str) -> list[Route]:
        """The sync failed or the instance left: these routes will not run there."""
        return self._held.pop(instance_id, [])

    def discard(self, trajectory_ids: set[str]) -> list[Route]:
        """Forget held routes of these trajectories (the protocol aborted them before the
        sync finished); returns the routes removed."""
        removed: list[Route] = []
        for iid in list(self._held):
            keep: list[Route] = []
            for r in self._held[iid]:
                (removed if r.trajectory_id in trajectory_ids else keep).append(r)
            if keep:
                self._held[iid] = keep
            else:
                del self._held[iid]
        return removed

    def held_for(self, instance_id: str) -> list[Route]:
        return list(self._held.get(instance_id, ()))

    def __len__(self) -> int:
        return sum(len(v) for v in self._held.values())

    def trajectory_ids(self) -> set[str]:
        return {r.trajectory_id for routes in self._held.values() for r in routes}
