"""Per-decode-step latency model shared by the sim engine and the coordinator.

``τ(n, kv) = k4 + k1·kv + max(k2, b + k3·n)`` seconds per decode step, where ``n`` is the number
of running trajectories and ``kv`` the KV-resident tokens; throughput ``T(n, kv) = n / τ``.
``b`` is the intercept inside the max (the DESIGN §5 variant); ``b = 0`` gives the plain form.
Presets are the published H20 fits (DESIGN §5, seconds per step, TP1).
"""

from __future__ import annotations

from typing import Any

import attrs

from engine_adapters.errors import InvalidRequest


def _non_negative_float(inst: Any, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 0.0:  # also rejects NaN
        raise InvalidRequest(
            f"CostModel.{attribute.name} must be a finite number >= 0, got {value!r}",
            field=attribute.name,
        )


@attrs.frozen(kw_only=True)
class CostModel:
    """Coefficients of ``τ(n, kv) = k4 + k1·kv + max(k2, b + k3·n)`` (seconds per step)."""

    name: str = "custom"
    k1: float = attrs.field(converter=float, validator=_non_negative_float)
    k2: float = attrs.field(converter=float, validator=_non_negative_float)
    k3: float = attrs.field(converter=float, validator=_non_negative_float)
    k4: float = attrs.field(converter=float, validator=_non_negative_float)
    b: float = attrs.field(default=0.0, converter=float, validator=_non_negative_float)

    def __attrs_post_init__(self) -> None:
        if self.k4 + max(self.k2, self.b) <= 0.0:
            raise InvalidRequest(
                "CostModel needs a positive step latency at n=0: k4 + max(k2, b) must be > 0",
                field="k4",
            )

    def batch_term(self, n: int) -> float:
        """The kv-independent part of one step: ``k4 + max(k2, b + k3·n)``."""
        return self.k4 + max(self.k2, self.b + self.k3 * n)

    def step_latency(self, n: int, kv: int | float) -> float:
        """Seconds for one decode step with ``n`` running trajectories and ``kv`` resident tokens."""
        return self.batch_term(n) + self.k1 * kv

    def throughput(self, n: int, kv: int | float) -> float:
        """Generated tokens per second: ``n / τ(n, kv)`` (0 when nothing runs)."""
        if n <= 0:
            return 0.0
        return n / self.step_latency(n, kv)

    def marginal_gain(self, n: int, kv: int | float, added_kv: int | float) -> float:
        """``T(n+1, kv+added_kv) − T(n, kv)``: what routing one more trajectory adds."""
        return self.throughput(n + 1, kv + added_kv) - self.throughput(n, kv)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


PRESETS: dict[str, CostModel] = {
    "qwen3-30b-a3b-h20": CostModel(
        name="qwen3-30b-a3b-h20", k1=7.28e-8, k2=0.01151, b=0.00979, k3=1.249e-4, k4=8.67e-4
    ),
    "qwen-7b-h20": CostModel(
        name="qwen-7b-h20", k1=3.35e-8, k2=0.0064, b=0.0027, k3=1.231e-4, k4=0.0028
    ),
    "qwen-14b-h20": CostModel(
        name="qwen-14b-h20", k1=1.165e-7, k2=0.0123, b=0.00491, k3=2.441e-4, k4=0.00197
    ),
}


def preset(name: str) -> CostModel:
    """A published cost-model fit by name (see :data:`PRESETS`)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidRequest(
            f"unknown cost-model preset {name!r}; allowed: {sorted(PRESETS)}", field="cost_model"
        ) from None
