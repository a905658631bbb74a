"""Per-decode-step latency model of a rollout instance (DESIGN §5).

    τ(n, kv) = k4 + k1·kv + max(k2, b + k3·n)      seconds per decode step
    T(n, kv) = n / τ(n, kv)                         tokens per second (0 when n = 0)

``n`` is the number of running trajectories, ``kv`` the KV-resident tokens. ``b`` is the
intercept inside the max (the published fits have one; ``b = 0`` gives the plain variant).
The router ranks instances by the marginal gain ``T(n+1, kv+len) − T(n, kv)``.

Presets are the published H20 fits (TP1). Coefficients load from and save to JSON (the file
``staleflow fit-cost-model`` writes). ``engine_adapters.sim.cost`` has a sibling class for the
sim engine; this one is self-contained so the coordinator does not depend on engine-adapters.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs

from rollout_coordinator.errors import CostModelError

_FIELDS = ("k1", "k2", "k3", "k4", "b")


def _finite_non_negative(inst: Any, attribute: attrs.Attribute[float], value: float) -> None:
    if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise CostModelError(
            f"cost-model coefficient {attribute.name} must be a finite number >= 0, got {value!r}",
            field=attribute.name,
        )


@attrs.frozen(kw_only=True, slots=True)
class CostModel:
    """τ(n, kv) = k4 + k1·kv + max(k2, b + k3·n); all coefficients in seconds (per token for k1,
    per trajectory for k3)."""

    k1: float = attrs.field(validator=_finite_non_negative)  # s per KV-resident token
    k2: float = attrs.field(validator=_finite_non_negative)  # s, floor of the compute term
    k3: float = attrs.field(validator=_finite_non_negative)  # s per running trajectory
    k4: float = attrs.field(validator=_finite_non_negative)  # s, fixed per-step overhead
    b: float = attrs.field(default=0.0, validator=_finite_non_negative)  # intercept in the max
    name: str = ""

    def __attrs_post_init__(self) -> None:
        if self.k4 + max(self.k2, self.b) <= 0:
            raise CostModelError(
                "τ(1, 0) must be > 0: at least one of k4, k2, b must be positive", field="k4"
            )

    def step_latency(self, n: int, kv: float) -> float:
        """τ(n, kv), seconds per decode step."""
        return self.k4 + self.k1 * kv + max(self.k2, self.b + self.k3 * n)

    def throughput(self, n: int, kv: float) -> float:
        """T(n, kv) = n / τ(n, kv), tokens per second."""
        if n <= 0:
            return 0.0
        return n / (self.k4 + self.k1 * kv + max(self.k2, self.b + self.k3 * n))

    def marginal_gain(self, n: int, kv: float, length: int) -> float:
        """T(n+1, kv+length) − T(n, kv): what one more trajectory of ``length`` tokens adds."""
        k1, k2, k3, k4, b = self.k1, self.k2, self.k3, self.k4, self.b
        after = (n + 1) / (k4 + k1 * (kv + length) + max(k2, b + k3 * (n + 1)))
        if n <= 0:
            return after
        return after - n / (k4 + k1 * kv + max(k2, b + k3 * n))

    def empty_gain(self, length: int) -> float:
        """The gain of giving one trajectory to an empty instance: T(1, length)."""
        return 1.0 / (self.k4 + self.k1 * length + max(self.k2, self.b + self.k3))

    def time_for_tokens(self, n: int, kv: float, steps: int) -> float:
        """Wall time of ``steps`` decode steps at a fixed (n, kv); T = n/τ per step."""
        return steps * self.step_latency(n, kv)

    # ---- persistence ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "staleflow-cost-model/1",
            "name": self.name,
            **{f: getattr(self, f) for f in _FIELDS},
        }

    @classmethod
    def from_dict(cls, data: Any) -> CostModel:
        if not isinstance(data, dict):
            raise CostModelError(f"a cost model is a JSON object, got {type(data).__name__}")
        fmt = data.get("format", "staleflow-cost-model/1")
        if fmt != "staleflow-cost-model/1":
            raise CostModelError(
                f"unknown cost-model format {fmt!r}; expected 'staleflow-cost-model/1'",
                field="format",
            )
        missing = [f for f in ("k1", "k2", "k3", "k4") if f not in data]
        if missing:
            raise CostModelError(f"cost model lacks coefficient(s) {missing}", field=missing[0])
        unknown = set(data) - {*_FIELDS, "format", "name", "mape", "records"}
        if unknown:
            raise CostModelError(
                f"unknown cost-model field(s) {sorted(unknown)}", field=sorted(unknown)[0]
            )
        return cls(
            k1=data["k1"],
            k2=data["k2"],
            k3=data["k3"],
            k4=data["k4"],
            b=data.get("b", 0.0),
            name=str(data.get("name", "")),
        )

    def save(self, path: str | Path, **extra: Any) -> None:
        Path(path).write_text(json.dumps({**self.to_dict(), **extra}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CostModelError(f"cannot read cost model {str(path)!r}: {exc}") from exc
        return cls.from_dict(data)

    @classmethod
    def preset(cls, name: str) -> CostModel:
        try:
            return PRESETS[name]
        except KeyError:
            raise CostModelError(
                f"unknown cost-model preset {name!r}; known: {sorted(PRESETS)}", field="name"
            ) from None


#: Published fit, Qwen3-30B-A3B, TP1 on an H20 (DESIGN §5).
QWEN3_30B_A3B_H20 = CostModel(
    name="qwen3-30b-a3b-h20", k2=0.01151, b=0.00979, k3=1.249e-4, k4=8.67e-4, k1=7.28e-8
)
#: Published fit, Qwen 7B, TP1 on an H20.
QWEN_7B_H20 = CostModel(name="qwen-7b-h20", k2=0.0064, b=0.0027, k3=1.231e-4, k4=0.0028, k1=3.35e-8)
#: Published fit, Qwen 14B, TP1 on an H20.
QWEN_14B_H20 = CostModel(
    name="qwen-14b-h20", k2=0.0123, b=0.00491, k3=2.441e-4, k4=0.00197, k1=1.165e-7
)

PRESETS: dict[str, CostModel] = {m.name: m for m in (QWEN3_30B_A3B_H20, QWEN_7B_H20, QWEN_14B_H20)}
