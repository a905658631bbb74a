"""Length-only trajectory ledger with the trajectory server's multi-level queue semantics.

Why not the real ``TrajectoryStore``: at paper scale one run generates ~10⁸ tokens and a
weight sync re-queues thousands of partials with up to 20K tokens each; carrying token
payloads (and converting them for every resume) costs milliseconds per trajectory, minutes per
run (measured: 3.9 ms to rebuild one 5K-token resume request). The simulator only needs the
lengths, so this ledger keeps ``(prompt_len, generated_len, V_traj, where)`` per trajectory and
serves the same multi-level order as ``TrajectoryStore.queue_view``: partials by V_traj (oldest
first), longer partials first within a level, then FIFO; never-routed prompts last, FIFO.

Every trajectory ever submitted is in exactly one state: queued, running on one instance,
finished (rewarded, waiting for its group or the trainer), consumed, or dropped with a reason.
:meth:`check` verifies that against the staleness protocol's own ledger at the end of a run.
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from collections.abc import Iterable

from rollout_coordinator import QueuedTrajectory
from staleflow_trainer.errors import StaleflowError


class SimLedgerError(StaleflowError):
    """The simulator's ledger found a trajectory in an impossible place (a simulator bug)."""

    def __init__(self, message: str, *, trajectory_id: str) -> None:
        super().__init__(message)
        self.trajectory_id = trajectory_id


