"""Per-decode-step latency model of a rollout instance: one class for the engine and the router.

    τ(n, kv) = k4 + k1·kv + max(k2, b + k3·n)      seconds per decode step
    T(n, kv) = n / τ(n, kv)                         generated tokens per second (0 when n = 0)

``n`` is the number of running trajectories, ``kv`` the KV-resident tokens. ``k1`` is seconds
per resident token (attention reads the cache), ``k3`` seconds per running trajectory, ``k2``
the floor of the batch term (reading the weights once per step), ``k4`` a fixed per-step
overhead and ``b`` an intercept inside the max (the published fits have one; ``b = 0`` gives the
plain form). The sim engine advances by τ; the coordinator's router ranks instances by the
marginal gain ``T(n+1, kv+len) − T(n, kv)``.

Presets are the published fits for Qwen models served by one H20 GPU (tensor parallel 1),
reported with an average estimation error of about 10.5 %: Qwen3-30B-A3B, a 7B and a 14B dense
model. Coefficients load from and save to JSON (format ``staleflow-cost-model/1``, the file
``staleflow fit-cost-model`` writes).

Two helpers serve simulations that need the engine's true speed to differ from what the router
believes: :meth:`CostModel.scaled` (an instance that is uniformly faster or slower) and
:meth:`CostModel.with_errors` (per-coefficient multiplicative errors, e.g. the router's fitted
model versus the engine's true one); :func:`mean_abs_pct_error` measures how far apart two
models are over an operating grid.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from engine_adapters.errors import CostModelError

FORMAT = "staleflow-cost-model/1"
COEFFICIENTS = ("k1", "k2", "k3", "k4", "b")


def _coefficient(value: Any) -> Any:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value  # rejected by the validator, naming the field and the value given


def _finite_non_negative(inst: Any, attribute: attrs.Attribute[float], value: Any) -> None:
    if not (isinstance(value, float) and math.isfinite(value) and value >= 0.0):
        raise CostModelError(
            f"cost-model coefficient {attribute.name} must be a finite number >= 0, got {value!r}",
            field=attribute.name,
        )


@attrs.frozen(kw_only=True)
class CostModel:
    """Coefficients of ``τ(n, kv) = k4 + k1·kv + max(k2, b + k3·n)`` (seconds per step)."""

    #: s per KV-resident token.
    k1: float = attrs.field(converter=_coefficient, validator=_finite_non_negative)
    #: s, floor of the batch term.
    k2: float = attrs.field(converter=_coefficient, validator=_finite_non_negative)
    #: s per running trajectory.
    k3: float = attrs.field(converter=_coefficient, validator=_finite_non_negative)
    #: s, fixed per-step overhead.
    k4: float = attrs.field(converter=_coefficient, validator=_finite_non_negative)
    #: s, intercept inside the max.
    b: float = attrs.field(default=0.0, converter=_coefficient, validator=_finite_non_negative)
    name: str = "custom"

    def __attrs_post_init__(self) -> None:
        if self.k4 + max(self.k2, self.b) <= 0.0:
            raise CostModelError(
                "τ(1, 0) must be > 0: at least one of k4, k2, b must be positive", field="k4"
            )

    # ---- the formula -------------------------------------------------------------------------

    def batch_term(self, n: int) -> float:
        """The kv-independent part of one step: ``k4 + max(k2, b + k3·n)``."""
        return self.k4 + max(self.k2, self.b + self.k3 * n)

    def step_latency(self, n: int, kv: float) -> float:
        """τ(n, kv): seconds for one decode step."""
        return self.k4 + self.k1 * kv + max(self.k2, self.b + self.k3 * n)

    def throughput(self, n: int, kv: float) -> float:
        """T(n, kv) = n / τ(n, kv), tokens per second (0 when nothing runs)."""
        if n <= 0:
            return 0.0
        return n / (self.k4 + self.k1 * kv + max(self.k2, self.b + self.k3 * n))

    def marginal_gain(self, n: int, kv: float, length: float) -> float:
        """``T(n+1, kv+length) − T(n, kv)``: what one more trajectory of ``length`` tokens adds."""
        k1, k2, k3, k4, b = self.k1, self.k2, self.k3, self.k4, self.b
        after = (n + 1) / (k4 + k1 * (kv + length) + max(k2, b + k3 * (n + 1)))
        if n <= 0:
            return after
        return after - n / (k4 + k1 * kv + max(k2, b + k3 * n))

    def empty_gain(self, length: float) -> float:
        """The gain of giving one trajectory to an empty instance: ``T(1, length)``."""
        return 1.0 / (self.k4 + self.k1 * length + max(self.k2, self.b + self.k3))

    def time_for_tokens(self, n: int, kv: float, steps: int) -> float:
        """Wall time of ``steps`` decode steps at a fixed (n, kv)."""
        return steps * self.step_latency(n, kv)

    # ---- variants ----------------------------------------------------------------------------

    def scaled(self, factor: float, *, name: str | None = None) -> CostModel:
        """Every coefficient times ``factor`` (> 0): an instance ``1/factor`` times as fast."""
        if not (math.isfinite(factor) and factor > 0.0):
            raise CostModelError(f"scale factor must be finite and > 0, got {factor!r}")
        return self.with_errors({c: factor for c in COEFFICIENTS}, name=name)

    def with_errors(self, factors: Mapping[str, float], *, name: str | None = None) -> CostModel:
        """This model with coefficient ``c`` multiplied by ``factors[c]`` (missing ones: 1).

        ``factors`` keys must be among ``k1, k2, k3, k4, b`` and values finite and > 0. Used to
        give the router a model that differs from the engine's true one by known errors.
        """
        unknown = sorted(set(factors) - set(COEFFICIENTS))
        if unknown:
            raise CostModelError(
                f"unknown coefficient(s) {unknown}; allowed: {list(COEFFICIENTS)}",
                field=unknown[0],
            )
        for key, f in factors.items():
            if (
                isinstance(f, bool)
                or not isinstance(f, int | float)
                or not (math.isfinite(f) and f > 0.0)
            ):
                raise CostModelError(
                    f"error factor for {key} must be a finite number > 0, got {f!r}", field=key
                )
        values = {c: getattr(self, c) * float(factors.get(c, 1.0)) for c in COEFFICIENTS}
        return CostModel(**values, name=self.name if name is None else name)

    # ---- persistence -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "name": self.name, **{c: getattr(self, c) for c in COEFFICIENTS}}

    def to_json(self) -> dict[str, Any]:
        """Alias of :meth:`to_dict` (the JSON object the coefficient file holds)."""
        return self.to_dict()

    @classmethod
    def from_dict(cls, data: Any) -> CostModel:
        """Read a coefficient mapping (``k1..k4`` required, ``b`` and ``name`` optional)."""
        if not isinstance(data, Mapping):
            raise CostModelError(f"a cost model is a JSON object, got {type(data).__name__}")
        fmt = data.get("format", FORMAT)
        if fmt != FORMAT:
            raise CostModelError(
                f"unknown cost-model format {fmt!r}; expected {FORMAT!r}", field="format"
            )
        missing = [c for c in ("k1", "k2", "k3", "k4") if c not in data]
        if missing:
            raise CostModelError(f"cost model lacks coefficient(s) {missing}", field=missing[0])
        unknown = sorted(set(data) - {*COEFFICIENTS, "format", "name", "mape", "records"})
        if unknown:
            raise CostModelError(f"unknown cost-model field(s) {unknown}", field=unknown[0])
        return cls(
            k1=data["k1"],
            k2=data["k2"],
            k3=data["k3"],
            k4=data["k4"],
            b=data.get("b", 0.0),
            name=str(data.get("name", "custom")),
        )

    def save(self, path: str | Path, **extra: Any) -> None:
        """Write the coefficient file (``extra`` keys such as ``mape`` are stored beside)."""
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
        """A published fit by name (see :data:`PRESETS`)."""
        return preset(name)

    @classmethod
    def resolve(cls, value: CostModel | str | Mapping[str, Any]) -> CostModel:
        """A model from a model, a preset name, a path to a ``.json`` file or a mapping."""
        if isinstance(value, CostModel):
            return value
        if isinstance(value, str):
            if value in PRESETS:
                return PRESETS[value]
            if value.endswith(".json"):
                return cls.load(value)
            raise CostModelError(
                f"unknown cost-model preset {value!r}; allowed: {sorted(PRESETS)} "
                "or a path ending in .json",
                field="name",
            )
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise CostModelError(
            f"a cost model is a CostModel, a preset name {sorted(PRESETS)}, a .json path or a "
            f"mapping of coefficients, got {type(value).__name__}"
        )


#: Published fit, Qwen3-30B-A3B, TP1 on an H20.
QWEN3_30B_A3B_H20 = CostModel(
    name="qwen3-30b-a3b-h20", k1=7.28e-8, k2=0.01151, b=0.00979, k3=1.249e-4, k4=8.67e-4
)
#: Published fit, 7B dense, TP1 on an H20.
QWEN_7B_H20 = CostModel(name="qwen-7b-h20", k1=3.35e-8, k2=0.0064, b=0.0027, k3=1.231e-4, k4=0.0028)
#: Published fit, 14B dense, TP1 on an H20.
QWEN_14B_H20 = CostModel(
    name="qwen-14b-h20", k1=1.165e-7, k2=0.0123, b=0.00491, k3=2.441e-4, k4=0.00197
)

PRESETS: dict[str, CostModel] = {m.name: m for m in (QWEN3_30B_A3B_H20, QWEN_7B_H20, QWEN_14B_H20)}


def preset(name: str) -> CostModel:
    """A published cost-model fit by name (see :data:`PRESETS`)."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise CostModelError(
            f"unknown cost-model preset {name!r}; allowed: {sorted(PRESETS)}", field="name"
        ) from None


def mean_abs_pct_error(
    true: CostModel, believed: CostModel, points: Iterable[tuple[int, float]]
) -> float:
    """Mean ``|τ_believed − τ_true| / τ_true`` over ``(n, kv)`` points (a fraction)."""
    errors = [
        abs(believed.step_latency(n, kv) - true.step_latency(n, kv)) / true.step_latency(n, kv)
        for n, kv in points
    ]
    if not errors:
        raise CostModelError("mean_abs_pct_error needs at least one (n, kv) point")
    return sum(errors) / len(errors)
