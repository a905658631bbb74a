"""Cost-model fitting: recover a known model from noisy synthetic profiles; bad profiles."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rollout_coordinator import CostModel, FitError
from rollout_coordinator.cost_model import QWEN3_30B_A3B_H20, QWEN_14B_H20
from rollout_coordinator.fit import fit_cost_model_main, fit_profile, load_profile


def write_profile(path, model, *, noise=0.03, seed=1, m=300):
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for _ in range(m):
            n = int(rng.integers(1, 257))
            kv = int(n * rng.integers(200, 8000))
            tau = model.step_latency(n, kv) * (1 + rng.normal(0, noise))
            f.write(
                json.dumps({"running": n, "kv_tokens": kv, "step_latency_s": tau, "backend": "sim"})
                + "\n"
            )


@pytest.mark.parametrize("truth", [QWEN3_30B_A3B_H20, QWEN_14B_H20])
def test_fit_recovers_known_model(tmp_path, truth):
    p = tmp_path / "prof.jsonl"
    write_profile(p, truth)
    result = fit_profile(load_profile(p), holdout=0.2, seed=0)
    m = result.model
    assert result.mape_test < 0.05
    assert m.k3 == pytest.approx(truth.k3, rel=0.1)
    assert m.k1 == pytest.approx(truth.k1, rel=0.15)
    # k4 is folded into the intercepts: the same τ
    assert m.k2 + m.k4 == pytest.approx(truth.k2 + truth.k4, rel=0.1)
    grid = [(n, n * 3000) for n in (1, 8, 32, 128, 256)]
    for n, kv in grid:
        assert m.step_latency(n, kv) == pytest.approx(truth.step_latency(n, kv), rel=0.05)


def test_noise_is_measured_not_hidden(tmp_path):
    p = tmp_path / "noisy.jsonl"
    write_profile(p, QWEN3_30B_A3B_H20, noise=0.2)
    assert fit_profile(load_profile(p)).mape_test > 0.08


def test_cli_writes_loadable_coefficients(tmp_path, capsys):
    p = tmp_path / "prof.jsonl"
    write_profile(p, QWEN3_30B_A3B_H20)
    out = tmp_path / "cm.json"
    assert fit_cost_model_main([str(p), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "held-out" in printed and "MAPE" in printed
    m = CostModel.load(out)
    assert m.step_latency(64, 64 * 3000) == pytest.approx(
        QWEN3_30B_A3B_H20.step_latency(64, 64 * 3000), rel=0.05
    )
    assert json.loads(out.read_text())["mape"] < 0.05


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        (['{"running": 1, "kv_tokens": 5}'], "step_latency_s"),
        (["not json"], "not JSON"),
        (['{"running": -1, "kv_tokens": 5, "step_latency_s": 0.1}'], "running"),
        (['{"running": 1, "kv_tokens": 5, "step_latency_s": 0}'], "step_latency_s"),
        (['{"running": 1, "kv_tokens": 5, "step_latency_s": 0.1}'] * 3, "at least 6"),
    ],
)
def test_bad_profiles(tmp_path, lines, match):
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(FitError, match=match):
        load_profile(p)
    assert fit_cost_model_main([str(p)]) == 2


def test_a_profile_whose_free_fit_has_a_negative_intercept_still_fits_non_negative():
    """A linear regime whose best free line has a negative intercept (what a noisy CPU
    profile produces): the fit must pin that intercept at 0 and re-solve, not fail."""
    from rollout_coordinator.fit import fit_records, mape

    rng = np.random.default_rng(0)
    n = rng.integers(1, 64, size=300).astype(float)
    kv = rng.uniform(1e3, 1e5, size=300)
    linear = -0.001 + 2e-4 * n  # negative intercept, positive for n >= 9
    tau = np.maximum(0.003, linear) + 1e-8 * kv + 1e-5 * rng.standard_normal(300)
    data = np.stack([n, kv, tau], axis=1)
    lin = n > 15
    free, *_ = np.linalg.lstsq(
        np.stack([np.ones(lin.sum()), n[lin], kv[lin]], axis=1), tau[lin], rcond=None
    )
    assert free[0] < 0  # the unconstrained intercept of the linear regime really is negative
    model = fit_records(data)
    assert min(model.k1, model.k2, model.k3, model.b, model.k4) >= 0
    assert mape(model, data) < 0.1
