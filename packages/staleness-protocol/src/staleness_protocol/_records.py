"""Records the protocol hands out: answers, notices, batches, ledger entries, statistics."""

from __future__ import annotations

import enum

import attrs

Id = str | int


class TrajectoryState(enum.StrEnum):
    """Lifecycle of one trajectory in the ledger."""

    IN_FLIGHT = "in_flight"  # reserved; running, queued for resume, or interrupted (partial)
    FINISHED = "finished"  # rewarded; its group waits for siblings
    OCCUPIED = "occupied"  # its group sits OCCUPIED in a buffer
    CONSUMED = "consumed"  # trained on (then retired: only counted)
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
    """Why the protocol (not the caller) aborted a trajectory or a group."""

    GROUP_SURPLUS = "group_surplus"  # group redundancy: n members already finished
    BATCH_SURPLUS = "batch_surplus"  # batch redundancy: the buffer became READY without it
    STALE = "stale"  # every buffer its version could reach is READY (v <= abort floor)
    STUCK = "stuck"  # straggler in a stuck buffer (resolve_stuck)
    DROPPED = "dropped"  # its group was dropped (drop_group) while it was still running


class Admission(enum.StrEnum):
    """``can_reserve``'s answer: what to do with a trajectory waiting to be admitted.

    ``ADMIT``: ``reserve`` succeeds now. ``WAIT``: keep it queued and ask again at the same
    version later (a slot may free up: a group finishes, is consumed, or is dropped).
    ``SYNC``: it can never be admitted at this version; retry only on an instance at a newer
    version (the version is at or below the abort floor, or a sibling at it would make its
    group too stale). ``DISCARD``: it can never be admitted at any version (its group is
    complete, closed or full): drop it.

    Truthiness is "admitted": ``bool(answer)`` is True for ``ADMIT`` only, so a loop written
    for the boolean ``can_reserve`` of 0.1 keeps its meaning.
    """

    ADMIT = "admit"
    WAIT = "wait"
    SYNC = "sync"
    DISCARD = "discard"

    def __bool__(self) -> bool:
        return self is Admission.ADMIT


class SlotState(enum.StrEnum):
    EMPTY = "empty"
    RESERVED = "reserved"
    OCCUPIED = "occupied"


# ---------------------------------------------------------------------------------- notices


@attrs.frozen(kw_only=True)
class Abort:
    """Notice: stop this trajectory and discard its output (the caller acts; sans-IO).

    ``version`` is its V_traj. ``was_running`` is True when it was in flight (an engine or
    a queue holds it: abort it there); False when it had already finished (only its stored
    result is discarded). ``reason`` is an :class:`AbortReason` value or, for a dropped
    group, the reason given to ``drop_group``.
    """

    trajectory_id: Id
    group_id: Id
    version: int
    reason: str
    was_running: bool


@attrs.frozen(kw_only=True)
class GroupAborted:
    """Notice: the protocol closed this group (READY rule, stuck resolution, or a FIFO's
    garbage collection). It takes no new member: drop its members you have not admitted yet.
    Its admitted members each have their own :class:`Abort` notice, queued just before."""

    group_id: Id
    reason: str


@attrs.frozen(kw_only=True)
class ReplacementRequest:
    """Notice: admit one fresh prompt (a new group) to replace ``replaces_group_id``."""

    request_id: int
    replaces_group_id: Id
    reason: str


#: What ``take_notices()`` returns, in the order the protocol decided them.
Notice = Abort | GroupAborted | ReplacementRequest


# ---------------------------------------------------------------------------------- results


class FinishStatus(enum.StrEnum):
    """What ``finish`` did."""

    WAITING = "waiting"  # kept; fewer than n members of its group have finished
    OCCUPIED = "occupied"  # the n-th: the group now occupies ``buffer``; it takes no members
    ALREADY_ENDED = "already_ended"  # the protocol ended it first: discard the output


@attrs.frozen(kw_only=True)
class FinishOutcome:
    """The answer of ``finish(trajectory_id)``.

    ``buffer``: for ``OCCUPIED``, the buffer the group now sits in (the FIFO protocols: the
    version it will be trained at if nothing ahead of it leaves). ``reason``: for
    ``ALREADY_ENDED``, why it was aborted or dropped (its :class:`Abort` notice was queued
    when that happened).
    """

    status: FinishStatus
    trajectory_id: Id
    group_id: Id
    buffer: int | None = None
    reason: str | None = None


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
    """Ledger entry of one trajectory that is live or recently ended (a tombstone).

    ``buffer`` is its group's buffer while it has one; ``reason`` is set once it is aborted
    or dropped.
    """

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
    buffer: int | None  # RESERVED: its reservation; OCCUPIED: its slot; CONSUMED: the version
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

    The stragglers it aborted and the replacement prompts it asked for are notices
    (``take_notices``); ``moved`` lists the finished groups it moved into ``buffer``.
    """

    resolved: bool
    buffer: int
    moved: tuple[GroupMove, ...] = ()


@attrs.frozen(kw_only=True)
class ProtocolStats:
    """A snapshot of counters. Histograms map staleness -> count of consumed items.

    ``trajectories_by_state`` / ``groups_by_state`` count live entries for the live states
    and every entry ever ended for the terminal ones (consumed, dropped, aborted).
    """

    next_buffer: int
    published_version: int
    abort_floor: int
    trajectories_by_state: dict[str, int]
    groups_by_state: dict[str, int]
    buffers: tuple[BufferFill, ...]
    staleness_histogram: dict[int, int]  # per consumed trajectory
    group_staleness_histogram: dict[int, int]  # per consumed group
    aborts_by_reason: dict[str, int]
    consumed_batches: int
    replacements_requested: int
    pending_notices: int
    tombstones: int
