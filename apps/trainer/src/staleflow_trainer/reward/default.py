"""The default reward function: toy tasks by their own rule, everything else by the math
checker. verl convention: ``compute_score(data_source, solution_str, ground_truth,
extra_info) -> float``."""

from __future__ import annotations

from typing import Any

from staleflow_trainer.data.toy import toy_score
from staleflow_trainer.reward import math_checker


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None
) -> float:
    if data_source.startswith("toy_"):
        return toy_score(solution_str, str(ground_truth))
    return math_checker.compute_score(data_source, solution_str, ground_truth, extra_info)
