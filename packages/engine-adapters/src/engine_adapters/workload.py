"""Response-length workloads for the sim engine: how long each trajectory *wants* to be.

Theory of operation
-------------------
Every trajectory gets a true response length (``GenerateRequest.target_length``) drawn from a
distribution — lognormal, power-law (Pareto), bimodal (two lognormals), a replayed trace of
single lengths, or a replayed trace of whole groups — and capped at ``max_length``: whatever
would exceed the cap lands exactly on it, which is how real RL runs look (a spike of truncated
responses at the limit).

Lengths inside a GRPO group are correlated through a per-prompt difficulty factor: each draw
uses the standard normal ``z = √ρ·d + √(1−ρ)·ε`` (``d`` shared by the group, ``ε`` per
trajectory, ``ρ = group_correlation``) mapped through the distribution's quantile function
(a Gaussian copula), so the marginal distribution is the same for any ``ρ``.

A *group trace* (``kind="group_trace"``) keeps the correlation a real run had instead: each
record is one prompt's responses (:func:`load_group_trace`), a group is drawn as one record
(uniformly, with replacement) and its members come from that record only — ``group_size``
of its lengths drawn without replacement if it has that many, else with replacement. ``group_correlation`` does not apply to it.

Everything is deterministic under ``seed``; ``stream`` selects independent sub-streams (e.g.
one per training step).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np

from engine_adapters.errors import InvalidRequest

Kind = Literal["lognormal", "power_law", "bimodal", "trace", "group_trace"]
KINDS: tuple[str, ...] = ("lognormal", "power_law", "bimodal", "trace", "group_trace")


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
    * group_trace: ``trace_path`` to a file of groups (:func:`load_group_trace`); every group
      is one record of it.
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
            self.kind not in ("trace", "group_trace") or self.trace_path is not None,
            "trace_path",
            f"is required when kind={self.kind!r}",
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


def _trace_error(path: str | Path, line: int, field: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{path}:{line}: {field}: {message}", field=field)


def _lengths_of(path: str | Path, line: int, value: Any, field: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise _trace_error(path, line, field, f"must be a non-empty list of lengths, got {value!r}")
    for i, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise _trace_error(path, line, f"{field}[{i}]", f"must be an integer >= 1, got {x!r}")
    return value


def load_group_trace(path: str | Path) -> list[np.ndarray]:
    """Read a trace of groups: one record (a prompt's response lengths) per group.

    Two formats, by file name: ``.csv`` — a header with the columns ``group`` and ``length``
    and one row per response (rows of a group need not be adjacent; groups keep the order of
    their first row); anything else — JSON lines, each an object ``{"lengths": [n, ...]}``.
    Lengths are integers >= 1. Errors name the line and the field.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidRequest(f"cannot read trace {str(path)!r}: {exc}", field="trace_path") from exc
    groups = _csv_groups(path, text) if str(path).endswith(".csv") else _jsonl_groups(path, text)
    if not groups:
        raise InvalidRequest(f"trace {path} holds no groups", field="trace_path")
    return [np.asarray(g, dtype=np.int64) for g in groups]


def _jsonl_groups(path: str | Path, text: str) -> list[list[int]]:
    groups = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _trace_error(path, lineno, "line", f"not JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise _trace_error(path, lineno, "line", f"must be an object, got {item!r}")
        unknown = sorted(set(item) - {"lengths"})
        if unknown:
            raise _trace_error(path, lineno, unknown[0], "unknown key; allowed: ['lengths']")
        if "lengths" not in item:
            raise _trace_error(path, lineno, "lengths", "missing")
        groups.append(_lengths_of(path, lineno, item["lengths"], "lengths"))
    return groups


def _csv_groups(path: str | Path, text: str) -> list[list[int]]:
    rows = list(csv.reader(text.splitlines()))
    if not rows:
        return []
    header = [h.strip() for h in rows[0]]
    if sorted(header) != ["group", "length"]:
        raise _trace_error(
            path, 1, "header", f"must be the columns 'group' and 'length', got {header}"
        )
    gi, li = header.index("group"), header.index("length")
    groups: dict[str, list[int]] = {}
    for lineno, row in enumerate(rows[1:], 2):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != 2:
            raise _trace_error(path, lineno, "row", f"must have 2 columns, got {len(row)}")
        group, raw = row[gi].strip(), row[li].strip()
        if not group:
            raise _trace_error(path, lineno, "group", "is empty")
        try:
            length = int(raw)
        except ValueError:
            raise _trace_error(
                path, lineno, "length", f"must be an integer >= 1, got {raw!r}"
            ) from None
        if length < 1:
            raise _trace_error(path, lineno, "length", f"must be an integer >= 1, got {length}")
        groups.setdefault(group, []).append(length)
    return list(groups.values())


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    cdf: np.ndarray = 0.5 * (1.0 + _erf(z / math.sqrt(2.0)))
    return cdf


class LengthSampler:
    """Draws capped, group-correlated response lengths (see the module docstring)."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self._trace = None
        self._groups: list[np.ndarray] | None = None
        if config.kind == "trace":
            assert config.trace_path is not None  # validated by WorkloadConfig
            self._trace = load_trace(config.trace_path)
        elif config.kind == "group_trace":
            assert config.trace_path is not None
            self._groups = load_group_trace(config.trace_path)

    def quantile(self, u: np.ndarray) -> np.ndarray:
        """Uncapped length at probability ``u`` in (0, 1) (float array).

        For a group trace: the quantile of all its lengths pooled.
        """
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
        if self._trace is None:
            assert self._groups is not None
            self._trace = np.sort(np.concatenate(self._groups))
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
        if self._groups is not None:
            return self._trace_groups(rng, num_groups, group_size)
        d = rng.standard_normal((num_groups, 1))
        eps = rng.standard_normal((num_groups, group_size))
        rho = c.group_correlation
        z = math.sqrt(rho) * d + math.sqrt(1.0 - rho) * eps
        raw = self.quantile(_normal_cdf(z))
        lengths: np.ndarray = np.clip(np.rint(raw), c.min_length, c.max_length).astype(np.int64)
        return lengths

    def _trace_groups(
        self, rng: np.random.Generator, num_groups: int, group_size: int
    ) -> np.ndarray:
        assert self._groups is not None
        c = self.config
        out = np.empty((num_groups, group_size), dtype=np.int64)
        for g, pick in enumerate(rng.integers(len(self._groups), size=num_groups)):
            record = self._groups[int(pick)]
            if len(record) >= group_size:
                out[g] = rng.choice(record, size=group_size, replace=False)
            else:
                out[g] = rng.choice(record, size=group_size, replace=True)
        clipped: np.ndarray = np.clip(out, c.min_length, c.max_length)
        return clipped

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
