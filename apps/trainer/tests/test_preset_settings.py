"""A paper preset's coordinator settings reach every run ``staleflow compare`` (and so
``benchmarks/bench_sim_matrix.py``) builds from it: staleflow, each ablation and each baseline
run with the same value of every strategy field it reads (``Policy.reads``); only the policy
(and η) differs. A field a policy does not read is left out of its run (it would change
nothing, and the config refuses it for a single run)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from rollout_coordinator.policies import build_policy
from staleflow_trainer.config import POLICIES, load_config
from staleflow_trainer.control.config import core_config
from staleflow_trainer.report.compare import plan_runs

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
PRESETS = [
    "sim-paper-30b-a3b.yaml",
    "sim-paper-30b-a3b-40k.yaml",
    "sim-paper-30b-a3b-rollout-bound.yaml",
    "sim-paper-7b.yaml",
    "sim-paper-14b.yaml",
]


def _strategy(cfg: object) -> dict[str, object]:
    fields = attrs.asdict(core_config(cfg, rows=None).coordinator, recurse=False)
    fields.pop("policy")
    return fields


@pytest.mark.parametrize("name", PRESETS)
def test_every_policy_of_a_comparison_runs_the_presets_coordinator_settings(name: str) -> None:
    base = load_config(EXAMPLES / name, [])
    runs = plan_runs(base, None, (1, 3))
    assert {c.coordinator.policy for c in runs} == set(POLICIES)
    want = _strategy(base)
    # what a policy does not read is the profile's (the preset's own value is left out)
    profile = _strategy(
        base.evolve(*(f"coordinator.{f}=null" for f in base.coordinator.strategy_overrides()))
    )
    for c in runs:
        got = _strategy(c)
        if c.coordinator.policy == "verl-async":  # η sizes its window (its FIFO keeps none)
            assert got["verl_staleness_threshold"] == float(c.protocol.eta)
            got["verl_staleness_threshold"] = want["verl_staleness_threshold"]
        reads = {*build_policy(c.coordinator.policy).reads, "cost_model"}
        assert {k: v for k, v in got.items() if k in reads} == {
            k: v for k, v in want.items() if k in reads
        }, f"{c.coordinator.policy} at eta {c.protocol.eta}"
        assert {k: v for k, v in got.items() if k not in reads} == {
            k: v for k, v in profile.items() if k not in reads
        }


#: what each preset sets on top of the paper profile, and how to unset it
_UNSET = {
    "theta_slack": "off",
    "due_first": "false",
    "route_kv_limit": "null",
    "sync_load_threshold": "off",
    "due_spread_ratio": "off",
    "due_spread_max_running": "null",
    "due_placement": "gain",
}
OWN = {
    "sim-paper-30b-a3b.yaml": {"sync_load_threshold": 0.5},
    "sim-paper-30b-a3b-40k.yaml": {"sync_load_threshold": 0.5},
    "sim-paper-30b-a3b-rollout-bound.yaml": {
        "theta_slack": 0.15,
        "due_first": True,
        "route_kv_limit": 0.9,
        "sync_load_threshold": 0.5,
    },
    "sim-paper-7b.yaml": {"theta_slack": 0.15, "due_first": True, "sync_load_threshold": 0.5},
    "sim-paper-14b.yaml": {
        "sync_load_threshold": 0.5,
        "due_spread_ratio": 2.5,
        "due_spread_max_running": 12,
        "due_placement": "headroom",
    },
}


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_sets_its_own_settings_on_the_paper_profile(name: str) -> None:
    own = OWN[name]
    base = load_config(EXAMPLES / name, [])
    paper = load_config(EXAMPLES / name, [f"coordinator.{k}={_UNSET[k]}" for k in own])
    got, profile = _strategy(base), _strategy(paper)
    for key, value in own.items():
        assert got.pop(key) == value
        assert profile.pop(key) != value  # the paper profile's differs
    assert got == profile  # every other field is the profile's


@pytest.mark.parametrize("raw", ["off", '"off"'])
def test_preemption_rule_off_reaches_the_coordinator_as_off(raw: str) -> None:
    # "off" is a preemption rule of its own (the package's value), not "unset the field" as
    # for theta_slack; YAML 1.1 reads the unquoted word as false.
    cfg = load_config(
        EXAMPLES / "sim-paper-30b-a3b-rollout-bound.yaml", [f"coordinator.preemption_rule={raw}"]
    )
    assert _strategy(cfg)["preemption_rule"] == "off"
    assert (
        _strategy(load_config(EXAMPLES / "sim-paper-30b-a3b-rollout-bound.yaml", []))[
            "preemption_rule"
        ]
        == "abort"
    )
