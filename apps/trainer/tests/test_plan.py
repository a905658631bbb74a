"""`staleflow plan`: grid parsing and validation, split rounding, selection, and one small
end-to-end run on examples/sim-tiny.yaml (real simulator, a few seconds)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest

from staleflow_trainer.cli import main
from staleflow_trainer.config import load_config
from staleflow_trainer.errors import ConfigError
from staleflow_trainer.report.plan import (
    DEFAULT_ETAS,
    DEFAULT_FRACTIONS,
    budget_ideal,
    parse_grid,
    plan_configs,
    select,
    splits_for,
)
from staleflow_trainer.sim.ideal import ideal_throughput
from staleflow_trainer.sim.spec import SimSpec, spec_from_app_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _paper() -> SimSpec:
    return spec_from_app_config(load_config(EXAMPLES / "sim-paper-30b-a3b.yaml", []))


# ---- grid parsing ---------------------------------------------------------------------------


def test_parse_grid_defaults_and_sorting() -> None:
    g = parse_grid(policy="staleflow")
    assert g.fractions == DEFAULT_FRACTIONS and g.etas == DEFAULT_ETAS and g.tolerance == 0.05
    g = parse_grid(policy="all-vanilla", fractions="0.75, 0.25", etas="3,1", tolerance="0")
    assert g.policy == "all-vanilla"
    assert g.fractions == (0.25, 0.75) and g.etas == (1, 3) and g.tolerance == 0.0


def test_parse_grid_fixed_eta_policy_gets_its_eta() -> None:
    assert parse_grid(policy="one-step").etas == (1,)
    assert parse_grid(policy="one-step", etas="1").etas == (1,)


@pytest.mark.parametrize(
    ("kwargs", "key", "allowed_part"),
    [
        ({"policy": "sync"}, "--policy", "coarse-async"),
        ({"policy": "nope"}, "--policy", "staleflow"),
        ({"policy": "staleflow", "fractions": "0,0.5"}, "--fractions", "(0, 1)"),
        ({"policy": "staleflow", "fractions": "1"}, "--fractions", "(0, 1)"),
        ({"policy": "staleflow", "fractions": "0.5,abc"}, "--fractions", "(0, 1)"),
        ({"policy": "staleflow", "fractions": "nan"}, "--fractions", "(0, 1)"),
        ({"policy": "staleflow", "fractions": "0.5,0.5"}, "--fractions", "(0, 1)"),
        ({"policy": "staleflow", "etas": "1,-1"}, "--etas", "integers >= 0"),
        ({"policy": "staleflow", "etas": ""}, "--etas", "integers >= 0"),
        ({"policy": "staleflow", "fractions": ""}, "--fractions", "(0, 1)"),
        ({"policy": "staleflow", "etas": "1.5"}, "--etas", "integers >= 0"),
        ({"policy": "one-step", "etas": "2"}, "--etas", "fixed staleness"),
        ({"policy": "staleflow", "tolerance": "1"}, "--tolerance", "[0, 1)"),
        ({"policy": "staleflow", "tolerance": "-0.1"}, "--tolerance", "[0, 1)"),
        ({"policy": "staleflow", "tolerance": "x"}, "--tolerance", "[0, 1)"),
    ],
)
def test_parse_grid_rejects_bad_input(kwargs: dict[str, Any], key: str, allowed_part: str) -> None:
    with pytest.raises(ConfigError) as ei:
        parse_grid(**kwargs)
    assert ei.value.key == key
    assert ei.value.allowed is not None and allowed_part in ei.value.allowed


# ---- splits ---------------------------------------------------------------------------------


def test_splits_round_to_whole_instances() -> None:
    base = _paper()  # 64 GPUs, TP1
    splits = splits_for(base, DEFAULT_FRACTIONS)
    assert [(s.rollout_gpus, s.train_gpus) for s in splits] == [
        (16, 48), (24, 40), (32, 32), (40, 24), (48, 16)
    ]  # fmt: skip
    tp4 = attrs.evolve(base, gpus_per_instance=4)
    splits = splits_for(tp4, (0.3, 0.31, 0.5))
    assert [(s.rollout_gpus, s.fractions) for s in splits] == [(20, (0.3, 0.31)), (32, (0.5,))]
    assert all(s.rollout_gpus % 4 == 0 and s.rollout_gpus + s.train_gpus == 64 for s in splits)


def test_splits_reject_fractions_without_an_instance_or_a_trainer() -> None:
    base = attrs.evolve(_paper(), gpus_per_instance=8)  # 7 instances at most
    with pytest.raises(ConfigError) as ei:
        splits_for(base, (0.05,))  # rounds to 0 instances
    assert ei.value.key == "--fractions"
    with pytest.raises(ConfigError) as ei:
        splits_for(base, (0.99,))  # 8 instances = all 64 GPUs, none left to train
    assert ei.value.key == "--fractions" and "1..7" in str(ei.value)


def test_plan_configs_cover_the_grid() -> None:
    cfg = load_config(EXAMPLES / "sim-paper-30b-a3b.yaml", [])
    grid = parse_grid(policy="coarse-async", fractions="0.25,0.5")
    specs = [spec_from_app_config(c) for c in plan_configs(cfg, grid)]
    got = [(s.policy, s.rollout_gpus, s.train_gpus, s.eta) for s in specs]
    assert got == [
        ("coarse-async", r, 64 - r, e) for r in (16, 32) for e in (1, 2, 3)
    ]  # fmt: skip


def test_budget_ideal_is_the_best_split() -> None:
    base = _paper()
    b = budget_ideal(base)
    assert b["rollout_gpus"] + b["train_gpus"] == 64
    every = [
        ideal_throughput(attrs.evolve(base, rollout_gpus=r, train_gpus=64 - r))[
            "ideal_tokens_per_s"
        ]
        for r in (8, 16, 24, 32, 40, 48, 56)
    ]
    assert b["ideal_tokens_per_s"] >= max(every) - 1e-6
    # the balanced point: rollout and training sides meet near it, neither dominates by 2x
    ratio = b["rollout_side_tokens_per_s"] / b["train_side_tokens_per_s"]
    assert 0.5 < ratio < 2.0


# ---- selection ------------------------------------------------------------------------------


def _row(r: int, eta: int, tps: float, stale: int | None = None) -> dict[str, Any]:
    return {
        "rollout_gpus": r,
        "eta": eta,
        "tokens_per_s": tps,
        "max_staleness": eta if stale is None else stale,
    }


def test_select_fastest_and_recommended() -> None:
    rows = [_row(16, 1, 90.0), _row(32, 1, 97.0), _row(32, 3, 100.0), _row(48, 2, 99.0)]
    fastest, rec = select(rows, 0.05)
    assert fastest is rows[2]
    assert rec is rows[1]  # smallest η within 5 % of the fastest
    fastest, rec = select(rows, 0.0)
    assert fastest is rows[2] and rec is rows[2]
    _, rec = select(rows, 0.02)
    assert rec is rows[3]  # η = 1 is 3 % slower: not worth it at 2 %


def test_select_skips_rows_over_their_bound() -> None:
    rows = [_row(16, 1, 200.0, stale=2), _row(32, 2, 100.0)]
    fastest, rec = select(rows, 0.05)
    assert fastest is rows[1] and rec is rows[1]
    assert select([rows[0]], 0.05) == (None, None)


def test_select_ties_prefer_smaller_eta_then_fewer_rollout_gpus() -> None:
    rows = [_row(48, 2, 100.0), _row(32, 2, 100.0), _row(32, 1, 100.0)]
    fastest, _ = select(rows, 0.0)
    assert fastest is rows[2]
    fastest, _ = select(rows[:2], 0.0)
    assert fastest is rows[1]


# ---- end to end -----------------------------------------------------------------------------


@pytest.mark.sim
def test_plan_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "plan"
    rc = main(
        ["--log-level", "warning", "plan", str(EXAMPLES / "sim-tiny.yaml"), f"run_dir={run}",
         "trainer.steps=4", "sim.warmup_steps=1", "metrics.timeline=false",
         "--fractions", "0.5,0.67", "--etas", "1,2"]
    )  # fmt: skip
    assert rc == 0
    report = json.loads((run / "plan.json").read_text())
    got = {(r["rollout_gpus"], r["train_gpus"], r["eta"]) for r in report["results"]}
    assert got == {(3, 3, 1), (3, 3, 2), (4, 2, 1), (4, 2, 2)}
    for r in report["results"]:
        assert r["policy"] == "staleflow" and r["steps"] == 4
        assert r["tokens_per_s"] > 0 and r["max_staleness"] <= r["eta"]
        assert r["frac_of_ideal"] == pytest.approx(r["tokens_per_s"] / r["ideal_tokens_per_s"])
        assert (run / "runs" / f"staleflow-r{r['rollout_gpus']}-t{r['train_gpus']}-eta{r['eta']}"
                / "summary.json").is_file()  # fmt: skip
    best = max(r["tokens_per_s"] for r in report["results"])
    assert report["fastest"]["tokens_per_s"] == best
    assert report["recommended"] in report["results"]
    assert report["recommended"]["tokens_per_s"] >= 0.95 * best
    assert report["budget_ideal"]["ideal_tokens_per_s"] >= max(
        r["ideal_tokens_per_s"] for r in report["results"]
    )
    assert (run / "results" / "plan.md").is_file() and (run / "results" / "plan.png").is_file()
    assert report["notes"] and "trainer_model=linear" in report["notes"][0]  # sim-tiny is linear
    out = capsys.readouterr().out
    assert "Fastest:" in out and "Recommended" in out


def test_plan_cli_bad_input_exits_2_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "plan"
    rc = main(
        ["plan", str(EXAMPLES / "sim-tiny.yaml"), f"run_dir={run}", "--fractions", "0.5,2"]
    )  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert "--fractions" in err and "(0, 1)" in err
    assert not run.exists()
    rc = main(["plan", str(EXAMPLES / "sim-tiny.yaml"), f"run_dir={run}", "--policy", "sync"])
    assert rc == 2 and "--policy" in capsys.readouterr().err
    # a fraction too small for one instance of sim-tiny's 6 GPUs
    rc = main(["plan", str(EXAMPLES / "sim-tiny.yaml"), f"run_dir={run}", "--fractions", "0.01"])
    assert rc == 2 and "--fractions" in capsys.readouterr().err
    assert not run.exists()
