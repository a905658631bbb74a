"""The two throughput bounds of a split: the roofline ideal and the latency-aware bound."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from staleflow_trainer.config import load_config
from staleflow_trainer.sim.ideal import ideal_throughput, latency_bound, workload_moments
from staleflow_trainer.sim.spec import SimSpec, spec_from_app_config, with_policy

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _paper(eta: int = 3, *over: str) -> SimSpec:
    cfg = load_config(EXAMPLES / "sim-paper-30b-a3b.yaml", list(over))
    return spec_from_app_config(with_policy(cfg, "staleflow", eta))


@pytest.mark.parametrize("eta", [0, 1, 2, 3, 5])
def test_latency_bound_never_exceeds_the_roofline_ideal(eta: int) -> None:
    spec = _paper(max(eta, 1))
    ideal = ideal_throughput(spec, workload_moments(spec, 512))["ideal_tokens_per_s"]
    b = latency_bound(spec, eta, groups=512)
    assert 0 < b["latency_bound_tokens_per_s"] <= ideal * 1.0001
    assert b["latency_bound_step_s"] >= b["train_floor_step_s"]
    assert b["latency_bound_side"] in ("train", "latency", "rollout")


def test_latency_bound_grows_with_eta_and_names_the_side() -> None:
    spec = _paper()
    rows = [latency_bound(spec, eta, groups=512) for eta in (0, 1, 2, 3, 5, 50)]
    tps = [r["latency_bound_tokens_per_s"] for r in rows]
    assert tps == sorted(tps)  # a wider window never hurts
    assert rows[-1]["latency_bound_side"] in ("train", "rollout")  # the tail no longer binds
    # a trainer ten times faster leaves the rollout side (tail or throughput) to bind
    fast = attrs.evolve(spec, trainer_model="linear", trainer_time_a_s=1.0)
    fast = attrs.evolve(fast, trainer_time_b_s_per_token=1e-7)
    assert latency_bound(fast, 3, groups=512)["latency_bound_side"] in ("latency", "rollout")


def test_a_tail_beyond_the_window_binds_on_latency() -> None:
    """One token a step at the cost model's floor: a 20K-token response needs >= 20K x tau(1)
    seconds, so at eta = 1 and a fast trainer the step time is set by the tail."""
    spec = attrs.evolve(_paper(1), trainer_model="linear", trainer_time_a_s=1.0)
    spec = attrs.evolve(spec, trainer_time_b_s_per_token=1e-7)
    b = latency_bound(spec, 1, groups=512)
    floor = spec.engine.cost.step_latency(1, 0) * spec.max_response_len
    assert b["latency_bound_side"] == "latency"
    assert b["latency_bound_step_s"] >= floor * 0.5  # the capped responses' window: eta x S


@pytest.mark.parametrize(
    ("preset", "sides", "kv"),
    [
        ("sim-paper-30b-a3b.yaml", {1: "train", 3: "train"}, 274_736),
        ("sim-paper-30b-a3b-40k.yaml", {1: "latency", 3: "train"}, 274_736),
        (
            "sim-paper-30b-a3b-rollout-bound.yaml",
            {1: "latency", 2: "rollout", 3: "rollout"},
            274_736,
        ),
        ("sim-paper-7b.yaml", {1: "latency", 3: "latency"}, 1_270_363),
        ("sim-paper-14b.yaml", {1: "latency", 3: "rollout"}, 298_399),
    ],
)
def test_paper_presets_bind_where_their_headers_say(
    preset: str, sides: dict[int, str], kv: int
) -> None:
    cfg = load_config(EXAMPLES / preset, [])
    assert cfg.sim.kv_capacity_tokens is None  # KV from the model's geometry
    for eta, side in sides.items():
        spec = spec_from_app_config(with_policy(cfg, "staleflow", eta))
        assert spec.kv_capacity_tokens == kv
        assert latency_bound(spec, eta, groups=512)["latency_bound_side"] == side, eta


def test_the_rollout_side_binds_where_the_window_adds_nothing() -> None:
    """A quarter of the paper's rollout instances against its trainer: from eta = 2 the window
    holds every length at full concurrency, so the instances' throughput sets the step (no
    wider window shortens it) and the side is named ``rollout``, not ``latency``."""
    cfg = load_config(EXAMPLES / "sim-paper-30b-a3b-rollout-bound.yaml", [])
    spec = spec_from_app_config(with_policy(cfg, "staleflow", 3))
    roof = ideal_throughput(spec, workload_moments(spec, 512))
    assert roof["bound"] == "rollout"
    wide = latency_bound(spec, 50, groups=512)
    assert wide["latency_bound_side"] == "rollout"
    for eta in (2, 3, 5):
        b = latency_bound(spec, eta, groups=512)
        assert b["latency_bound_side"] == "rollout", eta
        assert b["latency_bound_step_s"] == pytest.approx(wide["latency_bound_step_s"])
        assert b["latency_bound_step_s"] > b["train_floor_step_s"]
    one = latency_bound(spec, 1, groups=512)  # one step's window is too short for the tail
    assert one["latency_bound_side"] == "latency"
    assert one["latency_bound_step_s"] > wide["latency_bound_step_s"]


def _rollout_bound(*over: str) -> SimSpec:
    cfg = load_config(EXAMPLES / "sim-paper-30b-a3b-rollout-bound.yaml", list(over))
    return spec_from_app_config(with_policy(cfg, "staleflow", 3))


@pytest.mark.parametrize("eta", [1, 3])
def test_the_bound_counts_each_prompts_first_prefill(eta: int) -> None:
    """Where the rollout side binds, every prompt's prefill takes instance time: without it
    the bound is the per-length accounting alone; a dearer prefill lowers it, by about the
    prefill's share of an instance's time."""
    free = latency_bound(
        _rollout_bound("sim.prefill_s_per_token=0", "sim.prefill_s_per_token_position=0"),
        eta,
        groups=512,
    )
    spec = _rollout_bound()
    paid = latency_bound(spec, eta, groups=512)
    dear = latency_bound(_rollout_bound("sim.prefill_s_per_token=1e-3"), eta, groups=512)
    assert free["latency_bound_side"] in ("latency", "rollout")
    tps = [b["latency_bound_tokens_per_s"] for b in (free, paid, dear)]
    assert tps[0] > tps[1] > tps[2]
    # 1 ms a prompt token: a 574-token prompt takes 0.57 s, and 46 running trajectories of 5 877
    # tokens put 46 x 0.57 / 5 877 = 4.5 ms of prefill on each 36 ms step: 11 % of the time
    assert 0.80 < tps[2] / tps[0] < 0.95


def test_the_first_prefill_leaves_a_trainer_bound_alone() -> None:
    spec = _paper(3)
    dear = _paper(3, "sim.prefill_s_per_token=1e-3")
    a, b = latency_bound(spec, 3, groups=512), latency_bound(dear, 3, groups=512)
    assert a["latency_bound_side"] == b["latency_bound_side"] == "train"
    assert a["latency_bound_tokens_per_s"] == b["latency_bound_tokens_per_s"]
