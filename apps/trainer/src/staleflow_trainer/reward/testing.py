"""Misbehaving reward plug-ins for fault tests (importable by Ray workers by dotted path).

``raise_or_hang`` scores like :func:`staleflow_trainer.reward.default.compute_score`, except
for prompts whose ground truth (an integer, as in the toy tasks) ends in 3 or 4 — it raises —
or in 7 or 9 — it hangs for :data:`HANG_S` seconds (the runner's ``timeout_s`` abandons it).
On the toy ``add`` task that is 16% and 33% of the prompts.
Which prompts fail is a pure function of the data, so a test can predict the dropped groups.
"""

from __future__ import annotations

import time
from typing import Any

from staleflow_trainer.reward.default import compute_score

HANG_S = 30.0


def failure_kind(ground_truth: str) -> str | None:
    """``"raise"``, ``"hang"`` or None (scores normally) for this ground truth."""
    gt = ground_truth.strip()
    if gt[-1:] in ("3", "4"):
        return "raise"
    if gt[-1:] in ("7", "9"):
        return "hang"
    return None


def raise_or_hang(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> Any:
    kind = failure_kind(ground_truth)
    if kind == "raise":
        raise ValueError(f"reward plug-in failure injected for ground truth {ground_truth!r}")
    if kind == "hang":
        time.sleep(HANG_S)
    return compute_score(data_source, solution_str, ground_truth, extra_info)


def coin(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    """0 or 1 from a hash of the response: rewards that vary within a group on any engine
    output (the simulated engine's tokens included), so some groups have equal rewards and
    some do not — what dynamic-sampling tests need."""
    import hashlib

    return float(hashlib.sha256(solution_str.encode()).digest()[0] & 1)


def zero(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """0 for every response: every group's rewards are equal, so dynamic sampling filters
    every group (the test of the run's stop when nothing can be trained)."""
    return 0.0


# Plug-ins for the runner's own tests: the runner imports a plug-in by its dotted path in a
# worker process, so test plug-ins live in an importable module.

_calls: dict[str, int] = {}


def echo(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> Any:
    """``{"score": 1.0, "pred": solution_str}``."""
    return {"score": 1.0, "pred": solution_str}


def numpy_half(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None
) -> Any:
    """0.5 as a numpy float32 scalar, as verl-style plug-ins often return."""
    import numpy as np

    return np.float32(0.5)


def huge(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """A finite reward beyond float32 range."""
    return 1e39


def flaky(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """Raises on the first two calls for each ``solution_str`` in a process, then 0.25."""
    _calls[solution_str] = _calls.get(solution_str, 0) + 1
    if _calls[solution_str] < 3:
        raise ValueError("transient")
    return 0.25


def broken(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    raise KeyError("boom")


def hang(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """Never returns (for an hour)."""
    time.sleep(3600)
    return 1.0


def word(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> str:
    return "high"


def die(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """The process running it exits at once."""
    import os

    os._exit(3)
