"""StalenessProtocol: the global consistency protocol that bounds per-trajectory staleness.

Theory of operation
===================

Versions. Training step ``k`` turns model version ``k`` into ``k + 1``. ``current_version`` ``c``
is the newest published version; no rollout instance can be ahead of it. Each trajectory gets
``V_traj`` when it is first routed (``reserve``) and keeps it through interruptions, migration
and resumption. A group's version is the minimum ``V_traj`` of its kept members.

Buffers. Buffer ``b`` holds the batch consumed by the step that trains version ``b``. It has
``B' = B + batch_redundancy`` slots and is READY at ``B`` OCCUPIED slots. Buffers are created
lazily, strictly in order, up to ``c + η``; buffer ``c`` is the one the trainer waits for and is
retired when consumed. A trajectory may be trained from buffer ``b`` only if
``V_traj ≤ b ≤ V_traj + η``; staleness is ``b − V_traj`` (queue time counts).

Reserve (first member of a group, version ``v``): put a RESERVED entry in the LATEST buffer
``b ∈ [c, v + η]`` that is not READY and has a free slot — the worst case the group can need.
None: inadmissible (the trajectory stays queued). Siblings join the entry only if
``v_sibling + η ≥ b_entry``; a group admits at most ``n' = n + group_redundancy`` live members.
``can_reserve`` runs the same check with no side effects.

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
reservation; resuming on any instance with version ``≥ V_traj`` needs no protocol call
(``can_resume`` checks it).

Filtering: ``drop_group`` releases a group's reservation (or its OCCUPIED slot, if it was already
placed) and, with ``filtering`` on, queues a replacement-prompt request.

Stuck buffers (``stuck_threshold``): ``resolve_stuck`` — if buffer ``c`` lacks at most
``threshold`` groups and later buffers hold that many OCCUPIED groups, abort the reserved
stragglers in ``c`` (each asks for a replacement prompt) and move finished groups forward into
``c`` (moving earlier only lowers staleness: ``c ≥`` every live ``V_traj``).

Sans-IO: no clock, threads, I/O or logging; protocol-initiated aborts and replacement requests
are queued as records for the caller to act on (``take_aborts``, ``take_replacements``).
"""

from __future__ import annotations

from typing import Any

