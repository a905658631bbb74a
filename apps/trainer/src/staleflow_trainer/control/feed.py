"""The prompt feed: which dataset row each new group is made from.

Rows come in a seeded, per-epoch shuffled order (epoch ``e``'s order is a pure function of
``(seed, e, rows)``), so the state is ``(serial, epoch, position)`` and a restored feed hands
out exactly the rows that would have come next. With ``rows=None`` the feed is the simulator's
unbounded synthetic stream: group ``k`` is row ``k``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


class PromptFeed:
    def __init__(self, *, rows: int | None, seed: int = 0, shuffle: bool = True) -> None:
        if rows is not None and rows < 1:
            raise ValueError(f"rows must be >= 1 or None, got {rows!r}")
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.serial = 0
        self.epoch = 0
        self.position = 0
        self._order: list[int] | None = None

    def _order_of(self, epoch: int) -> list[int]:
        assert self.rows is not None
        if not self.shuffle:
            return list(range(self.rows))
        return [int(i) for i in np.random.default_rng([self.seed, epoch]).permutation(self.rows)]

    def next_group(self) -> tuple[str, int]:
        """The next group's id and dataset row."""
        gid = f"g{self.serial:06d}"
        self.serial += 1
        if self.rows is None:
            return gid, self.serial - 1
        if self.position >= self.rows:
            self.epoch += 1
            self.position = 0
            self._order = None
        if self._order is None:
            self._order = self._order_of(self.epoch)
        row = self._order[self.position]
        self.position += 1
        return gid, row

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "serial": self.serial,
            "epoch": self.epoch,
            "position": self.position,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PromptFeed:
        f = cls(rows=d["rows"], seed=int(d["seed"]), shuffle=bool(d["shuffle"]))
        f.serial, f.epoch, f.position = int(d["serial"]), int(d["epoch"]), int(d["position"])
        return f
