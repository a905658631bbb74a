"""LedgerBase: the trajectory/group ledger every protocol keeps (internal).

``StalenessProtocol`` (bounded, per-version buffers) and the FIFO protocols differ only in
where a group waits between admission and consumption. Everything else is the same
bookkeeping and lives here once: versions (``next_buffer``, ``published_version``,
``publish``), version validation, the live ledger and its tombstones (``_ledger``),
state counters, ``finish`` / ``abort`` / ``drop_group``, the notice outbox, taking a batch,
statistics, and the ledger half of ``to_dict`` / ``from_dict``.

A subclass supplies the placement half: ``_release_slot`` (a closing group leaves its buffer
slot or FIFO place), ``_occupy`` (a group has ``n`` finished members), ``_buffer_fills``
(``stats().buffers``), ``abort_floor``, ``_FORMAT`` and ``_restore``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar, NoReturn, Protocol, Self

from ._checks import check_id, check_reason, is_int
from ._ledger import Group, GroupTomb, Tombstones, Traj, TrajTomb
from ._records import (
    Abort,
    Batch,
    BufferFill,
    FinishOutcome,
    FinishStatus,
    GroupAborted,
    GroupRecord,
    GroupState,
    Notice,
    ProtocolStats,
    ReplacementRequest,
    TrajectoryRecord,
    TrajectoryState,
)
from .errors import (
    CorruptState,
    DuplicateTrajectory,
    GroupNotDroppable,
    InvalidVersion,
    ProtocolError,
    PublishOutOfOrder,
    TrajectoryNotInFlight,
    UnknownGroup,
    UnknownTrajectory,
    VersionNotPublished,
)

Id = str | int

_IN_FLIGHT = TrajectoryState.IN_FLIGHT
_FINISHED = TrajectoryState.FINISHED
_OCCUPIED = TrajectoryState.OCCUPIED
_CONSUMED = TrajectoryState.CONSUMED
_RESERVED_G = GroupState.RESERVED
_OCCUPIED_G = GroupState.OCCUPIED


class LedgerConfig(Protocol):
    """What the shared ledger reads from every config."""

    @property
    def filtering(self) -> bool: ...

    @property
    def group_size(self) -> int: ...

    @property
    def tombstone_versions(self) -> int: ...


class LedgerBase:
    """Shared ledger state and the methods that only touch it."""

    _FORMAT: ClassVar[str]  # the checkpoint format name

    __slots__ = (
        "_aborts_by_reason",
        "_config",
        "_consumed_batches",
        "_gcount",
        "_group_hist",
        "_groups",
        "_n",
        "_next",
        "_next_replacement",
        "_notices",
        "_published",
        "_replacements_requested",
        "_tcount",
        "_tombs",
        "_traj_hist",
        "_trajs",
    )

    _config: LedgerConfig

    def _init_ledger(self, config: LedgerConfig, start_version: Any) -> None:
        """Validate ``start_version`` and set up an empty ledger (after the config check)."""
        if not is_int(start_version) or start_version < 0:
            raise InvalidVersion(
                f"start_version={start_version!r} is invalid: allowed an int >= 0",
                version=start_version,
                allowed="an int >= 0",
            )
        self._n = config.group_size
        self._next = int(start_version)
        self._published = int(start_version)
        self._groups: dict[Id, Group] = {}  # live: RESERVED or OCCUPIED
        self._trajs: dict[Id, Traj] = {}  # live: IN_FLIGHT, FINISHED or OCCUPIED
        self._tombs = Tombstones(config.tombstone_versions)
        self._notices: list[Notice] = []
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
        """``n`` members of ``g`` have finished: place the group; returns its buffer."""
        raise NotImplementedError

    def _buffer_fills(self) -> tuple[BufferFill, ...]:
        raise NotImplementedError

    @classmethod
    def _restore(cls, data: dict[str, Any]) -> Self:
        raise NotImplementedError

    # ------------------------------------------------------------------ versions

    @property
    def next_buffer(self) -> int:
        """The buffer the next ``consume`` takes: the version the next training step trains
        (``k → k + 1``). Buffers and the abort floor are counted from it."""
        return self._next

    @property
    def published_version(self) -> int:
        """The newest version whose weights exist (``start_version``, then each ``publish``).
        No instance can generate with a newer one: admission and resumption refuse it. While
        a consumed step trains, ``published_version == next_buffer − 1``."""
        return self._published

    def publish(self, version: int) -> None:
        """The weights of ``version`` exist now (the step that consumed buffer ``version − 1``
        has produced them): instances may sync to it and work at it is admitted.

        ``version`` must be ``published_version + 1`` and ``<= next_buffer``; else
        :class:`~staleness_protocol.PublishOutOfOrder` naming the allowed value.
        """
        allowed = self._published + 1
        if allowed > self._next:
            raise PublishOutOfOrder(
                f"publish({version!r}): nothing to publish: version {self._published} is "
                f"published and buffer {self._published} is not consumed yet (next_buffer "
                f"{self._next}); consume it and train, then publish {allowed}",
                version=version,
                allowed=None,
            )
        if not is_int(version) or version != allowed:
            raise PublishOutOfOrder(
                f"publish({version!r}) is out of order: allowed {allowed} "
                f"(published_version + 1; versions are published one at a time)",
                version=version,
                allowed=allowed,
            )
        self._published = allowed
        self._tombs.expire(self._next)  # retirement work, off the trainer's critical path

    # ------------------------------------------------------------------ validation

    def _check_version(self, version: Any, field: str = "version") -> None:
        """A version an instance works at: an int in ``[0, published_version]``."""
        if type(version) is int and 0 <= version <= self._published:
            return
        if is_int(version):
            if 0 <= version <= self._published:
                return  # int subclasses (e.g. IntEnum) are fine
            if version > self._published:
                raise VersionNotPublished(
                    f"{field}={version}: the weights of version {version} are not published "
                    f"yet (published_version is {self._published}); allowed an int in "
                    f"[0, {self._published}]",
                    version=version,
                    published_version=self._published,
                )
        raise InvalidVersion(
            f"{field}={version!r} is invalid: allowed an int in [0, {self._published}] "
            "(published_version)",
            version=version,
            allowed=f"an int in [0, {self._published}]",
        )

    def _check_new_trajectory(self, group_id: Id, trajectory_id: Id, version: int) -> None:
        """``reserve``'s input checks: id types, version range, trajectory id unused."""
        check_id(group_id, "group_id")
        check_id(trajectory_id, "trajectory_id")
        self._check_version(version)
        if trajectory_id in self._trajs or trajectory_id in self._tombs.trajs:
            raise DuplicateTrajectory(
                f"trajectory_id {trajectory_id!r} is already in the ledger "
                f"({self.trajectory(trajectory_id).state.value})",
                trajectory_id=trajectory_id,
                group_id=group_id,
            )

    def can_resume(self, trajectory_id: Id, instance_version: int) -> bool:
        """May this trajectory continue on an instance at this version?

        True iff it is in flight and ``V_traj ≤ instance_version``; False once it ended
        (finished, aborted, dropped). V_traj (and, when bounded, the reservation) are kept;
        resuming needs no protocol call. UnknownTrajectory for an id the ledger does not know.
        """
        t = self._trajs.get(trajectory_id)
        if t is None and trajectory_id not in self._tombs.trajs:
            self._unknown_traj(trajectory_id)
        self._check_version(instance_version, "instance_version")
        return t is not None and t.state is _IN_FLIGHT and t.version <= instance_version

    def live_version(self, trajectory_id: Id) -> int | None:
        """V_traj while the trajectory is in flight; None for anything else (finished,
        ended, retired, or never reserved). O(1); never raises for a str or int id."""
        t = self._trajs.get(trajectory_id)
        return t.version if t is not None and t.state is _IN_FLIGHT else None

    def reserved_buffer(self, group_id: Id) -> int | None:
        """The buffer a group holds while it is RESERVED there; None for anything else
        (occupied, closed, or unknown). O(1), no record built; never raises for a str or int
        id."""
        g = self._groups.get(group_id)
        return g.buffer if g is not None and g.state is _RESERVED_G else None

    # ------------------------------------------------------------------ ledger entries

    def _unknown_traj(self, trajectory_id: Id) -> NoReturn:
        check_id(trajectory_id, "trajectory_id")
        raise UnknownTrajectory(
            f"unknown trajectory_id {trajectory_id!r}: never reserved, consumed (retired at "
            f"once), or aborted/dropped more than tombstone_versions={self._tombs.keep} "
            "versions ago",
            trajectory_id=trajectory_id,
        )

    def _unknown_group(self, group_id: Id) -> NoReturn:
        check_id(group_id, "group_id")
        raise UnknownGroup(
            f"unknown group_id {group_id!r}: never reserved, or it closed more than "
            f"tombstone_versions={self._tombs.keep} versions ago",
            group_id=group_id,
        )

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

    def _end_traj(self, t: Traj, state: TrajectoryState, reason: str, *, notify: bool) -> None:
        """A live trajectory is aborted or dropped: tombstone it, optionally queue a notice."""
        tid = t.trajectory_id
        was_running = t.state is _IN_FLIGHT
        self._set_state(t, state)
        del self._trajs[tid]
        if state is TrajectoryState.ABORTED:
            self._aborts_by_reason[reason] = self._aborts_by_reason.get(reason, 0) + 1
        self._tombs.add_traj(
            tid, TrajTomb(t.group_id, t.version, state, reason, was_running, self._next)
        )
        if notify:
            self._notices.append(
                Abort(
                    trajectory_id=tid,
                    group_id=t.group_id,
                    version=t.version,
                    reason=reason,
                    was_running=was_running,
                )
            )

    def _group_version(self, g: Group) -> int | None:
        """The group's version: the smallest V_traj of its live members (None if it has none)."""
        trajs = self._trajs
        return min((trajs[t].version for t in g.members), default=None)

    def _close_group(
        self, g: Group, state: GroupState, reason: str, tstate: TrajectoryState, *, notify: bool
    ) -> None:
        """Release the group's slot, end its live members (one Abort notice each) and retire
        it; ``notify``: the protocol closed it, so a GroupAborted notice follows them."""
        reason = str(reason)  # AbortReason members become plain JSON-friendly strings
        self._release_slot(g)
        trajs = self._trajs
        for tid in g.members:
            self._end_traj(trajs[tid], tstate, reason, notify=True)
        self._set_group_state(g, state)
        gid = g.group_id
        del self._groups[gid]
        self._tombs.add_group(gid, GroupTomb(state, reason, None, self._next))
        if notify:
            self._notices.append(GroupAborted(group_id=gid, reason=reason))

    def _abort_group_surplus(self, g: Group) -> None:
        """``g`` has ``n`` finished members: abort the others still running (notices)."""
        trajs = self._trajs
        for tid in [m for m in g.members if trajs[m].state is _IN_FLIGHT]:
            del g.members[tid]
            self._end_traj(trajs[tid], TrajectoryState.ABORTED, "group_surplus", notify=True)

    def _request_replacement(self, group_id: Id, reason: str) -> None:
        self._notices.append(
            ReplacementRequest(
                request_id=self._next_replacement, replaces_group_id=group_id, reason=str(reason)
            )
        )
        self._next_replacement += 1
        self._replacements_requested += 1

    def finish(self, trajectory_id: Id) -> FinishOutcome:
        """Record that a trajectory finished and was rewarded.

        ``WAITING``: fewer than ``n`` members of its group have finished. ``OCCUPIED``: it was
        the ``n``-th; the other running members are aborted (group surplus, notices) and the
        group is placed in ``buffer`` (bounded: the earliest legal buffer; FIFO: the version
        it will be trained at if nothing ahead of it leaves). ``ALREADY_ENDED``: the protocol
        aborted or dropped it while it ran (the race with an engine that just finished it);
        nothing changes, discard the output. TrajectoryNotInFlight if it had already
        finished; UnknownTrajectory for an id the ledger does not know.
        """
        t = self._trajs.get(trajectory_id)
        if t is None:
            return self._finish_ended(trajectory_id)
        if t.state is not _IN_FLIGHT:
            raise TrajectoryNotInFlight(
                f"cannot finish trajectory {trajectory_id!r}: it is {t.state.value}",
                trajectory_id=trajectory_id,
                group_id=t.group_id,
                state=t.state.value,
            )
        g = self._groups[t.group_id]
        self._set_state(t, _FINISHED)
        g.finished.append(trajectory_id)
        if len(g.finished) < self._n:
            return FinishOutcome(
                status=FinishStatus.WAITING, trajectory_id=trajectory_id, group_id=t.group_id
            )
        return FinishOutcome(
            status=FinishStatus.OCCUPIED,
            trajectory_id=trajectory_id,
            group_id=t.group_id,
            buffer=self._occupy(g),
        )

    def _finish_ended(self, trajectory_id: Id) -> FinishOutcome:
        tomb = self._tombs.trajs.get(trajectory_id)
        if tomb is None:
            self._unknown_traj(trajectory_id)
        if not tomb.was_running:
            raise TrajectoryNotInFlight(
                f"cannot finish trajectory {trajectory_id!r}: it had finished before it was "
                f"{tomb.state.value} ({tomb.reason})",
                trajectory_id=trajectory_id,
                group_id=tomb.group_id,
                state=tomb.state.value,
            )
        return FinishOutcome(
            status=FinishStatus.ALREADY_ENDED,
            trajectory_id=trajectory_id,
            group_id=tomb.group_id,
            reason=tomb.reason,
        )

    def abort(self, trajectory_id: Id, reason: str) -> bool:
        """The caller aborts an in-flight trajectory (e.g. an interruption it will not resume).

        Returns True. Its group stays in flight (keeps its reservation): reserve a retry
        sibling or drop the group. No notice is queued (the caller knows). Returns False,
        changing nothing, when the protocol had already aborted or dropped it while it ran.
        """
        t = self._trajs.get(trajectory_id)
        if t is None:
            tomb = self._tombs.trajs.get(trajectory_id)
            if tomb is None:
                self._unknown_traj(trajectory_id)
            check_reason(reason)
            if tomb.was_running:
                return False
            raise TrajectoryNotInFlight(
                f"cannot abort trajectory {trajectory_id!r}: it had finished before it was "
                f"{tomb.state.value}",
                trajectory_id=trajectory_id,
                group_id=tomb.group_id,
                state=tomb.state.value,
            )
        check_reason(reason)
        if t.state is not _IN_FLIGHT:
            raise TrajectoryNotInFlight(
                f"cannot abort trajectory {trajectory_id!r}: it is {t.state.value}",
                trajectory_id=trajectory_id,
                group_id=t.group_id,
                state=t.state.value,
            )
        del self._groups[t.group_id].members[trajectory_id]
        self._end_traj(t, TrajectoryState.ABORTED, str(reason), notify=False)
        return True

    def drop_group(self, group_id: Id, reason: str) -> bool:
        """Filter a group out (e.g. all rewards equal): release its reservation, slot or FIFO place.

        Works on RESERVED and OCCUPIED (not yet consumed) groups and returns True. Every live
        member becomes DROPPED with ``reason``; one Abort notice per member is queued
        (``was_running`` tells an engine-held trajectory from a finished one whose stored
        result is discarded); with ``filtering`` on, a ReplacementRequest follows. Returns
        False, changing nothing, for a group the protocol had already aborted (its notices are
        queued); GroupNotDroppable for a consumed or already dropped group.
        """
        g = self._groups.get(group_id)
        if g is None:
            tomb = self._tombs.groups.get(group_id)
            if tomb is None:
                self._unknown_group(group_id)
            check_reason(reason)
            if tomb.state is GroupState.ABORTED:
                return False
            raise GroupNotDroppable(
                f"cannot drop group {group_id!r}: it is {tomb.state.value}",
                group_id=group_id,
                state=tomb.state.value,
            )
        check_reason(reason)
        self._close_group(g, GroupState.DROPPED, reason, TrajectoryState.DROPPED, notify=False)
        if self._config.filtering:
            self._request_replacement(group_id, reason)
        return True

    def _take_batch(self, gids: tuple[Id, ...]) -> Batch:
        """Consume these OCCUPIED groups as the batch of version ``next_buffer``: account the
        staleness, retire them (consumed trajectories are forgotten, the groups tombstoned)
        and advance ``next_buffer``. Old tombstones expire at the ``publish`` that follows; only
        when versions are consumed faster than they are published does ``consume`` do it."""
        c = self._next
        self._next = c + 1
        tombs = self._tombs
        if c + 1 - self._published > 1:
            tombs.expire(c + 1)
        groups = self._groups
        trajs = self._trajs
        thist = self._traj_hist
        ghist = self._group_hist
        tids_out: list[tuple[Id, ...]] = []
        gvers: list[int] = []
        gstale: list[int] = []
        tstale_out: list[tuple[int, ...]] = []
        every: list[int] = []
        consumed = GroupState.CONSUMED
        pop = trajs.pop
        for gid in gids:
            kept = tuple(groups.pop(gid).finished)
            stale = tuple([c - t.version for t in map(pop, kept)])
            every += stale
            smax = max(stale)
            ghist[smax] = ghist.get(smax, 0) + 1
            tids_out.append(kept)
            gvers.append(c - smax)
            gstale.append(smax)
            tstale_out.append(stale)
            tombs.add_group(gid, GroupTomb(consumed, None, c, c + 1))
        for s, k in Counter(every).items():  # counted in C: a few distinct values
            thist[s] = thist.get(s, 0) + k
        ntraj = len(every)
        self._tcount[_OCCUPIED] -= ntraj
        self._tcount[_CONSUMED] += ntraj
        self._gcount[_OCCUPIED_G] -= len(gids)
        self._gcount[consumed] += len(gids)
        self._consumed_batches += 1
        return Batch(
            version=c,
            group_ids=gids,
            trajectory_ids=tuple(tids_out),
            group_versions=tuple(gvers),
            staleness=tuple(gstale),
            trajectory_staleness=tuple(tstale_out),
        )

    # ------------------------------------------------------------------ outbox

    def take_notices(self) -> tuple[Notice, ...]:
        """Drain what the protocol decided that the caller must act on, in order: ``Abort``
        (stop / discard one trajectory), ``GroupAborted`` (the protocol closed a group: drop
        its unadmitted members), ``ReplacementRequest`` (admit one more prompt). Each decision
        appears exactly once, here and nowhere else."""
        out = tuple(self._notices)
        self._notices.clear()
        return out

    # ------------------------------------------------------------------ queries

    def trajectory(self, trajectory_id: Id) -> TrajectoryRecord:
        """Ledger entry of a live trajectory, or of one that ended (aborted / dropped) within
        the last ``tombstone_versions`` versions. Consumed trajectories are retired at once."""
        t = self._trajs.get(trajectory_id)
        if t is None:
            tomb = self._tombs.trajs.get(trajectory_id)
            if tomb is not None:
                return tomb.record(trajectory_id)
            self._unknown_traj(trajectory_id)
        return TrajectoryRecord(
            trajectory_id=trajectory_id,
            group_id=t.group_id,
            version=t.version,
            state=t.state,
            buffer=self._groups[t.group_id].buffer,
            reason=None,
        )

    def group(self, group_id: Id) -> GroupRecord:
        """Ledger entry of a live group, or of one that closed (consumed, dropped, aborted)
        within the last ``tombstone_versions`` versions."""
        g = self._groups.get(group_id)
        if g is None:
            tomb = self._tombs.groups.get(group_id)
            if tomb is not None:
                return tomb.record(group_id)
            self._unknown_group(group_id)
        return g.record()

    def in_flight(self) -> tuple[Id, ...]:
        """Ids of all in-flight trajectories (O(live ledger); for inspection)."""
        return tuple(tid for tid, t in self._trajs.items() if t.state is _IN_FLIGHT)

    def stats(self) -> ProtocolStats:
        return ProtocolStats(
            next_buffer=self._next,
            published_version=self._published,
            abort_floor=self.abort_floor,
            trajectories_by_state={s.value: n for s, n in self._tcount.items()},
            groups_by_state={s.value: n for s, n in self._gcount.items()},
            buffers=self._buffer_fills(),
            staleness_histogram=dict(sorted(self._traj_hist.items())),
            group_staleness_histogram=dict(sorted(self._group_hist.items())),
            aborts_by_reason=dict(sorted(self._aborts_by_reason.items())),
            consumed_batches=self._consumed_batches,
            replacements_requested=self._replacements_requested,
            pending_notices=len(self._notices),
            tombstones=len(self._tombs),
        )

    # ------------------------------------------------------------------ checkpoint

    def _versions_to_dict(self) -> dict[str, Any]:
        return {"next_buffer": self._next, "published_version": self._published}

    def _ledger_to_dict(self) -> dict[str, Any]:
        """The ledger half of ``to_dict``, in its key order (it follows the placement keys)."""
        from ._ledger_io import ledger_to_dict

        return ledger_to_dict(self)

    def _restore_ledger(self, data: dict[str, Any]) -> None:
        """The ledger half of restore (after the placement is set up)."""
        from ._ledger_io import restore_ledger

        restore_ledger(self, data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """Restore a state written by ``to_dict`` (also after a JSON round trip, and the
        previous checkpoint format, which is migrated); a dict that is not a consistent
        state raises CorruptState."""
        try:
            return cls._restore(data)
        except ProtocolError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise CorruptState(f"not a {cls._FORMAT} state: {type(exc).__name__}: {exc}") from exc