from ._buffers import Buffer
from ._config import ProtocolConfig
from ._ledger import Group, Traj
from ._ledger_base import (
    _CONSUMED,
    _IN_FLIGHT,
    _OCCUPIED,
    _RESERVED_G,
    LedgerBase,
    _check_id,
)
from ._records import (
    Abort,
    AbortReason,
    Batch,
    BufferFill,
    GroupMove,
    GroupState,
    ReplacementRequest,
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

FORMAT = "staleness-protocol/1"


class StalenessProtocol(LedgerBase):
    """Tracks every trajectory's reservation and placement so that none exceeds staleness η."""

    _FORMAT = FORMAT

    __slots__ = ("_buffers", "_eta", "_n_cap", "_need", "_slots", "_top")

    def __init__(self, config: ProtocolConfig, *, start_version: int = 0) -> None:
        if not isinstance(config, ProtocolConfig):
            raise TypeError(f"config must be a ProtocolConfig, got {type(config).__name__}")
        self._init_ledger(config.group_size, start_version)
        self._config: ProtocolConfig = config
        self._need = config.batch_size
        self._slots = config.slots_per_buffer
        self._n_cap = config.samples_per_group
        self._eta = config.eta
        self._top = start_version - 1  # highest created buffer
        self._buffers: dict[int, Buffer] = {}

    # ------------------------------------------------------------------ properties

    @property
    def config(self) -> ProtocolConfig:
        return self._config

    @property
    def abort_floor(self) -> int:
        """Highest version ``u`` whose every reachable buffer ``[c, u + η]`` is READY.

        Versions ``≤ abort_floor`` can place nothing: instances there must sync before new work.
        Never below ``current_version − η − 1``.
        """
        c = self._version
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
        c = self._version
        buffers = self._buffers
        b = version + self._eta
        while b >= c:
            buf = buffers.get(b)
            if buf is None or buf.can_reserve():
                return b
            b -= 1
        return -1

    def _reserve_buffer(self, group_id: Id, version: int) -> int:
        """The buffer a new group at ``version`` would reserve, or raise NotAdmissible."""
        b = self._latest_free(version)
        if b >= 0:
            return b
        c = self._version
        floor = self.abort_floor
        if version <= floor:
            raise BelowAbortFloor(
                f"version {version} <= abort floor {floor}: every buffer it can reach "
                f"[{c}, {version + self._eta}] is READY; the instance must sync",
                version=version,
                abort_floor=floor,
                group_id=group_id,
            )
        raise NoFreeSlot(
            f"no buffer in [{c}, {version + self._eta}] has a free slot for group {group_id!r} "
            f"at version {version}",
            version=version,
            group_id=group_id,
        )

    def _join_check(self, g: Group, version: int) -> None:
        if g.state is not _RESERVED_G:
            raise GroupClosed(
                f"group {g.group_id!r} is {g.state.value}; it takes no new members",
                group_id=g.group_id,
                state=g.state.value,
            )
        if len(g.members) >= self._n_cap:
            raise GroupFull(
                f"group {g.group_id!r} already has {len(g.members)} live members "
                f"(group_size + group_redundancy = {self._n_cap})",
                group_id=g.group_id,
            )
        b_entry = g.buffer
        assert b_entry is not None
        if version + self._eta < b_entry:
            raise SiblingTooStale(
                f"sibling of group {g.group_id!r} at version {version} cannot join its entry in "
                f"buffer {b_entry}: needs version + eta >= {b_entry}",
                group_id=g.group_id,
                version=version,
                buffer=b_entry,
            )

    def can_reserve(self, group_id: Id, version: int) -> bool:
        """Would ``reserve(group_id, <new id>, version)`` succeed? No side effects.

        Raises only for invalid input (bad id type, version < 0 or > current_version).
        """
        _check_id(group_id, "group_id")
        self._check_version(version)
        g = self._groups.get(group_id)
        if g is None:
            return self._latest_free(version) >= 0
        return (
            g.state is _RESERVED_G
            and len(g.members) < self._n_cap
            and version + self._eta >= g.buffer  # type: ignore[operator]  # RESERVED: has one
        )

    def reserve(self, group_id: Id, trajectory_id: Id, version: int) -> int:
        """Admit a trajectory first routed at ``version``; returns its group's buffer.

        The first member of a group creates the group's RESERVED entry in the latest legal
        buffer; later members (siblings, possibly on other instances and versions) join it.
        Raises NotAdmissible (keep it queued), or a ProtocolMisuse/BadInput subclass.
        """
        self._check_new_trajectory(group_id, trajectory_id, version)
        g = self._groups.get(group_id)
        if g is None:
            b = self._reserve_buffer(group_id, version)
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
        else:
            self._join_check(g, version)
            b = g.buffer  # type: ignore[assignment]  # RESERVED groups always have a buffer
        g.members[trajectory_id] = None
        self._trajs[trajectory_id] = Traj(trajectory_id, group_id, version, _IN_FLIGHT, b)
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
        b = self._version
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
            t = trajs[tid]
            self._set_state(t, _OCCUPIED)
            t.buffer = b
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
            self._close_group(g, GroupState.ABORTED, reason, TrajectoryState.ABORTED)

    # ------------------------------------------------------------------ consume

    def ready(self) -> bool:
        """Is buffer ``current_version`` READY (B groups occupied)?"""
        buf = self._buffers.get(self._version)
        return buf is not None and len(buf.occupied) >= self._need

    def consume(self) -> Batch:
        """Take the READY buffer ``current_version``; the version advances by one."""
        c = self._version
        buf = self._buffers.get(c)
        if buf is None or len(buf.occupied) < self._need:
            raise NotReady(
                f"buffer {c} is not READY: {0 if buf is None else len(buf.occupied)} of "
                f"{self._need} groups occupied",
                version=c,
                buffer=c,
            )
        groups = self._groups
        trajs = self._trajs
        thist = self._traj_hist
        ghist = self._group_hist
        consumed_state = _CONSUMED
        gids = tuple(buf.occupied)
        tids_out: list[tuple[Id, ...]] = []
        gvers: list[int] = []
        gstale: list[int] = []
        tstale_out: list[tuple[int, ...]] = []
        ntraj = 0
        for gid in gids:
            g = groups[gid]
            g.state = GroupState.CONSUMED
            kept = tuple(g.finished)
            stale: list[int] = []
            for tid in kept:
                t = trajs[tid]
                t.state = consumed_state
                s = c - t.version
                stale.append(s)
                thist[s] = thist.get(s, 0) + 1
            ntraj += len(kept)
            smax = max(stale)
            ghist[smax] = ghist.get(smax, 0) + 1
            tids_out.append(kept)
            gvers.append(c - smax)
            gstale.append(smax)
            tstale_out.append(tuple(stale))
        self._tcount[_OCCUPIED] -= ntraj
        self._tcount[_CONSUMED] += ntraj
        self._gcount[GroupState.OCCUPIED] -= len(gids)
        self._gcount[GroupState.CONSUMED] += len(gids)
        del self._buffers[c]
        self._version = c + 1
        if self._top < c:  # pragma: no cover - buffer c existed
            self._top = c
        self._consumed_batches += 1
        return Batch(
            version=c,
            group_ids=gids,
            trajectory_ids=tuple(tids_out),
            group_versions=tuple(gvers),
            staleness=tuple(gstale),
            trajectory_staleness=tuple(tstale_out),
        )

    # ------------------------------------------------------------------ stuck buffers

    def resolve_stuck(self) -> StuckResolution:
        """Unstick buffer ``current_version`` if it lacks at most ``stuck_threshold`` groups.

        Call it when the trainer has waited too long (the protocol has no clock). If later
        buffers hold enough OCCUPIED groups: abort the reserved stragglers of buffer ``c``
        (reason ``stuck``; each asks for a replacement prompt) and move the earliest-placed
        groups of the next buffers into ``c``, which becomes READY. Otherwise nothing changes.
        """
        threshold = self._config.stuck_threshold
        if threshold is None:
            raise MechanismDisabled(
                "resolve_stuck() needs ProtocolConfig.stuck_threshold to be set",
                field="stuck_threshold",
            )
        c = self._version
        buf = self._buffers.get(c)
        if buf is None or buf.ready:
            return StuckResolution(resolved=False, buffer=c)
        missing = self._need - len(buf.occupied)
        if missing > threshold:
            return StuckResolution(resolved=False, buffer=c)
        later = sum(len(self._buffers[b].occupied) for b in range(c + 1, self._top + 1))
        if later < missing:
            return StuckResolution(resolved=False, buffer=c)
        aborted: list[Abort] = []
        replacements: list[ReplacementRequest] = []
        for gid in list(buf.reserved):
            aborted += self._close_group(
                self._groups[gid], GroupState.ABORTED, AbortReason.STUCK, TrajectoryState.ABORTED
            )
            replacements.append(self._request_replacement(gid, AbortReason.STUCK))
        moved: list[GroupMove] = []
        b = c + 1
        while len(moved) < missing:
            src = self._buffers[b]
            for gid in list(src.occupied):
                if len(moved) == missing:
                    break
                del src.occupied[gid]
                buf.occupied[gid] = None
                g = self._groups[gid]
                g.buffer = c
                for tid in g.finished:
                    self._trajs[tid].buffer = c
                moved.append(GroupMove(group_id=gid, from_buffer=b, to_buffer=c))
            b += 1
        return StuckResolution(
            resolved=True,
            buffer=c,
            aborted=tuple(aborted),
            moved=tuple(moved),
            replacements=tuple(replacements),
        )

    # ------------------------------------------------------------------ queries

    def buffer_fill(self, version: int) -> BufferFill:
        buf = self._buffers.get(version)
        if buf is None:
            if self._version <= version <= self._version + self._eta:
                return BufferFill(
                    version=version, occupied=0, reserved=0, free=self._slots, ready=False
                )
            raise InvalidVersion(
                f"buffer {version!r} does not exist: allowed [{self._version}, {self._version + self._eta}]",
                version=version,
                current_version=self._version,
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
        return tuple(self._buffers[b].fill() for b in range(self._version, self._top + 1))

    # ------------------------------------------------------------------ checkpoint

    def to_dict(self) -> dict[str, Any]:
        """The full state as plain JSON types (lists, str/int keys); exact round trip."""
        return {
            "format": FORMAT,
            "config": self._config.to_dict(),
            "current_version": self._version,
            "top": self._top,
            "buffers": [
                {
                    "version": b,
                    "occupied": list(self._buffers[b].occupied),
                    "reserved": list(self._buffers[b].reserved),
                }
                for b in range(self._version, self._top + 1)
            ],
            **self._ledger_to_dict(),
        }

    @classmethod
    def _restore(cls, data: dict[str, Any]) -> StalenessProtocol:
        from ._restore import restore

        return restore(cls, data)
