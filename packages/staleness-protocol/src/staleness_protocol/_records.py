"""Records the protocol hands out: batches, abort commands, ledger entries, statistics."""

from __future__ import annotations

import enum

import attrs

Id = str | int


class TrajectoryState(enum.StrEnum):
    """Lifecycle of one trajectory in the ledger."""

    IN_FLIGHT = "in_flight"  # reserved; running, queued for resume, or interrupted (partial)
    FINISHED = "finished"  # rewarded; its group waits for siblings
    OCCUPIED = "occupied"  # its group sits OCCUPIED in a buffer
    CONSUMED = "consumed"  # trained on
    DROPPED = "dropped"  # its group was filtered out (reason recorded)
    ABORTED = "aborted"  # aborted (reason recorded)


class GroupState(enum.StrEnum):
    """Lifecycle of one group entry."""

    RESERVED = "reserved"
    OCCUPIED = "occupied"
    CONSUMED = "consumed"
    DROPPED = "dropped"
    ABORTED = "aborted"


class AbortReason(enum.StrEnum):
    """Why the protocol (not the caller) aborted a trajectory."""

    GROUP_SURPLUS = "group_surplus"  # group redundancy: n members already finished
    BATCH_SURPLUS = "batch_surplus"  # batch redundancy: the buffer became READY without it
    STALE = "stale"  # every buffer its version could reach is READY (v <= abort floor)
    STUCK = "stuck"  # straggler in a stuck buffer (resolve_stuck)
    DROPPED = "dropped"  # its group was dropped (drop_group) while it was still running


class SlotState(enum.StrEnum):
    EMPTY = "empty"
    RESERVED = "reserved"
    OCCUPIED = "occupied"


@attrs.frozen(kw_only=True)
class Abort:
    """Command: stop this trajectory and discard its output (the caller acts; sans-IO).

    ``was_running`` is True when the trajectory was in flight (an engine or the trajectory
    server holds it); False when it had already finished (only its stored result is discarded).
    """

    trajectory_id: Id
    group_id: Id
    version: int
    reason: str
    was_running: bool


@attrs.frozen(kw_only=True)
class ReplacementRequest:
    """Request: admit one fresh prompt (a new group) to replace ``replaces_group_id``."""

    request_id: int
    replaces_group_id: Id
    reason: str


@attrs.frozen(kw_only=True)
class Batch:
    """One consumed buffer: train version ``version`` into ``version + 1`` on it.

    ``group_ids``, ``trajectory_ids``, ``group_versions`` and ``staleness`` are aligned (slot
    order). ``staleness[i] = version - group_versions[i]``, the largest staleness of any member of
    group ``i`` (member staleness is ``version - V_traj``; see ``trajectory_staleness``).
    """

    version: int
    group_ids: tuple[Id, ...]
    trajectory_ids: tuple[tuple[Id, ...], ...]
    group_versions: tuple[int, ...]
    staleness: tuple[int, ...]
    trajectory_staleness: tuple[tuple[int, ...], ...]

    def staleness_of(self, group_id: Id) -> int:
        return self.staleness[self.group_ids.index(group_id)]


@attrs.frozen(kw_only=True)
class TrajectoryRecord:
    """Ledger entry of one trajectory. ``buffer`` is its group's buffer while it has one."""

    trajectory_id: Id
    group_id: Id
    version: int
    state: TrajectoryState
    buffer: int | None
    reason: str | None


@attrs.frozen(kw_only=True)
class GroupRecord:
    group_id: Id
    state: GroupState
    buffer: int | None
    members: tuple[Id, ...]  # live members: in flight or finished (kept)
    finished: tuple[Id, ...]
    reason: str | None


@attrs.frozen(kw_only=True)
class BufferFill:
    version: int
    occupied: int
    reserved: int
    free: int
    ready: bool


@attrs.frozen(kw_only=True)
class GroupMove:
    group_id: Id
    from_buffer: int
    to_buffer: int


@attrs.frozen(kw_only=True)
class StuckResolution:
    """What ``resolve_stuck()`` did. ``resolved`` is False when the buffer was not stuck.

    The abort records are also queued for ``take_aborts()`` and the replacement requests for
    ``take_replacements()``; act on them there (these fields are informational).
    """

    resolved: bool
    buffer: int
    aborted: tuple[Abort, ...] = ()
    moved: tuple[GroupMove, ...] = ()
    replacements: tuple[ReplacementRequest, ...] = ()


@attrs.frozen(kw_only=True)
class ProtocolStats:
    """A snapshot of counters. Histograms map staleness -> count of consumed items."""

    current_version: int
    abort_floor: int
    trajectories_by_state: dict[str, int]
    groups_by_state: dict[str, int]
    buffers: tuple[BufferFill, ...]
    staleness_histogram: dict[int, int]  # per consumed trajectory
    group_staleness_histogram: dict[int, int]  # per consumed group
    aborts_by_reason: dict[str, int]
    consumed_batches: int
    replacements_requested: int
    pending_aborts: int
    pending_replacements: int
