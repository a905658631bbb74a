"""Response-length workloads for the sim engine: how long each trajectory *wants* to be.

Theory of operation
-------------------
Every trajectory gets a true response length (``GenerateRequest.target_length``) drawn from a
distribution — lognormal, power-law (Pareto), bimodal (two lognormals) or a replayed trace —
and capped at ``max_length``: whatever would exceed the cap lands exactly on it, which is how
real RL runs look (a spike of truncated responses at the limit).

Lengths inside a GRPO group are correlated through a per-prompt difficulty factor: each draw
uses the standard normal ``z = √ρ·d + √(1−ρ)·ε`` (``d`` shared by the group, ``ε`` per
trajectory, ``ρ = group_correlation``) mapped through the distribution's quantile function
(a Gaussian copula), so the marginal distribution is the same for any ``ρ``.

Everything is deterministic under ``seed``; ``stream`` selects independent sub-streams (e.g.
one per training step).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np

from engine_adapters.errors import InvalidRequest

Kind = Literal["lognormal", "power_law", "bimodal", "trace"]
KINDS: tuple[str, ...] = ("lognormal", "power_law", "bimodal", "trace")


def _check(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise InvalidRequest(f"WorkloadConfig.{field}: {message}", field=field)


@attrs.frozen(kw_only=True)
class WorkloadConfig:
    """Parameters of a response-length distribution (only the fields of ``kind`` matter).

    * lognormal: ``median`` and ``sigma`` (of log length).
    * power_law: Pareto with ``x_min`` and tail index ``alpha`` (smaller = heavier tail).
    * bimodal: lognormal modes (``median``, ``sigma``) and (``median2``, ``sigma2``), the
      second with probability ``weight2``.
    * trace: ``trace_path`` to a JSONL file, one length per line (a bare integer or an object
      with a ``"length"`` key); draws are quantiles of the empirical distribution.
    """

    kind: Kind = "lognormal"
    max_length: int = 20_480
    min_length: int = 1
    median: float = 1_000.0
    sigma: float = 1.0
    alpha: float = 1.5
    x_min: float = 200.0
    median2: float = 15_000.0
    sigma2: float = 0.3
    weight2: float = 0.1
    trace_path: str | None = None
    group_correlation: float = 0.5
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        _check(self.kind in KINDS, "kind", f"must be one of {list(KINDS)}, got {self.kind!r}")
        _check(self.max_length >= 1, "max_length", f"must be >= 1, got {self.max_length}")
        _check(
            1 <= self.min_length <= self.max_length,
            "min_length",
            f"must be in [1, max_length={self.max_length}], got {self.min_length}",
        )
        _check(self.median > 0, "median", f"must be > 0, got {self.median}")
        _check(self.sigma >= 0, "sigma", f"must be >= 0, got {self.sigma}")
        _check(self.alpha > 0, "alpha", f"must be > 0, got {self.alpha}")
        _check(self.x_min > 0, "x_min", f"must be > 0, got {self.x_min}")
        _check(self.median2 > 0, "median2", f"must be > 0, got {self.median2}")
        _check(self.sigma2 >= 0, "sigma2", f"must be >= 0, got {self.sigma2}")
        _check(0.0 <= self.weight2 <= 1.0, "weight2", f"must be in [0, 1], got {self.weight2}")
        _check(
            0.0 <= self.group_correlation <= 1.0,
            "group_correlation",
            f"must be in [0, 1], got {self.group_correlation}",
        )
        _check(
            self.kind != "trace" or self.trace_path is not None,
            "trace_path",
            "is required when kind='trace'",
        )

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> WorkloadConfig:
        allowed = {a.name for a in attrs.fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise InvalidRequest(
                f"unknown WorkloadConfig field(s) {unknown}; allowed: {sorted(allowed)}",
                field=unknown[0],
            )
        return cls(**data)


def load_trace(path: str | Path) -> np.ndarray:
    """Read a JSONL length trace (ints or ``{"length": n}`` objects), sorted ascending."""
    lengths = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            value = item["length"] if isinstance(item, dict) else item
            if not isinstance(value, int) or value < 1:
                raise InvalidRequest(
                    f"{path}:{lineno}: a length must be an integer >= 1, got {value!r}",
                    field="trace_path",
                )
            lengths.append(value)
    if not lengths:
        raise InvalidRequest(f"trace {path} holds no lengths", field="trace_path")
    return np.sort(np.asarray(lengths, dtype=np.int64))


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    cdf: np.ndarray = 0.5 * (1.0 + _erf(z / math.sqrt(2.0)))
    return cdf


class LengthSampler:
    """Draws capped, group-correlated response lengths (see the module docstring)."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self._trace = None
        if config.kind == "trace":
            assert config.trace_path is not None  # validated by WorkloadConfig
            self._trace = load_trace(config.trace_path)

    def quantile(self, u: np.ndarray) -> np.ndarray:
        """Uncapped length at probability ``u`` in (0, 1) (float array)."""
        c = self.config
        u = np.clip(u, 1e-12, 1 - 1e-12)
        if c.kind == "lognormal":
            return c.median * np.exp(c.sigma * _probit(u))
        if c.kind == "power_law":
            return c.x_min * (1.0 - u) ** (-1.0 / c.alpha)
        if c.kind == "bimodal":
            w1 = 1.0 - c.weight2
            out = np.empty_like(u)
            low = u < w1
            if w1 > 0:
                out[low] = c.median * np.exp(c.sigma * _probit(u[low] / w1))
            if c.weight2 > 0:
                out[~low] = c.median2 * np.exp(c.sigma2 * _probit((u[~low] - w1) / c.weight2))
            return out
        assert self._trace is not None
        idx = np.minimum((u * len(self._trace)).astype(np.int64), len(self._trace) - 1)
        picked: np.ndarray = self._trace[idx].astype(np.float64)
        return picked

    def groups(self, num_groups: int, group_size: int, *, stream: int = 0) -> np.ndarray:
        """Lengths of ``num_groups`` groups of ``group_size``: an int array (groups, size)."""
        if num_groups < 0 or group_size < 1:
            raise InvalidRequest(
                f"need num_groups >= 0 and group_size >= 1, got {num_groups}, {group_size}",
                field="group_size",
            )
        c = self.config
        rng = np.random.default_rng([c.seed, stream])
        d = rng.standard_normal((num_groups, 1))
        eps = rng.standard_normal((num_groups, group_size))
        rho = c.group_correlation
        z = math.sqrt(rho) * d + math.sqrt(1.0 - rho) * eps
        raw = self.quantile(_normal_cdf(z))
        lengths: np.ndarray = np.clip(np.rint(raw), c.min_length, c.max_length).astype(np.int64)
        return lengths

    def sample(self, n: int, *, stream: int = 0) -> np.ndarray:
        """``n`` independent lengths (groups of one)."""
        return self.groups(n, 1, stream=stream)[:, 0]