class Where(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    CONSUMED = "consumed"
    DROPPED = "dropped"


class TrajEntry:
    __slots__ = (
        "generated",
        "group",
        "group_index",
        "instance",
        "member",
        "prompt_len",
        "reason",
        "reward",
        "target",
        "tid",
        "v_traj",
        "wasted",
        "where",
    )

    def __init__(
        self, tid: str, group: str, group_index: int, member: int, prompt_len: int, target: int
    ) -> None:
        self.tid = tid
        self.group = group
        self.group_index = group_index
        self.member = member
        self.prompt_len = prompt_len
        self.target = target
        self.generated = 0
        self.v_traj: int | None = None
        self.where = Where.QUEUED
        self.instance: str | None = None
        self.reason: str | None = None
        self.reward = 0.0
        self.wasted = 0  # tokens generated and then thrown away (abort, drop)

    @property
    def tokens(self) -> int:
        return self.prompt_len + self.generated


class TrajectoryLedger:
    """Queue + ownership of every simulated trajectory, by length only."""

    def __init__(self) -> None:
        self.entries: dict[str, TrajEntry] = {}
        self._new: deque[str] = deque()
        self._new_set: set[str] = set()
        self._levels: dict[int, list[tuple[int, int, str]]] = {}
        self._level_versions: list[int] = []
        self._key: dict[str, tuple[int, tuple[int, int, str]]] = {}
        self._items: dict[str, QueuedTrajectory] = {}
        self._seq = 0
        self.held: dict[str, dict[str, None]] = {}  # instance -> trajectory ids it holds

    # ---- submission and queue -----------------------------------------------------------------

    def submit(self, entry: TrajEntry) -> None:
        if entry.tid in self.entries:
            raise SimLedgerError(f"duplicate trajectory {entry.tid!r}", trajectory_id=entry.tid)
        self.entries[entry.tid] = entry
        self._new.append(entry.tid)
        self._new_set.add(entry.tid)
        self._items[entry.tid] = QueuedTrajectory(
            trajectory_id=entry.tid,
            group_id=entry.group,
            v_traj=None,
            prompt_len=entry.prompt_len,
            generated_len=0,
        )

    @property
    def new_queued(self) -> int:
        return len(self._new_set)

    @property
    def partials_queued(self) -> int:
        return len(self._key)

    def level_counts(self) -> dict[str, int]:
        out = {str(v): len(self._levels[v]) for v in self._level_versions}
        out["new"] = len(self._new_set)
        return out

    def queue_items(self) -> list[QueuedTrajectory]:
        """The queue in service order (what ``QueueView`` expects)."""
        items = self._items
        out: list[QueuedTrajectory] = []
        for v in self._level_versions:
            out.extend(items[k[2]] for k in self._levels[v])
        if len(self._new) != len(self._new_set):
            self._new = deque(t for t in self._new if t in self._new_set)
        out.extend(items[t] for t in self._new)
        return out

    def _unqueue(self, tid: str) -> None:
        if tid in self._new_set:
            self._new_set.discard(tid)
            return
        v, key = self._key.pop(tid)
        bucket = self._levels[v]
        del bucket[bisect.bisect_left(bucket, key)]
        if not bucket:
            del self._levels[v]
            self._level_versions.remove(v)

    def _requeue(self, e: TrajEntry) -> None:
        assert e.v_traj is not None
        self._seq += 1
        key = (-e.generated, self._seq, e.tid)
        bucket = self._levels.get(e.v_traj)
        if bucket is None:
            bucket = self._levels[e.v_traj] = []
            bisect.insort(self._level_versions, e.v_traj)
        bisect.insort(bucket, key)
        self._key[e.tid] = (e.v_traj, key)
        self._items[e.tid] = QueuedTrajectory(
            trajectory_id=e.tid,
            group_id=e.group,
            v_traj=e.v_traj,
            prompt_len=e.prompt_len,
            generated_len=e.generated,
        )
        e.where = Where.QUEUED
        e.instance = None

    # ---- transitions --------------------------------------------------------------------------

    def _get(self, tid: str, *expected: Where) -> TrajEntry:
        e = self.entries.get(tid)
        if e is None:
            raise SimLedgerError(f"unknown trajectory {tid!r}", trajectory_id=tid)
        if e.where not in expected:
            raise SimLedgerError(
                f"trajectory {tid!r} is {e.where.value}, expected {[w.value for w in expected]}",
                trajectory_id=tid,
            )
        return e

    def route(self, tid: str, instance: str, version: int) -> TrajEntry:
        e = self._get(tid, Where.QUEUED)
        if e.v_traj is None:
            e.v_traj = version
        elif version < e.v_traj:
            raise SimLedgerError(
                f"{tid!r} has V_traj {e.v_traj}; routed at version {version}", trajectory_id=tid
            )
        self._unqueue(tid)
        del self._items[tid]
        e.where = Where.RUNNING
        e.instance = instance
        self.held.setdefault(instance, {})[tid] = None
        return e

    def return_partial(self, tid: str, generated: int) -> TrajEntry:
        e = self._get(tid, Where.RUNNING)
        self.held[e.instance].pop(tid, None)  # type: ignore[index]
        e.generated = generated
        self._requeue(e)
        return e

    def finish(self, tid: str, generated: int, reward: float) -> TrajEntry:
        e = self._get(tid, Where.RUNNING)
        self.held[e.instance].pop(tid, None)  # type: ignore[index]
        e.generated = generated
        e.reward = reward
        e.where = Where.FINISHED
        return e

    def consume(self, tid: str) -> TrajEntry:
        e = self._get(tid, Where.FINISHED)
        e.where = Where.CONSUMED
        return e

    def drop(self, tid: str, reason: str, generated: int | None = None) -> TrajEntry:
        """Drop from wherever it is (queued, running — the caller stopped the engine — or
        finished)."""
        e = self._get(tid, Where.QUEUED, Where.RUNNING, Where.FINISHED)
        if e.where is Where.QUEUED:
            self._unqueue(tid)
            self._items.pop(tid, None)
        elif e.where is Where.RUNNING:
            self.held[e.instance].pop(tid, None)  # type: ignore[index]
        if generated is not None:
            e.generated = generated
        e.wasted = e.generated
        e.where = Where.DROPPED
        e.reason = reason
        e.instance = None
        return e

    def held_by(self, instance: str) -> list[str]:
        return list(self.held.get(instance, ()))

    # ---- accounting ---------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        out = {w.value: 0 for w in Where}
        for e in self.entries.values():
            out[e.where.value] += 1
        return out

    def check(self, protocol: object, admitted: Iterable[str] | None = None) -> dict[str, int]:
        """Every admitted trajectory is consumed, in flight (queued partial, running, finished)
        or dropped with a reason, and agrees with the protocol's ledger. Raises on violation;
        returns the per-state counts."""
        from staleness_protocol import TrajectoryState, UnknownTrajectory

        proto_live = {TrajectoryState.IN_FLIGHT, TrajectoryState.FINISHED, TrajectoryState.OCCUPIED}
        ended = {TrajectoryState.DROPPED, TrajectoryState.ABORTED}
        for tid, e in self.entries.items():
            if e.v_traj is None:  # never admitted: must still be a queued new prompt
                if e.where is not Where.QUEUED and e.where is not Where.DROPPED:
                    raise SimLedgerError(
                        f"{tid!r} was never admitted but is {e.where.value}", trajectory_id=tid
                    )
                continue
            try:
                rec = protocol.trajectory(tid)  # type: ignore[attr-defined]
                state = rec.state
            except UnknownTrajectory:  # the protocol retired it: consumed, or ended long ago
                rec, state = None, None
            if e.where is Where.CONSUMED:
                ok = state is None or state is TrajectoryState.CONSUMED
            elif e.where is Where.DROPPED:
                ok = bool(e.reason) and (state is None or state in ended)
            elif e.where is Where.FINISHED:
                ok = state in (TrajectoryState.FINISHED, TrajectoryState.OCCUPIED)
            else:
                ok = state in proto_live
            if not ok:
                said = "retired" if rec is None else f"{rec.state.value} ({rec.reason})"
                raise SimLedgerError(
                    f"{tid!r}: simulator says {e.where.value} ({e.reason}), protocol says {said}",
                    trajectory_id=tid,
                )
        return self.counts()
