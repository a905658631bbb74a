"""StalenessProtocol: the global consistency protocol that bounds per-trajectory staleness.

Theory of operation
===================

Versions. Training step ``k`` turns model version ``k`` into ``k + 1``. Two versions are
tracked and never confused: ``next_buffer`` ``c`` is the buffer the next ``consume`` takes
(the version the next step trains); ``published_version`` ``p`` is the newest version whose
weights exist, advanced only by ``publish(p + 1)`` once that step has produced them. No
instance can be at a version above ``p``: admission and resumption there raise
VersionNotPublished. While a consumed step trains, ``p = c − 1``. Each trajectory gets
``V_traj`` when it is first routed (``reserve``) and keeps it through interruptions,
migration and resumption. A group's version is the minimum ``V_traj`` of its kept members.

Buffers. Buffer ``b`` holds the batch consumed by the step that trains version ``b``. It has
``B' = B + batch_redundancy`` slots and is READY at ``B`` OCCUPIED slots. Buffers are created
lazily, strictly in order, up to ``c + η``; buffer ``c`` is the one the trainer waits for and is
retired when consumed. A trajectory may be trained from buffer ``b`` only if
``V_traj ≤ b ≤ V_traj + η``; staleness is ``b − V_traj`` (queue time counts). As ``V_traj ≤ p``
at admission, the consumed staleness is the true one: the weights a sample was generated with
are at least as old as its ``V_traj``.

Reserve (first member of a group, version ``v ≤ p``): put a RESERVED entry in the LATEST buffer
``b ∈ [c, v + η]`` that is not READY and has a free slot — the worst case the group can need.
None: inadmissible. Siblings join the entry only if ``v_sibling + η ≥ b_entry``; a group admits
at most ``n' = n + group_redundancy`` live members. ``can_reserve`` runs the same check with no
side effects and answers an Admission: ADMIT, WAIT (no free slot now), SYNC (below the abort
floor, or a sibling too stale: only a newer instance can take it), DISCARD (group closed or full).

Occupy (automatically, when ``n`` members have finished): abort the other running members
(group surplus), free the reservation, and put the group OCCUPIED in the EARLIEST buffer
``b ∈ [c, v_group + η]`` that is not READY and has a free slot. ``b_entry`` itself qualifies once
its reservation is freed, so a group never lands later than its reservation: the bound holds
however long the trajectory runs, and early buffers fill first.

READY transition. When a buffer reaches ``B`` OCCUPIED slots, its remaining reservations (only
possible with spare slots) are aborted: ``stale`` if every buffer their version could reach is
now READY, else ``batch_surplus``. Hence no live reservation ever sits in a READY buffer.

Consume: the trainer takes buffer ``c`` when READY; ``c`` becomes ``c + 1``.

Abort floor: the highest ``u`` such that every buffer in ``[c, u + η]`` is READY (at least
``c − η − 1``, where the range is empty). Nothing generated at a version ``≤ u`` can be placed:
such instances must sync before taking new work (``must_sync``), and in-flight work with
``V_traj ≤ u`` is aborted — by the READY rule above, since its reservation lies in that range.

Partial rollout / migration: an interrupted trajectory simply stays IN_FLIGHT with its
reservation; resuming on any instance with version in ``[V_traj, p]`` needs no protocol call
(``can_resume`` checks it).

Filtering: ``drop_group`` releases a group's reservation (or its OCCUPIED slot, if it was already
placed) and, with ``filtering`` on, asks for a replacement prompt.

Stuck buffers (``stuck_threshold``): ``resolve_stuck`` — if buffer ``c`` lacks at most
``threshold`` groups and later buffers hold that many OCCUPIED groups, abort the reserved
stragglers in ``c`` (each asks for a replacement prompt) and move finished groups forward into
``c`` (moving earlier only lowers staleness: ``c ≥`` every live ``V_traj``).

Sans-IO: no clock, threads, I/O or logging. What the protocol decides on its own (aborted
trajectories, groups it closed, replacement prompts) is queued as notices, each exactly once,
for the caller to drain with ``take_notices``. Settled state is retired (``_ledger``): the
ledger holds live entries plus tombstones of what ended in the last ``tombstone_versions``
versions, so memory, checkpoints and per-call cost do not grow with the run.
"""

from __future__ import annotations

from typing import Any

from ._buffers import Buffer
from ._checks import check_id as _check_id
from ._config import ProtocolConfig
from ._ledger import Group, Traj
from ._ledger_base import (
    _IN_FLIGHT,
    _OCCUPIED,
    _RESERVED_G,
    LedgerBase,
)
from ._records import (
    AbortReason,
    Admission,
    Batch,
    BufferFill,
    GroupMove,
    GroupState,
    SlotState,
    StuckResolution,
    TrajectoryState,
)
from .errors import (
    BelowAbortFloor,
    GroupClosed,
    GroupFull,
    InvalidVersion,
    MechanismDisabled,
    NoFreeSlot,
    NotReady,
    SiblingTooStale,
)