def _probit(u: np.ndarray) -> np.ndarray:
    """Inverse standard normal CDF (Acklam's rational approximation, refined by Newton)."""
    u = np.asarray(u, dtype=np.float64)
    a = [-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02,
         1.383577518672690e02, -3.066479806614716e01, 2.506628277459239e00]  # fmt: skip
    b = [-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02,
         6.680131188771972e01, -1.328068155288572e01]  # fmt: skip
    cc = [-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00,
          -2.549732539343734e00, 4.374664141464968e00, 2.938163982698783e00]  # fmt: skip
    dd = [7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00,
          3.754408661907416e00]  # fmt: skip
    lo, hi = 0.02425, 1 - 0.02425
    x = np.empty_like(u)
    m = u < lo
    q = np.sqrt(-2 * np.log(u[m]))
    x[m] = (((((cc[0] * q + cc[1]) * q + cc[2]) * q + cc[3]) * q + cc[4]) * q + cc[5]) / (
        (((dd[0] * q + dd[1]) * q + dd[2]) * q + dd[3]) * q + 1
    )
    m = u > hi
    q = np.sqrt(-2 * np.log(1 - u[m]))
    x[m] = -(((((cc[0] * q + cc[1]) * q + cc[2]) * q + cc[3]) * q + cc[4]) * q + cc[5]) / (
        (((dd[0] * q + dd[1]) * q + dd[2]) * q + dd[3]) * q + 1
    )
    m = (u >= lo) & (u <= hi)
    q = u[m] - 0.5
    r = q * q
    x[m] = (
        (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5])
        * q
        / (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)
    )
    # one Newton step on Φ(x) = u
    e = _normal_cdf(x) - u
    newton: np.ndarray = x - e * math.sqrt(2 * math.pi) * np.exp(x * x / 2)
    return newton
