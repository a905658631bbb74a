"""Cost model: the τ formula, presets, JSON round-trip, bad coefficients, error knobs."""

from __future__ import annotations

import json

import pytest

from engine_adapters.cost_model import (
    PRESETS,
    QWEN3_30B_A3B_H20,
    QWEN_7B_H20,
    QWEN_14B_H20,
    CostModel,
    mean_abs_pct_error,
)
from engine_adapters.errors import CostModelError, InvalidRequest


def test_presets_match_design_numbers():
    assert set(PRESETS) == {"qwen3-30b-a3b-h20", "qwen-7b-h20", "qwen-14b-h20"}
    m = QWEN3_30B_A3B_H20
    assert (m.k2, m.b, m.k3, m.k4, m.k1) == (0.01151, 0.00979, 1.249e-4, 8.67e-4, 7.28e-8)
    assert (QWEN_7B_H20.k2, QWEN_7B_H20.b, QWEN_7B_H20.k4) == (0.0064, 0.0027, 0.0028)
    assert (QWEN_14B_H20.k3, QWEN_14B_H20.k1) == (2.441e-4, 1.165e-7)


def test_tau_and_throughput_by_hand():
    m = CostModel(k1=1e-6, k2=0.01, k3=0.001, k4=0.002, b=0.004)
    # n=2: max(0.01, 0.004+0.002)=0.01 -> flat region
    assert m.step_latency(2, 1000) == pytest.approx(0.002 + 0.001 + 0.01)
    # n=20: max(0.01, 0.004+0.02)=0.024 -> linear region
    assert m.step_latency(20, 0) == pytest.approx(0.002 + 0.024)
    assert m.throughput(20, 0) == pytest.approx(20 / 0.026)
    assert m.throughput(0, 500) == 0.0
    g = m.marginal_gain(20, 0, 100)
    assert g == pytest.approx(21 / (0.002 + 1e-4 + 0.025) - 20 / 0.026)
    assert m.empty_gain(100) == pytest.approx(m.marginal_gain(0, 0, 100))


def test_gain_shrinks_with_load():
    m = QWEN3_30B_A3B_H20
    gains = [m.marginal_gain(n, n * 2000, 2000) for n in (16, 32, 64, 128)]
    assert gains == sorted(gains, reverse=True)


def test_json_round_trip(tmp_path):
    p = tmp_path / "cm.json"
    QWEN_14B_H20.save(p, mape=0.1)
    assert CostModel.load(p) == QWEN_14B_H20
    assert json.loads(p.read_text())["format"] == "staleflow-cost-model/1"
    assert CostModel.preset("qwen-7b-h20") is QWEN_7B_H20


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"k1": -1, "k2": 0.01, "k3": 0.0, "k4": 0.0}, "k1"),
        ({"k1": 0, "k2": float("inf"), "k3": 0.0, "k4": 0.0}, "k2"),
        ({"k1": 0, "k2": 0.01, "k4": 0.0}, "k3"),
        ({"k1": 0, "k2": 0.01, "k3": 0, "k4": 0, "zz": 1}, "zz"),
        ({"k1": 0, "k2": 0.0, "k3": 0.1, "k4": 0.0, "b": 0.0}, "k4"),
        ({"format": "other/2", "k1": 0, "k2": 0.01, "k3": 0, "k4": 0}, "format"),
        ({"k1": "0.1", "k2": 0.01, "k3": 0, "k4": 0}, "k1"),
        ({"k1": True, "k2": 0.01, "k3": 0, "k4": 0}, "k1"),
    ],
)
def test_bad_coefficients(data, field):
    with pytest.raises(CostModelError) as ei:
        CostModel.from_dict(data)
    assert ei.value.field == field


def test_unreadable_file(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(CostModelError, match="cannot read"):
        CostModel.load(p)
    with pytest.raises(CostModelError, match="unknown cost-model preset"):
        CostModel.preset("gpt-9")


def test_errors_are_bad_input_of_the_engine_package():
    assert issubclass(CostModelError, InvalidRequest)


def test_resolve_accepts_a_model_a_preset_a_file_or_a_mapping(tmp_path):
    p = tmp_path / "fit.json"
    QWEN_7B_H20.save(p)
    assert CostModel.resolve(QWEN_14B_H20) is QWEN_14B_H20
    assert CostModel.resolve("qwen-7b-h20") is QWEN_7B_H20
    assert CostModel.resolve(str(p)) == QWEN_7B_H20
    assert CostModel.resolve({"k1": 0, "k2": 0.01, "k3": 0, "k4": 0}).k2 == 0.01
    with pytest.raises(CostModelError, match="unknown cost-model preset"):
        CostModel.resolve("fast")


def test_scaled_is_a_uniformly_faster_or_slower_instance():
    m = QWEN3_30B_A3B_H20
    half = m.scaled(0.5)
    for n, kv in [(1, 0), (64, 100_000), (200, 250_000)]:
        assert half.step_latency(n, kv) == pytest.approx(m.step_latency(n, kv) / 2)
        assert half.throughput(n, kv) == pytest.approx(2 * m.throughput(n, kv))
    with pytest.raises(CostModelError):
        m.scaled(0.0)


def test_with_errors_and_the_measured_error():
    m = QWEN3_30B_A3B_H20
    grid = [(n, n * 3000) for n in (8, 32, 64, 128, 200)]
    assert mean_abs_pct_error(m, m, grid) == 0.0
    believed = m.with_errors({"k3": 1.2, "k1": 0.9}, name="fitted")
    assert believed.name == "fitted"
    assert (believed.k3, believed.k1, believed.k2) == (m.k3 * 1.2, m.k1 * 0.9, m.k2)
    err = mean_abs_pct_error(m, believed, grid)
    assert 0.0 < err < 0.2
    # a uniform +10 % error is exactly 10 % everywhere
    assert mean_abs_pct_error(m, m.scaled(1.1), grid) == pytest.approx(0.1)
    with pytest.raises(CostModelError) as ei:
        m.with_errors({"k9": 1.1})
    assert ei.value.field == "k9"
    with pytest.raises(CostModelError) as ei:
        m.with_errors({"k2": -1.0})
    assert ei.value.field == "k2"
    with pytest.raises(CostModelError):
        mean_abs_pct_error(m, believed, [])
