"""The multi-level queue of the trajectory store (sans-IO).

Levels are ``v_traj`` values served oldest first, with never-routed prompts (level ``None``)
last; within a level, longer partials come first, then FIFO by enqueue sequence. Among the
never-routed prompts (which have generated nothing), the members of a group another member of
which has been routed (*promoted*) come first, then fresh groups' members, each FIFO.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Any

from trajectory_server._records import QueueEntry, Trajectory

ALL_LEVELS: Any = object()
"""Sentinel for :meth:`TrajectoryStore.queue_view`: every level."""

#: ``(rank, enqueue seq, trajectory_id)``: the rank is ``-generated_len`` at a version level and
#: ``PROMOTED`` or ``FRESH`` at level ``None`` (nothing generated there).
QueueKey = tuple[int, int, str]
PROMOTED = -1
FRESH = 0


class LevelQueue:
    """Multi-level queue: one sorted list of keys per level, levels in service order."""

    def __init__(self) -> None:
        self.levels: dict[int | None, list[QueueKey]] = {}
        self.versions: list[int] = []  # sorted int levels that exist
        self.key_of: dict[str, tuple[int | None, QueueKey]] = {}

    def __len__(self) -> int:
        return len(self.key_of)

    def __contains__(self, tid: str) -> bool:
        return tid in self.key_of

    def push(
        self, tid: str, level: int | None, generated_len: int, seq: int, promoted: bool = False
    ) -> None:
        """Queue ``tid`` at ``level``; ``promoted`` (level ``None`` only): ahead of fresh groups."""
        if level is None:
            assert not generated_len, "a never-routed prompt has generated nothing"
            key = (PROMOTED if promoted else FRESH, seq, tid)
        else:
            key = (-generated_len, seq, tid)
        bucket = self.levels.get(level)
        if bucket is None:
            bucket = self.levels[level] = []
            if level is not None:
                bisect.insort(self.versions, level)
        if not bucket or bucket[-1] < key:
            bucket.append(key)
        else:
            bisect.insort(bucket, key)
        self.key_of[tid] = (level, key)

    def remove(self, tid: str) -> None:
        level, key = self.key_of.pop(tid)
        bucket = self.levels[level]
        i = bisect.bisect_left(bucket, key)
        del bucket[i]
        if not bucket:
            del self.levels[level]
            if level is not None:
                self.versions.remove(level)

    def promote(self, tids: list[str]) -> None:
        """Move never-routed ``tids`` (queued at level ``None``) ahead of the fresh groups,
        keeping their enqueue order; ids queued elsewhere or already promoted are left as
        they are. A group's members were usually queued together: they move as one slice."""
        keys = sorted(
            at[1]
            for tid in tids
            if (at := self.key_of.get(tid)) is not None and at[0] is None and at[1][0] == FRESH
        )
        if not keys:
            return
        bucket = self.levels[None]
        i = bisect.bisect_left(bucket, keys[0])
        if bucket[i : i + len(keys)] == keys:
            del bucket[i : i + len(keys)]
        else:
            for key in keys:
                del bucket[bisect.bisect_left(bucket, key)]
        moved = [(PROMOTED, seq, tid) for _, seq, tid in keys]
        j = bisect.bisect_left(bucket, moved[0])
        if j == len(bucket) or moved[-1] < bucket[j]:
            bucket[j:j] = moved
        else:
            for key in moved:
                bisect.insort(bucket, key)
        for key in moved:
            self.key_of[key[2]] = (None, key)

    def order(self) -> list[int | None]:
        out: list[int | None] = list(self.versions)
        if None in self.levels:
            out.append(None)
        return out

    def iter(self, level: Any = ALL_LEVELS) -> Iterator[str]:
        levels = self.order() if level is ALL_LEVELS else [level]
        for lv in levels:
            for key in self.levels.get(lv, ()):
                yield key[2]


def queue_entry(t: Trajectory) -> QueueEntry:
    """The light queue record of a trajectory."""
    return QueueEntry(
        trajectory_id=t.trajectory_id,
        group_id=t.group_id,
        v_traj=t.v_traj,
        prompt_len=t.prompt_len,
        generated_len=t.generated_len,
        interruptions=t.interruptions,
    )
