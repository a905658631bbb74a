"""The multi-level queue of the trajectory store (sans-IO).

Levels are ``v_traj`` values served oldest first, with never-routed prompts (level ``None``)
last; within a level, longer partials come first, then FIFO by enqueue sequence.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Any

from trajectory_server._records import QueueEntry, Trajectory

ALL_LEVELS: Any = object()
"""Sentinel for :meth:`TrajectoryStore.queue_view`: every level."""

QueueKey = tuple[int, int, str]  # (-generated_len, enqueue seq, trajectory_id)


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

    def push(self, tid: str, level: int | None, generated_len: int, seq: int) -> None:
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
