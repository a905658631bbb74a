"""The per-decode-step latency model the router ranks instances by.

It is :class:`engine_adapters.cost_model.CostModel` — one class for the sim engine that
advances by it and for the coordinator that routes by it — re-exported here with its presets:

    τ(n, kv) = k4 + k1·kv + max(k2, b + k3·n)      seconds per decode step
    T(n, kv) = n / τ(n, kv)                         tokens per second (0 when n = 0)

Coefficients load from and save to JSON (the file ``staleflow fit-cost-model`` writes;
:mod:`rollout_coordinator.fit` fits them). Errors are
:class:`engine_adapters.errors.CostModelError`, re-exported as
:class:`rollout_coordinator.CostModelError`.
"""

from engine_adapters.cost_model import (
    PRESETS,
    QWEN3_30B_A3B_H20,
    QWEN_7B_H20,
    QWEN_14B_H20,
    CostModel,
    mean_abs_pct_error,
    preset,
)

__all__ = [
    "PRESETS",
    "QWEN3_30B_A3B_H20",
    "QWEN_7B_H20",
    "QWEN_14B_H20",
    "CostModel",
    "mean_abs_pct_error",
    "preset",
]