Id = str | int

FORMAT = "staleness-protocol/2"

_ADMIT = Admission.ADMIT
_DISCARD = Admission.DISCARD


class StalenessProtocol(LedgerBase):
    """Tracks every trajectory's reservation and placement so that none exceeds staleness η."""

    _FORMAT = FORMAT

    __slots__ = ("_buffers", "_eta", "_n_cap", "_need", "_slots", "_top")

    def __init__(self, config: ProtocolConfig, *, start_version: int = 0) -> None:
        if not isinstance(config, ProtocolConfig):
            raise TypeError(f"config must be a ProtocolConfig, got {type(config).__name__}")
        self._init_ledger(config, start_version)
        self._config: ProtocolConfig = config
        self._need = config.batch_size
        self._slots = config.slots_per_buffer
        self._n_cap = config.samples_per_group
        self._eta = config.eta
        self._top = self._next - 1  # highest created buffer
        self._buffers: dict[int, Buffer] = {}

    # ------------------------------------------------------------------ properties

    @property
    def config(self) -> ProtocolConfig:
        return self._config

    @property
    def abort_floor(self) -> int:
        """Highest version ``u`` whose every reachable buffer ``[c, u + η]`` is READY.

        Versions ``≤ abort_floor`` can place nothing: instances there must sync before new work.
        Never below ``next_buffer − η − 1``.
        """
        c = self._next
        b = c
        last = c + self._eta
        buffers = self._buffers
        while b <= last:
            buf = buffers.get(b)
            if buf is None or not buf.ready:
                break
            b += 1
        return b - self._eta - 1

    def must_sync(self, instance_version: int) -> bool:
        """True if an instance at this version may take no new work until it syncs."""
        self._check_version(instance_version, "instance_version")
        return instance_version <= self.abort_floor

    # ------------------------------------------------------------------ admission

    def _latest_free(self, version: int) -> int:
        """Latest buffer in ``[c, version + η]`` that can take a reservation; -1 if none."""
        c = self._next
        buffers = self._buffers
        b = version + self._eta
        while b >= c:
            buf = buffers.get(b)
            if buf is None or buf.can_reserve():
                return b
            b -= 1
        return -1

    def _refuse_new(self, group_id: Id, version: int) -> NoFreeSlot | BelowAbortFloor:
        """Why a new group at ``version`` has no buffer: below the floor, or no free slot."""
        c = self._next
        floor = self.abort_floor
        if version <= floor:
            return BelowAbortFloor(
                f"version {version} <= abort floor {floor}: every buffer it can reach "
                f"[{c}, {version + self._eta}] is READY; the instance must sync",
                version=version,
                abort_floor=floor,
                group_id=group_id,
            )
        return NoFreeSlot(
            f"no buffer in [{c}, {version + self._eta}] has a free slot for group {group_id!r} "
            f"at version {version}",
            version=version,
            group_id=group_id,
        )

    def _join_refusal(self, g: Group, version: int) -> GroupClosed | GroupFull | SiblingTooStale:
        if g.state is not _RESERVED_G:
            return GroupClosed(
                f"group {g.group_id!r} is {g.state.value}; it takes no new members",
                group_id=g.group_id,
                state=g.state.value,
            )
        if len(g.members) >= self._n_cap:
            return GroupFull(
                f"group {g.group_id!r} already has {len(g.members)} live members "
                f"(group_size + group_redundancy = {self._n_cap})",
                group_id=g.group_id,
            )
        return SiblingTooStale(
            f"sibling of group {g.group_id!r} at version {version} cannot join its entry in "
            f"buffer {g.buffer}: needs version + eta >= {g.buffer}",
            group_id=g.group_id,
            version=version,
            buffer=g.buffer,
        )

    def _can_join(self, g: Group, version: int) -> bool:
        return (
            g.state is _RESERVED_G
            and len(g.members) < self._n_cap
            and version + self._eta >= g.buffer  # type: ignore[operator]  # RESERVED: has one
        )

    def _closed_refusal(self, group_id: Id) -> GroupClosed:
        tomb = self._tombs.groups[group_id]
        return GroupClosed(
            f"group {group_id!r} is {tomb.state.value}; it takes no new members",
            group_id=group_id,
            state=tomb.state.value,
        )

    def can_reserve(self, group_id: Id, version: int) -> Admission:
        """What would ``reserve(group_id, <new id>, version)`` do? No side effects.

        ADMIT: it succeeds. WAIT: NoFreeSlot (retry at this version later). SYNC:
        BelowAbortFloor or SiblingTooStale (only an instance at a newer version can take it).
        DISCARD: GroupClosed or GroupFull (never). Raises only for invalid input (bad id type,
        a version that is negative or not published: VersionNotPublished).
        """
        _check_id(group_id, "group_id")
        self._check_version(version)
        g = self._groups.get(group_id)
        if g is None:
            if group_id in self._tombs.groups:
                return _DISCARD
            if self._latest_free(version) >= 0:
                return _ADMIT
            # the admissions of BelowAbortFloor / NoFreeSlot, without building the error
            return Admission.SYNC if version <= self.abort_floor else Admission.WAIT
        if g.state is not _RESERVED_G or len(g.members) >= self._n_cap:
            return _DISCARD  # GroupClosed / GroupFull
        if version + self._eta < g.buffer:  # type: ignore[operator]  # RESERVED: has one
            return Admission.SYNC  # SiblingTooStale
        return _ADMIT

    def reserve(self, group_id: Id, trajectory_id: Id, version: int) -> int:
        """Admit a trajectory first routed at ``version``; returns its group's buffer.

        The first member of a group creates the group's RESERVED entry in the latest legal
        buffer; later members (siblings, possibly on other instances and versions) join it.
        Raises a NotAdmissible subclass (its ``admission`` says what to do), or a
        ProtocolMisuse/BadInput subclass.
        """
        self._check_new_trajectory(group_id, trajectory_id, version)
        g = self._groups.get(group_id)
        if g is None:
            if group_id in self._tombs.groups:
                raise self._closed_refusal(group_id)
            b = self._latest_free(version)
            if b < 0:
                raise self._refuse_new(group_id, version)
            buffers = self._buffers
            buf = buffers.get(b)
            if buf is None:
                while self._top < b:
                    self._top += 1
                    buffers[self._top] = Buffer(self._top, self._slots, self._need)
                buf = buffers[b]
            buf.reserved[group_id] = None
            g = Group(group_id, b)
            self._groups[group_id] = g
            self._gcount[_RESERVED_G] += 1
        elif self._can_join(g, version):
            b = g.buffer  # type: ignore[assignment]  # RESERVED groups always have a buffer
        else:
            raise self._join_refusal(g, version)
        g.members[trajectory_id] = None
        self._trajs[trajectory_id] = Traj(trajectory_id, group_id, version, _IN_FLIGHT)
        self._tcount[_IN_FLIGHT] += 1
        return b

    # ------------------------------------------------------------------ transitions

    def _release_slot(self, g: Group) -> None:
        buf = self._buffers.get(g.buffer) if g.buffer is not None else None
        if buf is not None:
            buf.reserved.pop(g.group_id, None)
            buf.occupied.pop(g.group_id, None)

    def _occupy(self, g: Group) -> int:
        self._abort_group_surplus(g)
        trajs = self._trajs
        kept = g.finished
        b_entry = g.buffer
        assert b_entry is not None
        buffers = self._buffers
        del buffers[b_entry].reserved[g.group_id]
        vmin = min(trajs[tid].version for tid in kept)
        b = self._next
        last = min(vmin + self._eta, self._top)
        while b <= last:
            buf = buffers[b]
            if buf.can_occupy():
                break
            b += 1
        else:  # pragma: no cover - guaranteed by worst-case reservation
            raise AssertionError(f"group {g.group_id!r} found no buffer; b_entry={b_entry}")
        buf.occupied[g.group_id] = None
        g.buffer = b
        self._set_group_state(g, GroupState.OCCUPIED)
        for tid in kept:
            self._set_state(trajs[tid], _OCCUPIED)
        if buf.ready and buf.reserved:
            self._abort_surplus(buf)
        return b

    def _abort_surplus(self, buf: Buffer) -> None:
        """The buffer just became READY: its remaining reservations cannot be placed in it."""
        floor = self.abort_floor
        groups = self._groups
        for gid in list(buf.reserved):
            g = groups[gid]
            vmin = self._group_version(g)
            reason = (
                AbortReason.STALE
                if vmin is not None and vmin <= floor
                else AbortReason.BATCH_SURPLUS
            )
            self._close_group(g, GroupState.ABORTED, reason, TrajectoryState.ABORTED, notify=True)

    # ------------------------------------------------------------------ consume

    def ready(self) -> bool:
        """Is buffer ``next_buffer`` READY (B groups occupied)?"""
        buf = self._buffers.get(self._next)
        return buf is not None and len(buf.occupied) >= self._need

    def next_batch_groups(self) -> tuple[Id, ...]:
        """The groups occupied in buffer ``next_buffer``, in the order they occupied it (the
        order ``consume`` returns them). Each is in the batch the next ``consume()`` takes
        unless you ``drop_group`` it: the protocol never moves an occupied group out of
        ``next_buffer`` or aborts it there (stuck resolution only moves groups into it). A
        trainer may start on them (log-probs, gradients) before the buffer is READY."""
        buf = self._buffers.get(self._next)
        return () if buf is None else tuple(buf.occupied)

    def consume(self) -> Batch:
        """Take the READY buffer ``next_buffer``; ``next_buffer`` advances by one (publish the
        trained version with ``publish(batch.version + 1)`` once its weights exist)."""
        c = self._next
        buf = self._buffers.get(c)
        if buf is None or len(buf.occupied) < self._need:
            raise NotReady(
                f"buffer {c} is not READY: {0 if buf is None else len(buf.occupied)} of "
                f"{self._need} groups occupied",
                version=c,
                buffer=c,
            )
        del self._buffers[c]
        if self._top < c:  # pragma: no cover - buffer c existed
            self._top = c
        return self._take_batch(tuple(buf.occupied))

    # ------------------------------------------------------------------ stuck buffers

    def resolve_stuck(self) -> StuckResolution:
        """Unstick buffer ``next_buffer`` if it lacks at most ``stuck_threshold`` groups.

        Call it when the trainer has waited too long (the protocol has no clock). If later
        buffers hold enough OCCUPIED groups: abort the reserved stragglers of buffer ``c``
        (reason ``stuck``: Abort and GroupAborted notices, and a ReplacementRequest each) and
        move the earliest-placed groups of the next buffers into ``c``, which becomes READY.
        Otherwise nothing changes.
        """
        threshold = self._config.stuck_threshold
        if threshold is None:
            raise MechanismDisabled(
                "resolve_stuck() needs ProtocolConfig.stuck_threshold to be set",
                field="stuck_threshold",
            )
        c = self._next
        buf = self._buffers.get(c)
        if buf is None or buf.ready:
            return StuckResolution(resolved=False, buffer=c)
        missing = self._need - len(buf.occupied)
        if missing > threshold:
            return StuckResolution(resolved=False, buffer=c)
        later = sum(len(self._buffers[b].occupied) for b in range(c + 1, self._top + 1))
        if later < missing:
            return StuckResolution(resolved=False, buffer=c)
        for gid in list(buf.reserved):
            self._close_group(
                self._groups[gid],
                GroupState.ABORTED,
                AbortReason.STUCK,
                TrajectoryState.ABORTED,
                notify=True,
            )
            self._request_replacement(gid, AbortReason.STUCK)
        moved: list[GroupMove] = []
        b = c + 1
        while len(moved) < missing:
            src = self._buffers[b]
            for gid in list(src.occupied):
                if len(moved) == missing:
                    break
                del src.occupied[gid]
                buf.occupied[gid] = None
                self._groups[gid].buffer = c
                moved.append(GroupMove(group_id=gid, from_buffer=b, to_buffer=c))
            b += 1
        return StuckResolution(resolved=True, buffer=c, moved=tuple(moved))

    # ------------------------------------------------------------------ queries

    def buffer_fill(self, version: int) -> BufferFill:
        buf = self._buffers.get(version)
        if buf is None:
            c, last = self._next, self._next + self._eta
            if isinstance(version, int) and c <= version <= last:
                return BufferFill(
                    version=version, occupied=0, reserved=0, free=self._slots, ready=False
                )
            raise InvalidVersion(
                f"buffer {version!r} does not exist: allowed [{c}, {last}]",
                version=version,
                allowed=f"an int in [{c}, {last}]",
            )
        return buf.fill()

    def buffer_slots(self, version: int) -> tuple[SlotState, ...]:
        """The slot array of one buffer: OCCUPIED at the front, RESERVED at the back."""
        fill = self.buffer_fill(version)
        return (
            (SlotState.OCCUPIED,) * fill.occupied
            + (SlotState.EMPTY,) * fill.free
            + (SlotState.RESERVED,) * fill.reserved
        )

    def _buffer_fills(self) -> tuple[BufferFill, ...]:
        return tuple(self._buffers[b].fill() for b in range(self._next, self._top + 1))

    # ------------------------------------------------------------------ checkpoint

    def to_dict(self) -> dict[str, Any]:
        """The state as plain JSON types (lists, str/int keys); exact round trip. Its size
        follows the live ledger, not the length of the run."""
        return {
            "format": FORMAT,
            "config": self._config.to_dict(),
            **self._versions_to_dict(),
            "top": self._top,
            "buffers": [
                {
                    "version": b,
                    "occupied": list(self._buffers[b].occupied),
                    "reserved": list(self._buffers[b].reserved),
                }
                for b in range(self._next, self._top + 1)
            ],
            **self._ledger_to_dict(),
        }

    @classmethod
    def _restore(cls, data: dict[str, Any]) -> StalenessProtocol:
        from ._restore import restore

        return restore(cls, data)
