"""A checkpointable cursor over a dataset: epochs, a seeded shuffle per epoch, exact resume.

The order of epoch ``e`` is a pure function of ``(seed, e, num_records)``, so the state is
just ``(epoch, position)``; restoring it continues with exactly the prompt that would have
come next. Which handed-out prompts are still in flight is the trajectory server's business
(checkpointed with it), not the cursor's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from staleflow_trainer.errors import CheckpointError, DataError


class DataCursor:
    """Hands out record indices in a seeded, per-epoch shuffled order."""

    def __init__(self, num_records: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if num_records < 1:
            raise DataError(f"num_records must be >= 1, got {num_records}", field="num_records")
        self._n = num_records
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._order = self._order_for(0)

    def _order_for(self, epoch: int) -> np.ndarray:
        if not self._shuffle:
            return np.arange(self._n)
        rng = np.random.default_rng([self._seed, epoch])
        return rng.permutation(self._n)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        return self._position

    @property
    def served(self) -> int:
        """Total indices handed out since the start."""
        return self._epoch * self._n + self._position

    def next_index(self) -> int:
        if self._position >= self._n:
            self._epoch += 1
            self._position = 0
            self._order = self._order_for(self._epoch)
        idx = int(self._order[self._position])
        self._position += 1
        return idx

    def take(self, k: int) -> list[int]:
        if k < 0:
            raise DataError(f"take(k): k must be >= 0, got {k}", field="k")
        return [self.next_index() for _ in range(k)]

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_records": self._n,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "epoch": self._epoch,
            "position": self._position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; the dataset size, seed and shuffle flag must match the checkpoint's."""
        for key, mine in (
            ("num_records", self._n),
            ("seed", self._seed),
            ("shuffle", self._shuffle),
        ):
            if state.get(key) != mine:
                raise CheckpointError(
                    f"data cursor checkpoint has {key}={state.get(key)!r}, this run has {mine!r}"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self._n:
            raise CheckpointError(f"data cursor checkpoint out of range: {epoch=}, {position=}")
        self._epoch, self._position = epoch, position
        self._order = self._order_for(epoch)
