"""The trajectory store's state and the questions it answers without changing it (sans-IO).

:class:`StoreViews` holds every table of the store (payloads, locations, the multi-level queue,
what each instance runs, finished and released ids, groups, the event history) and answers the
read-only queries on them: where a trajectory is, its payload, the finished ones, what an
instance holds, the queue in service order, the ledger and the counts. It also checks the ids a
request names. :class:`~trajectory_server.TrajectoryStore` builds on it with the operations
that change the state; see :mod:`trajectory_server._core` for the rules they keep.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine_adapters import FinishReason
from trajectory_server._prompts import PromptTable
from trajectory_server._queue import ALL_LEVELS, LevelQueue, queue_entry
from trajectory_server._records import (
    FinishedTrajectory,
    LedgerEvent,
    Location,
    LocationState,
    QueueEntry,
    StoreStats,
    Trajectory,
    id_tuple,
    is_int,
)
from trajectory_server.errors import InvalidRecord, UnknownGroup, UnknownTrajectory, WrongState


class StoreViews:
    """The store's tables and its read-only queries; the operations are ``TrajectoryStore``'s."""

    def __init__(self) -> None:
        self._payload: dict[str, Trajectory] = {}  # queued, running and unreleased finished
        self._where: dict[str, Location] = {}  # every trajectory ever submitted
        self._queue = LevelQueue()
        self._running: dict[str, dict[str, None]] = {}  # instance -> ordered set of ids
        self._finished: dict[str, FinishReason] = {}  # unreleased finished ids
        self._finished_by: dict[str, str] = {}
        self._released: set[str] = set()
        self._groups: dict[str, list[str]] = {}
        self._routed_groups: set[str] = set()  # groups a member of which has been routed
        self._history: dict[str, list[LedgerEvent]] = {}
        self._event_seq = 0
        self._enqueue_seq = 0
        self.prompts = PromptTable()  # put once, submitted by key (not checkpointed)

    # -- queries ---------------------------------------------------------------------------------

    def location(self, trajectory_id: str) -> Location:
        return self._location(trajectory_id)

    def get(self, trajectory_id: str) -> Trajectory:
        """The payload the store holds (queued, running or unreleased finished)."""
        self._location(trajectory_id)
        if trajectory_id not in self._payload:
            raise UnknownTrajectory(
                f"trajectory {trajectory_id!r} holds no payload any more "
                f"({self._where[trajectory_id].state.value})",
                trajectory_id=trajectory_id,
            )
        return self._payload[trajectory_id]

    def finished_ids(self) -> tuple[str, ...]:
        """The ids :meth:`finished` would answer with no argument, without their payloads."""
        return tuple(self._finished)

    def finished(
        self, trajectory_ids: Sequence[str] | None = None
    ) -> tuple[FinishedTrajectory, ...]:
        """Unreleased finished trajectories (all, or the given ones), without freeing them."""
        ids = list(self._finished) if trajectory_ids is None else self._unique_ids(trajectory_ids)
        for tid in ids:
            if tid not in self._finished:
                raise WrongState(
                    f"trajectory {tid!r} is not an unreleased finished trajectory",
                    trajectory_id=tid,
                    state=self._location(tid).state.value,
                    owner=self._where[tid].instance_id,
                )
        return tuple(self._finished_record(tid) for tid in ids)

    def held_by(self, instance_id: str) -> tuple[str, ...]:
        return tuple(self._running.get(instance_id, ()))

    def instances(self) -> tuple[str, ...]:
        return tuple(i for i, held in self._running.items() if held)

    def group(self, group_id: str) -> tuple[str, ...]:
        if group_id not in self._groups:
            raise UnknownGroup(f"no group {group_id!r:.80}", group_id=group_id)
        return tuple(self._groups[group_id])

    def queue_view(
        self, limit: int | None = None, *, level: Any = ALL_LEVELS
    ) -> tuple[QueueEntry, ...]:
        """Queued trajectories in service order (light records), optionally one level only."""
        if limit is not None and (not is_int(limit) or limit < 0):
            raise InvalidRecord(f"limit must be an int >= 0 or None, got {limit!r}", field="limit")
        out: list[QueueEntry] = []
        for tid in self._queue.iter(level):
            if limit is not None and len(out) >= limit:
                break
            out.append(queue_entry(self._payload[tid]))
        return tuple(out)

    def level_counts(self) -> dict[int | None, int]:
        """Queue depth per level, in service order (``None`` = unversioned, last)."""
        return {lv: len(self._queue.levels[lv]) for lv in self._queue.order()}

    def history(self, trajectory_id: str) -> tuple[LedgerEvent, ...]:
        self._location(trajectory_id)
        return tuple(self._history[trajectory_id])

    def ledger(self) -> dict[str, Location]:
        """Where every trajectory ever submitted is now."""
        return dict(self._where)

    def stats(self) -> StoreStats:
        counts = dict.fromkeys(LocationState, 0)
        for where in self._where.values():
            counts[where.state] += 1
        return StoreStats(
            queued_by_level=self.level_counts(),
            queued=counts[LocationState.QUEUED],
            running=counts[LocationState.RUNNING],
            finished=counts[LocationState.FINISHED],
            dropped=counts[LocationState.DROPPED],
            released=len(self._released),
            running_by_instance={i: len(h) for i, h in self._running.items() if h},
            tokens_held=sum(t.prompt_len + t.generated_len for t in self._payload.values()),
        )

    def __len__(self) -> int:
        return len(self._where)

    def _finished_record(self, tid: str) -> FinishedTrajectory:
        return FinishedTrajectory(
            trajectory=self._payload[tid],
            finish_reason=self._finished[tid],
            instance_id=self._finished_by[tid],
        )

    def _location(self, tid: str) -> Location:
        where = self._where.get(tid) if isinstance(tid, str) else None
        if where is None:
            raise UnknownTrajectory(f"no trajectory {tid!r:.80}", trajectory_id=tid)
        return where

    def _unique_ids(self, trajectory_ids: Sequence[str]) -> list[str]:
        ids = list(id_tuple(trajectory_ids))
        if len(set(ids)) != len(ids):
            dup = next(t for t in ids if ids.count(t) > 1)
            raise InvalidRecord(
                f"trajectory {dup!r} appears twice in one request",
                field="trajectory_ids",
                trajectory_id=dup,
            )
        for tid in ids:
            self._location(tid)
        return ids
