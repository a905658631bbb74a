"""LedgerBase: the trajectory/group ledger both protocols keep (internal).

``StalenessProtocol`` (bounded, per-version buffers) and ``UnboundedFifo`` (no bound, one FIFO)
differ only in where a group waits between admission and consumption. Everything else is the
same bookkeeping and lives here once: id/version/reason validation, ledger lookups and records,
state counters, caller aborts and group drops, the abort/replacement outboxes, statistics, and
the ledger half of ``to_dict`` / ``from_dict``.

A subclass supplies the placement half: ``_release_slot`` (a closing group leaves its buffer
slot or FIFO place), ``_occupy`` (a group has ``n`` finished members), ``_buffer_fills``
(``stats().buffers``), ``_FORMAT`` and ``_restore``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, Self

from ._ledger import Group, Traj
from ._records import (
    Abort,
    AbortReason,
    BufferFill,
    GroupRecord,
    GroupState,
    ProtocolStats,
    ReplacementRequest,
    TrajectoryRecord,
    TrajectoryState,
)
from .errors import (
    CorruptState,
    DuplicateTrajectory,
    GroupClosed,
    InvalidId,
    InvalidVersion,
    ProtocolError,
    TrajectoryNotInFlight,
    UnknownGroup,
    UnknownTrajectory,
)

Id = str | int

_IN_FLIGHT = TrajectoryState.IN_FLIGHT
_FINISHED = TrajectoryState.FINISHED
_OCCUPIED = TrajectoryState.OCCUPIED
_CONSUMED = TrajectoryState.CONSUMED
_RESERVED_G = GroupState.RESERVED
_OCCUPIED_G = GroupState.OCCUPIED


def _check_id(value: Any, field: str) -> None:
    cls = type(value)
    if cls is not str and cls is not int:
        if isinstance(value, str | int) and not isinstance(value, bool):
            return  # subclasses (e.g. IntEnum) are fine
        raise InvalidId(
            f"{field}={value!r} is invalid: allowed a str or an int", field=field, value=value
        )


def _check_reason(reason: Any) -> None:
    if not isinstance(reason, str) or not reason:
        raise InvalidId(
            f"reason={reason!r} is invalid: allowed a non-empty str",
            field="reason",
            value=reason,
        )


class LedgerConfig(Protocol):
    """What the shared ledger reads from either config."""

    @property
    def filtering(self) -> bool: ...


class LedgerBase:
    """Shared ledger state and the methods that only touch it."""

    _FORMAT: ClassVar[str]  # the checkpoint format name

    __slots__ = (
        "_aborts",
        "_aborts_by_reason",
        "_config",
        "_consumed_batches",
        "_gcount",
        "_group_hist",
        "_groups",
        "_n",
        "_next_replacement",
        "_replacements",
        "_replacements_requested",
        "_tcount",
        "_traj_hist",
        "_trajs",
        "_version",
    )

    _config: LedgerConfig

    def _init_ledger(self, group_size: int, start_version: Any) -> None:
        """Validate ``start_version`` and set up an empty ledger (after the config check)."""
        if type(start_version) is not int or start_version < 0:
            raise InvalidVersion(
                f"start_version={start_version!r} is invalid: allowed an int >= 0",
                version=start_version,
                current_version=0,
            )
        self._n = group_size
        self._version = start_version
        self._groups: dict[Id, Group] = {}
        self._trajs: dict[Id, Traj] = {}
        self._aborts: list[Abort] = []
        self._replacements: list[ReplacementRequest] = []
        self._next_replacement = 0
        self._replacements_requested = 0
        self._tcount: dict[TrajectoryState, int] = dict.fromkeys(TrajectoryState, 0)
        self._gcount: dict[GroupState, int] = dict.fromkeys(GroupState, 0)
        self._traj_hist: dict[int, int] = {}
        self._group_hist: dict[int, int] = {}
        self._aborts_by_reason: dict[str, int] = {}
        self._consumed_batches = 0

    # ------------------------------------------------------------------ placement (subclass)

    @property
    def abort_floor(self) -> int:
        raise NotImplementedError

    def _release_slot(self, g: Group) -> None:
        """A RESERVED or OCCUPIED group is closing: free its buffer slot or FIFO place."""
        raise NotImplementedError

    def _occupy(self, g: Group) -> int:
        """``n`` members of ``g`` have finished: place the group; returns the finish() value."""
        raise NotImplementedError

    def _buffer_fills(self) -> tuple[BufferFill, ...]:
        raise NotImplementedError

    @classmethod
    def _restore(cls, data: dict[str, Any]) -> Self:
        raise NotImplementedError

    # ------------------------------------------------------------------ properties

    @property
    def current_version(self) -> int:
        """Newest published model version; the next ``consume`` trains it (bounded: taking
        buffer ``current_version``)."""
        return self._version

    # ------------------------------------------------------------------ validation

    def _check_version(self, version: Any, field: str = "version") -> None:
        if type(version) is int and 0 <= version <= self._version:
            return
        if (
            isinstance(version, int)
            and not isinstance(version, bool)
            and 0 <= version <= self._version
        ):
            return  # int subclasses (e.g. IntEnum) are fine
        raise InvalidVersion(
            f"{field}={version!r} is invalid: allowed an int in [0, {self._version}] "
            "(no instance can be ahead of the current version)",
            version=version,
            current_version=self._version,
        )

    def _check_new_trajectory(self, group_id: Id, trajectory_id: Id, version: int) -> None:
        """``reserve``'s input checks: id types, version range, trajectory id unused."""
        _check_id(group_id, "group_id")
        _check_id(trajectory_id, "trajectory_id")
        self._check_version(version)
        if trajectory_id in self._trajs:
            raise DuplicateTrajectory(
                f"trajectory_id {trajectory_id!r} is already in the ledger "
                f"({self._trajs[trajectory_id].state.value})",
                trajectory_id=trajectory_id,
                group_id=group_id,
            )

    def can_resume(self, trajectory_id: Id, instance_version: int) -> bool:
        """May this in-flight (e.g. interrupted) trajectory continue on an instance at this version?

        True iff it is in flight and ``V_traj ≤ instance_version``. V_traj (and, when bounded,
        the reservation) are kept; resuming needs no protocol call.
        """
        t = self._traj(trajectory_id)
        self._check_version(instance_version, "instance_version")
        return t.state is _IN_FLIGHT and t.version <= instance_version

    # ------------------------------------------------------------------ ledger entries

    def _traj(self, trajectory_id: Id) -> Traj:
        t = self._trajs.get(trajectory_id)
        if t is None:
            _check_id(trajectory_id, "trajectory_id")
            raise UnknownTrajectory(
                f"unknown trajectory_id {trajectory_id!r}", trajectory_id=trajectory_id
            )
        return t

    def _group(self, group_id: Id) -> Group:
        g = self._groups.get(group_id)
        if g is None:
            _check_id(group_id, "group_id")
            raise UnknownGroup(f"unknown group_id {group_id!r}", group_id=group_id)
        return g

    def _set_state(self, t: Traj, state: TrajectoryState) -> None:
        tcount = self._tcount
        tcount[t.state] -= 1
        tcount[state] += 1
        t.state = state

    def _set_group_state(self, g: Group, state: GroupState) -> None:
        self._gcount[g.state] -= 1
        self._gcount[state] += 1
        g.state = state

    # ------------------------------------------------------------------ transitions

    def _kill(self, t: Traj, state: TrajectoryState, reason: str, *, queue: bool) -> Abort:
        """Move a live trajectory to ABORTED/DROPPED; optionally queue the Abort command."""
        was_running = t.state is _IN_FLIGHT
        reason = str(reason)  # AbortReason members become plain JSON-friendly strings
        self._set_state(t, state)
        t.reason = reason
        t.buffer = None
        abort = Abort(
            trajectory_id=t.trajectory_id,
            group_id=t.group_id,
            version=t.version,
            reason=reason,
            was_running=was_running,
        )
        if state is TrajectoryState.ABORTED:
            self._aborts_by_reason[reason] = self._aborts_by_reason.get(reason, 0) + 1
        if queue:
            self._aborts.append(abort)
        return abort

    def _group_version(self, g: Group) -> int | None:
        """The group's version: the smallest V_traj of its live members (None if it has none)."""
        trajs = self._trajs
        return min((trajs[t].version for t in g.members), default=None)

    def _close_group(
        self, g: Group, state: GroupState, reason: str, tstate: TrajectoryState
    ) -> list[Abort]:
        """Release the group's slot and end all its live members (each Abort is queued)."""
        self._release_slot(g)
        trajs = self._trajs
        aborts = [self._kill(trajs[tid], tstate, reason, queue=True) for tid in g.members]
        g.members.clear()
        g.finished.clear()
        g.buffer = None
        g.reason = str(reason)
        self._set_group_state(g, state)
        return aborts

    def _abort_group_surplus(self, g: Group) -> None:
        """``g`` has ``n`` finished members: abort the others still running (queued)."""
        trajs = self._trajs
        for tid in [m for m in g.members if trajs[m].state is _IN_FLIGHT]:
            del g.members[tid]
            self._kill(trajs[tid], TrajectoryState.ABORTED, AbortReason.GROUP_SURPLUS, queue=True)

    def _request_replacement(self, group_id: Id, reason: str) -> ReplacementRequest:
        req = ReplacementRequest(
            request_id=self._next_replacement, replaces_group_id=group_id, reason=str(reason)
        )
        self._next_replacement += 1
        self._replacements_requested += 1
        self._replacements.append(req)
        return req

    def finish(self, trajectory_id: Id) -> int | None:
        """Record that a trajectory finished and was rewarded.

        When the ``n``-th member of its group finishes, the group completes: the other running
        members are aborted (group surplus, queued in ``take_aborts``) and the group is placed
        (bounded: the earliest legal buffer, returned; unbounded: the FIFO tail, returning the
        version it will be trained at). Returns None while the group is incomplete.
        """
        t = self._traj(trajectory_id)
        if t.state is not _IN_FLIGHT:
            raise TrajectoryNotInFlight(
                f"cannot finish trajectory {trajectory_id!r}: it is {t.state.value}"
                + (f" ({t.reason})" if t.reason else ""),
                trajectory_id=trajectory_id,
                group_id=t.group_id,
                state=t.state.value,
            )
        g = self._groups[t.group_id]
        self._set_state(t, _FINISHED)
        g.finished.append(trajectory_id)
        if len(g.finished) < self._n:
            return None
        return self._occupy(g)

    def abort(self, trajectory_id: Id, reason: str) -> None:
        """The caller aborted an in-flight trajectory (e.g. interruption it will not resume).

        Its group stays in flight (keeps its reservation): a new sibling may be reserved to
        replace it, or the caller drops the group. Not queued in ``take_aborts`` (the caller
        already knows).
        """
        t = self._traj(trajectory_id)
        _check_reason(reason)
        if t.state is not _IN_FLIGHT:
            raise TrajectoryNotInFlight(
                f"cannot abort trajectory {trajectory_id!r}: it is {t.state.value}",
                trajectory_id=trajectory_id,
                group_id=t.group_id,
                state=t.state.value,
            )
        del self._groups[t.group_id].members[trajectory_id]
        self._kill(t, TrajectoryState.ABORTED, reason, queue=False)

    def drop_group(self, group_id: Id, reason: str) -> tuple[Abort, ...]:
        """Filter a group out (e.g. all rewards equal): release its reservation, slot or FIFO place.

        Works on RESERVED and OCCUPIED (not yet consumed) groups. Every live member becomes
        DROPPED with ``reason``; one Abort record per member is queued in ``take_aborts`` and
        returned (``was_running`` tells an engine-held trajectory from a finished one whose
        stored result is discarded). With ``filtering`` on, a replacement prompt is requested.
        """
        g = self._group(group_id)
        _check_reason(reason)
        if g.state is not _RESERVED_G and g.state is not _OCCUPIED_G:
            raise GroupClosed(
                f"cannot drop group {group_id!r}: it is {g.state.value}",
                group_id=group_id,
                state=g.state.value,
            )
        aborts = self._close_group(g, GroupState.DROPPED, reason, TrajectoryState.DROPPED)
        if self._config.filtering:
            self._request_replacement(group_id, reason)
        return tuple(aborts)

    # ------------------------------------------------------------------ outboxes

    def take_aborts(self) -> tuple[Abort, ...]:
        """Drain the protocol-initiated abort commands queued since the last call."""
        out = tuple(self._aborts)
        self._aborts.clear()
        return out

    def take_replacements(self) -> tuple[ReplacementRequest, ...]:
        """Drain the replacement-prompt requests queued since the last call."""
        out = tuple(self._replacements)
        self._replacements.clear()
        return out

    @property
    def pending_aborts(self) -> int:
        return len(self._aborts)

    @property
    def pending_replacements(self) -> int:
        return len(self._replacements)

    # ------------------------------------------------------------------ queries

    def trajectory(self, trajectory_id: Id) -> TrajectoryRecord:
        """Ledger entry for any trajectory ever reserved (in flight, consumed, dropped, aborted)."""
        return self._traj(trajectory_id).record()

    def group(self, group_id: Id) -> GroupRecord:
        return self._group(group_id).record()

    def in_flight(self) -> tuple[Id, ...]:
        """Ids of all in-flight trajectories (O(ledger); for inspection, not the hot path)."""
        return tuple(tid for tid, t in self._trajs.items() if t.state is _IN_FLIGHT)

    def stats(self) -> ProtocolStats:
        return ProtocolStats(
            current_version=self._version,
            abort_floor=self.abort_floor,
            trajectories_by_state={s.value: n for s, n in self._tcount.items()},
            groups_by_state={s.value: n for s, n in self._gcount.items()},
            buffers=self._buffer_fills(),
            staleness_histogram=dict(sorted(self._traj_hist.items())),
            group_staleness_histogram=dict(sorted(self._group_hist.items())),
            aborts_by_reason=dict(sorted(self._aborts_by_reason.items())),
            consumed_batches=self._consumed_batches,
            replacements_requested=self._replacements_requested,
            pending_aborts=len(self._aborts),
            pending_replacements=len(self._replacements),
        )

    # ------------------------------------------------------------------ checkpoint

    def _ledger_to_dict(self) -> dict[str, Any]:
        """The ledger half of ``to_dict``, in its key order (it follows the placement keys)."""
        return {
            "groups": [
                [g.group_id, g.state.value, g.buffer, list(g.members), list(g.finished), g.reason]
                for g in self._groups.values()
            ],
            "trajectories": [
                [t.trajectory_id, t.group_id, t.version, t.state.value, t.buffer, t.reason]
                for t in self._trajs.values()
            ],
            "pending_aborts": [
                [a.trajectory_id, a.group_id, a.version, a.reason, a.was_running]
                for a in self._aborts
            ],
            "pending_replacements": [
                [r.request_id, r.replaces_group_id, r.reason] for r in self._replacements
            ],
            "next_replacement_id": self._next_replacement,
            "replacements_requested": self._replacements_requested,
            "staleness_histogram": [[s, n] for s, n in sorted(self._traj_hist.items())],
            "group_staleness_histogram": [[s, n] for s, n in sorted(self._group_hist.items())],
            "aborts_by_reason": dict(sorted(self._aborts_by_reason.items())),
            "consumed_batches": self._consumed_batches,
        }

    def _restore_outboxes_and_counters(self, data: dict[str, Any]) -> None:
        """The part of restore after groups and trajectories: outboxes, histograms, counters."""
        self._aborts = [
            Abort(trajectory_id=a[0], group_id=a[1], version=a[2], reason=a[3], was_running=a[4])
            for a in data["pending_aborts"]
        ]
        self._replacements = [
            ReplacementRequest(request_id=r[0], replaces_group_id=r[1], reason=r[2])
            for r in data["pending_replacements"]
        ]
        self._next_replacement = int(data["next_replacement_id"])
        self._replacements_requested = int(data["replacements_requested"])
        self._traj_hist = {int(s): int(n) for s, n in data["staleness_histogram"]}
        self._group_hist = {int(s): int(n) for s, n in data["group_staleness_histogram"]}
        self._aborts_by_reason = {str(k): int(v) for k, v in data["aborts_by_reason"].items()}
        self._consumed_batches = int(data["consumed_batches"])

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """Restore a state written by ``to_dict`` (also after a JSON round trip); a dict that
        is not a consistent state raises CorruptState."""
        try:
            return cls._restore(data)
        except ProtocolError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise CorruptState(f"not a {cls._FORMAT} state: {type(exc).__name__}: {exc}") from exc
