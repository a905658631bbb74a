"""Built-in toy tasks a tiny, randomly initialised model learns on CPU in a few dozen steps.

Prompts are short arithmetic strings over the character tokenizer of
:mod:`staleflow_trainer.tiny_model` (one character = one token); answers are one digit, so a
random policy is right about 1 time in 20 and GRPO sees signal from the first batch.

* ``add``       — ``"3+4="`` → ``"7"`` with ``a + b <= 9`` (55 distinct prompts)
* ``add_mod10`` — ``"8+5="`` → ``"3"`` (100 prompts; harder)
* ``successor`` — ``"7+1="`` → ``"8"`` (mod 10; 10 prompts; easiest)
* ``copy``      — ``"7="`` → ``"7"`` (10 prompts)

The reward (:func:`toy_score`) is 1.0 when the response's leading digits equal the answer,
``format_credit`` (0.1) when the response starts with some other single digit, else 0. The
small format credit gives GRPO signal before the first right answers appear; measured with
B×n = 8×8, lr 1e-2 on the 2-layer / 64-hidden tiny model: accuracy ≈ 3% over the first 10
steps, 15–20% by step 60 (reward 0.06 → 0.2–0.28).
"""

from __future__ import annotations

import re

import numpy as np

from staleflow_trainer.data.records import PromptRecord
from staleflow_trainer.errors import DataError

TOY_TASKS = ("add", "add_mod10", "successor", "copy")


def _pairs(task: str) -> list[tuple[str, str]]:
    if task == "add":
        return [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10) if a + b <= 9]
    if task == "add_mod10":
        return [(f"{a}+{b}=", str((a + b) % 10)) for a in range(10) for b in range(10)]
    if task == "successor":
        return [(f"{a}+1=", str((a + 1) % 10)) for a in range(10)]
    if task == "copy":
        return [(f"{a}=", str(a)) for a in range(10)]
    raise DataError(f"unknown toy task {task!r}; choose one of {TOY_TASKS}", field="data.toy_task")


def toy_records(task: str, *, size: int, seed: int = 0) -> list[PromptRecord]:
    """``size`` prompts drawn (with replacement, seeded) from the task's distinct prompts."""
    pairs = _pairs(task)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(pairs), size=size)
    return [
        PromptRecord(
            index=i,
            prompt=pairs[j][0],
            ground_truth=pairs[j][1],
            data_source=f"toy_{task}",
            extra_info={"task": task},
        )
        for i, j in enumerate(picks.tolist())
    ]


_LEADING_DIGITS = re.compile(r"\s*(\d+)")


def toy_score(solution_str: str, ground_truth: str, *, format_credit: float = 0.1) -> float:
    """1.0 if the response starts with exactly the answer's digits; ``format_credit`` if it
    starts with another single digit; else 0.0."""
    m = _LEADING_DIGITS.match(solution_str)
    if m is None:
        return 0.0
    if m.group(1) == ground_truth.strip():
        return 1.0
    return format_credit if len(m.group(1)) == 1 else 0.0


def toy_accuracy(solution_str: str, ground_truth: str) -> float:
    """1.0 if the response starts with exactly the answer's digits (no format credit)."""
    return 1.0 if toy_score(solution_str, ground_truth, format_credit=0.0) == 1.0 else 0.0
