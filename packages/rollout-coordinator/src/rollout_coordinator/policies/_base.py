"""Types shared by the policies: what a policy sees, what it may ask, what it returns.

A policy is a set of pure functions. Each takes a :class:`CycleView` (the speculative instance
states, the queue view, versions and thresholds — read-only by contract) and, where admission
matters, an :class:`AdmissionPort` (the protocol's admission check and Reserve, injected by
the cycle so tests can hand-build it), and returns commands or decisions. Threaded state (a
baseline's batch counter) is passed in and returned, never hidden.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from typing import Protocol, TypeVar

import attrs

from rollout_coordinator._commands import Interrupt, Route, Sync
from rollout_coordinator._config import CoordinatorConfig
from rollout_coordinator._records import QueuedTrajectory, QueueView
from rollout_coordinator._speculative import InstanceState


def _none_preempted(instance_id: str) -> tuple[str, ...]:
    return ()


def _none_routed(instance_id: str) -> int | None:
    return None


@attrs.frozen(kw_only=True)
class CycleView:
    now: float
    instances: Mapping[str, InstanceState]
    queue: QueueView
    #: Newest version whose weights are published (instances may sync to it).
    latest_version: int
    #: Versions ≤ this can place nothing (protocol abort floor); such instances must sync.
    abort_floor: int
    config: CoordinatorConfig
    batch_size: int
    group_size: int
    eta: int
    #: ``n' - n``: the members a group starts beyond the ``n`` it keeps (the first ``n`` to
    #: finish are kept, the rest aborted as surplus).
    group_redundancy: int = 0
    #: Trajectories admitted (reserved) since start, and those lost (dropped/aborted) since.
    admitted_total: int = 0
    lost_total: int = 0
    #: The trajectories the coordinator routed to an instance to run there (into room, or
    #: shown running by a snapshot since) that sit in its engine's waiting queue: preempted, or
    #: refused because the instance filled since its snapshot. Not those routed to an
    #: instance known to be full (queued on purpose). Oldest route first; filled under the
    #: ``abort`` preemption rule only.
    preempted_ids: Callable[[str], tuple[str, ...]] = _none_preempted
    #: The smallest V_traj among the trajectories the coordinator routed to an instance and
    #: has not heard back about (None: none).
    oldest_routed: Callable[[str], int | None] = _none_routed

    @property
    def members(self) -> int:
        """``n'``: the trajectories a group starts (``group_size + group_redundancy``)."""
        return self.group_size + self.group_redundancy


class AdmissionPort(Protocol):
    """The protocol as routing needs it (implemented by the cycle over StalenessProtocol)."""

    def admissible(self, group_id: str, version: int) -> bool:
        """Would a new trajectory of this group be admitted at ``version``? No side effects."""
        ...

    def admit(self, item: QueuedTrajectory, version: int) -> int | None:
        """Reserve it at ``version``; returns the buffer, or None if refused."""
        ...

    def can_resume(self, item: QueuedTrajectory, version: int) -> bool:
        """May this queued partial run on an instance serving ``version``?"""
        ...

    def due(self, item: QueuedTrajectory) -> bool:
        """Is this queued partial's group reserved in the buffer the trainer takes next? It
        lands there or is aborted, and that training step waits for it. No side effects."""
        ...

    @property
    def admitted_groups(self) -> Container[str]:
        """The groups a member of which has been admitted (the others are *fresh*)."""
        ...

    def refuses_fresh(self, version: int) -> bool:
        """A fresh group was refused at ``version`` this cycle: :meth:`admissible` answers
        False for every fresh group there until the cycle ends. No side effects."""
        ...


@attrs.frozen(kw_only=True)
class RoutingResult:
    routes: list[Route]
    #: Instances that still had room and gain at the end because the queue ran out of
    #: admissible work for them (the "starving" set migration looks at). Empty when routing
    #: stopped early for another reason (route cap).
    hungry: frozenset[str] = frozenset()
    new_admitted: int = 0
    #: This router sends a queued partial to the oldest version that can serve it before any
    #: newer one (the cost-model router with ``partial_order="version"``): migration and due
    #: spreading then move work only toward instances no newer than the one it leaves, since
    #: the router would send it straight back.
    partials_oldest_first: bool = False


RoutingFn = Callable[[CycleView, AdmissionPort, int | None], RoutingResult]
"""(view, port, quota of new trajectories or None for unlimited) -> routes."""

SyncFn = Callable[[CycleView, AdmissionPort, int | None], list[Sync]]
"""(view, port, quota) -> syncs. Instances mid-sync must not be returned."""

VTrajLookup = Callable[[str], int | None]

MigrationFn = Callable[[CycleView, RoutingResult, VTrajLookup], list[Interrupt]]
"""(view, this cycle's routing result, V_traj lookup) -> interrupts (requeue=True)."""


@attrs.frozen(kw_only=True)
class GateState:
    """Threaded admission state of the baselines' gates (unused by others)."""

    batches_started: int = 0
    remaining: int = 0  # new trajectories still to admit for the open batch
    #: VeRL-Async: the published version whose sync window is open, and ``lost_total`` when
    #: it opened (work lost later is not refunded within the window).
    window_version: int = -1
    window_lost: int = 0


AdmissionGate = Callable[[CycleView, GateState], tuple[int | None, GateState]]
"""(view, state) -> (quota of new trajectories this cycle or None = unlimited, new state).
The cycle subtracts what routing actually admitted from ``remaining`` afterwards."""


_Fn = TypeVar("_Fn", bound=Callable[..., object])


def reads(*fields: str) -> Callable[[_Fn], _Fn]:
    """Declares the :class:`CoordinatorConfig` fields a strategy function reads (its
    decisions may change with them): :attr:`Policy.reads` is the union over a policy's
    functions, and a setting no function of the chosen policy reads can be refused by name.
    An unknown field name fails at import."""
    known = {a.name for a in attrs.fields(CoordinatorConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"reads(): not CoordinatorConfig fields: {unknown}")

    def mark(fn: _Fn) -> _Fn:
        setattr(fn, "config_fields", frozenset(fields))  # noqa: B010 (typed functions)
        return fn

    return mark


def fields_read(fn: object) -> frozenset[str]:
    """The fields ``fn`` was declared to read with :func:`reads` (none if it was not)."""
    found: object = getattr(fn, "config_fields", None)
    return frozenset(str(f) for f in found) if isinstance(found, frozenset) else frozenset()


def eligible(inst: InstanceState, floor: int) -> bool:
    """Can this instance take work at its version-after-sync?"""
    return inst.target_version > floor
