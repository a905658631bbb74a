"""Fit the cost model to engine profile records; the ``staleflow fit-cost-model`` command.

Input: JSON lines, one profile record each, with at least ``running`` (n), ``kv_tokens`` (kv)
and ``step_latency_s`` (τ) — what ``EngineAdapter.profile`` returns as ``ProfilePoint``s.
Other keys (``backend``, ...) are ignored.

Method (joint least squares over a knee search). ``k4 + max(k2, b + k3·n)`` equals
``max(k4 + k2, k4 + b + k3·n)``, so only the sums are identifiable from step latencies: the fit
reports ``k4 = 0`` with the sums folded into ``k2`` and ``b`` — the same τ everywhere. For each
candidate knee (each distinct ``n``, plus "all flat" and "all linear") the records split into
a flat regime (``τ = c_flat + k1·kv``) and a linear one (``τ = c_lin + k3·n + k1·kv``) with a
shared ``k1``; one linear least-squares solve per knee, the knee with the smallest squared
error wins. Coefficients must be ≥ 0: a negative ``k1``, ``k3`` or intercept is fixed at 0 and
the rest re-solved (never clamped after the fact), so noisy profiles still give a usable fit. A held-out fraction of the records is scored by the
mean absolute percentage error (MAPE).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs
import numpy as np

from rollout_coordinator.cost_model import CostModel
from rollout_coordinator.errors import CostModelError, FitError

_MIN_RECORDS = 6


@attrs.frozen(kw_only=True)
class FitResult:
    model: CostModel
    train_records: int
    test_records: int
    mape_train: float
    mape_test: float


def load_profile(path: str | Path) -> np.ndarray:
    """Records as an (m, 3) array of (running, kv_tokens, step_latency_s)."""
    rows: list[tuple[float, float, float]] = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise FitError(f"cannot read profile {str(path)!r}: {exc}") from exc
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise FitError(f"not JSON: {exc}", line=lineno) from exc
        if not isinstance(rec, dict):
            raise FitError("a profile record is a JSON object", line=lineno)
        try:
            n, kv, tau = rec["running"], rec["kv_tokens"], rec["step_latency_s"]
        except KeyError as exc:
            raise FitError(
                f"record lacks {exc.args[0]!r} (needs running, kv_tokens, step_latency_s)",
                line=lineno,
            ) from None
        for name, value in (("running", n), ("kv_tokens", kv)):
            if not isinstance(value, int | float) or value < 0:
                raise FitError(f"{name} must be a number >= 0, got {value!r}", line=lineno)
        if not isinstance(tau, int | float) or not tau > 0:
            raise FitError(f"step_latency_s must be a number > 0, got {tau!r}", line=lineno)
        rows.append((float(n), float(kv), float(tau)))
    if len(rows) < _MIN_RECORDS:
        raise FitError(f"need at least {_MIN_RECORDS} profile records, got {len(rows)}")
    return np.asarray(rows, dtype=float)


def _solve(
    n: np.ndarray, kv: np.ndarray, y: np.ndarray, flat: np.ndarray
) -> tuple[float, np.ndarray]:
    """Least squares for one knee; returns (SSE, [c_flat, c_lin, k3, k1]), all >= 0."""
    lin = ~flat
    cols = [flat.astype(float), lin.astype(float), np.where(lin, n, 0.0), kv]
    active = [i for i in range(4) if np.any(cols[i])]
    coef = np.zeros(4)
    for _ in range(5):
        a = np.stack([cols[i] for i in active], axis=1)
        sol, *_ = np.linalg.lstsq(a, y, rcond=None)
        coef[:] = 0.0
        coef[active] = sol
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            break
        active = [i for i in active if i not in negative]
    resid = y - sum(coef[i] * cols[i] for i in range(4))
    return float(resid @ resid), coef


def fit_records(data: np.ndarray, *, name: str = "fitted") -> CostModel:
    n, kv, y = data[:, 0], data[:, 1], data[:, 2]
    knees = [-1.0, *sorted(set(n.tolist()))]  # -1: all linear; max(n): all flat
    best: tuple[float, np.ndarray, float] | None = None
    for knee in knees:
        sse, coef = _solve(n, kv, y, n <= knee)
        if best is None or sse < best[0] - 1e-18:
            best = (sse, coef, knee)
    assert best is not None
    _, (c_flat, c_lin, k3, k1), _knee = best
    if np.all(n <= _knee):  # all flat: the linear branch never wins in the data
        c_lin, k3 = 0.0, 0.0
    if np.all(n > _knee):  # all linear: the flat floor never binds
        c_flat = 0.0
    if c_flat < 0 or c_lin < 0:
        raise FitError(
            f"fit gave a negative intercept (flat {c_flat:.3g}, linear {c_lin:.3g}): the profile "
            "does not look like τ = k4 + k1·kv + max(k2, b + k3·n); profile more (n, kv) points"
        )
    try:
        return CostModel(
            k1=float(k1), k2=float(c_flat), k3=float(k3), k4=0.0, b=float(c_lin), name=name
        )
    except CostModelError as exc:
        raise FitError(f"fitted coefficients are unusable: {exc}") from exc


def mape(model: CostModel, data: np.ndarray) -> float:
    pred = np.array([model.step_latency(int(r[0]), r[1]) for r in data])
    return float(np.mean(np.abs(pred - data[:, 2]) / data[:, 2]))


def fit_profile(
    data: np.ndarray, *, holdout: float = 0.2, seed: int = 0, name: str = "fitted"
) -> FitResult:
    if not 0.0 < holdout < 1.0:
        raise FitError(f"holdout must be in (0, 1), got {holdout!r}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(data))
    n_test = max(1, round(len(data) * holdout))
    test, train = data[order[:n_test]], data[order[n_test:]]
    if len(train) < _MIN_RECORDS:
        raise FitError(
            f"only {len(train)} training records after holding out {n_test}; need {_MIN_RECORDS}"
        )
    model = fit_records(train, name=name)
    return FitResult(
        model=model,
        train_records=len(train),
        test_records=len(test),
        mape_train=mape(model, train),
        mape_test=mape(model, test),
    )


def fit_cost_model_main(argv: Sequence[str] | None = None) -> int:
    """``staleflow fit-cost-model PROFILE.jsonl [-o OUT.json] [--holdout F] [--seed S]``."""
    parser = argparse.ArgumentParser(
        prog="staleflow fit-cost-model",
        description="Fit τ(n, kv) = k4 + k1·kv + max(k2, b + k3·n) to engine profile records.",
    )
    parser.add_argument("profile", help="JSON lines with running, kv_tokens, step_latency_s")
    parser.add_argument(
        "-o", "--out", help="coefficient JSON to write (default: PROFILE.cost.json)"
    )
    parser.add_argument(
        "--holdout", type=float, default=0.2, help="fraction held out for MAPE (0.2)"
    )
    parser.add_argument("--seed", type=int, default=0, help="split seed (0)")
    parser.add_argument("--name", default=None, help="model name stored in the file")
    args = parser.parse_args(argv)
    profile = Path(args.profile)
    out = Path(args.out) if args.out else profile.with_suffix(".cost.json")
    try:
        data = load_profile(profile)
        result = fit_profile(
            data, holdout=args.holdout, seed=args.seed, name=args.name or profile.stem
        )
    except FitError as exc:
        print(f"fit-cost-model: error: {exc}", file=sys.stderr)
        return 2
    m = result.model
    result.model.save(out, mape=result.mape_test, records=len(data))
    print(f"records: {result.train_records} fit, {result.test_records} held out")
    print(f"k1={m.k1:.4g}  k2={m.k2:.4g}  b={m.b:.4g}  k3={m.k3:.4g}  k4={m.k4:.4g}")
    print(f"MAPE train: {100 * result.mape_train:.2f}%  held-out: {100 * result.mape_test:.2f}%")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(fit_cost_model_main())
