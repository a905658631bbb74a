"""`staleflow simulate` and `staleflow compare` end to end on the tiny example config."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from staleflow_trainer.cli import main
from staleflow_trainer.report.compare import markdown_table
from staleflow_trainer.report.metrics import REQUIRED_KEYS, read_jsonl

pytestmark = pytest.mark.sim

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_simulate_writes_the_metrics_contract(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rc = main(
        ["--log-level", "warning", "simulate", str(EXAMPLES / "sim-tiny.yaml"),
         f"run_dir={run}", "trainer.steps=6", "metrics.tensorboard=false"]
    )  # fmt: skip
    assert rc == 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:
        assert set(REQUIRED_KEYS) <= set(r)
        assert r["max_staleness"] <= 2  # sim-tiny: eta 2
        assert {"staleness_hist", "instance_busy_frac", "syncs", "migrations", "interrupts",
                "queue_depth", "time_s"} <= set(r)  # fmt: skip
    timeline = read_jsonl(run / "timeline.jsonl")
    assert timeline and {t["state"] for t in timeline} <= {"busy", "syncing", "idle"}
    assert all(t["end_s"] >= t["start_s"] for t in timeline)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["ledger"]["consumed"] == 6 * 8 * 4
    assert (run / "config.yaml").is_file()
    assert (run / "plots" / "timeline.png").is_file()


def test_compare_writes_its_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "cmp"
    rc = main(
        ["--log-level", "warning", "compare", str(EXAMPLES / "sim-tiny.yaml"), f"run_dir={run}",
         "trainer.steps=3", "sim.warmup_steps=1", "--policies", "staleflow,sync"]
    )  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out  # stdout is not a terminal: a line per finished run
    assert [ln.split()[1] for ln in out.splitlines() if ln.startswith("simulations ")] == [
        f"{i}/8" for i in range(1, 9)
    ]  # fmt: skip  (4 runs x 2 seeds)
    report = json.loads((run / "compare.json").read_text())
    assert report["ideal_tokens_per_s"] > 0
    keys = {"policy", "eta", "tokens_per_s", "mean_step_s", "trainer_idle_frac",
            "rollout_busy_frac", "max_staleness"}  # fmt: skip
    runs = {(r["policy"], r["eta"]) for r in report["results"]}
    assert runs == {("sync", 0), ("staleflow", 1), ("staleflow", 2), ("staleflow", 3)}
    for r in report["results"]:
        assert keys <= set(r)
        assert r["max_staleness"] <= r["eta"]
    assert set(report["ratios"]) == {"eta=1", "eta=2", "eta=3"}
    assert set(report["ratios"]["eta=3"]) == {"sync"}
    # two seeds by default, every (policy, eta) once per seed, summarized as mean and spread
    assert report["protocol"]["seeds"] == [0, 1]
    assert report["protocol"]["measured_steps"] == 2
    assert report["protocol"]["steady_state"] is False  # 2 measured steps: the table says so
    assert {(r["seed"], r["policy"], r["eta"]) for r in report["results"]} == {
        (seed, p, e) for seed in (0, 1) for p, e in runs
    }
    summary = {(r["policy"], r["eta"]): r for r in report["summary"]}
    sf3, sync = summary[("staleflow", 3)], summary[("sync", 0)]
    per_seed = [
        r["tokens_per_s"] for r in report["results"] if (r["policy"], r["eta"]) == ("staleflow", 3)
    ]
    assert sf3["tokens_per_s"]["mean"] == pytest.approx(sum(per_seed) / 2)
    assert sf3["tokens_per_s"]["min"] == min(per_seed) and sf3["samples_per_s"]["mean"] > 0
    assert report["ratios"]["eta=3"]["sync"] == pytest.approx(
        sf3["tokens_per_s"]["mean"] / sync["tokens_per_s"]["mean"]
    )
    spread = report["ratio_spread"]["eta=3"]["sync"]
    assert spread["min"] <= report["ratios"]["eta=3"]["sync"] * 1.0001
    # the latency-aware bound per eta, never above the roofline; the side that binds named
    assert set(report["bounds"]) == {"eta=0", "eta=1", "eta=2", "eta=3"}
    for key, b in report["bounds"].items():
        assert b["latency_bound_side"] in ("train", "rollout", "latency"), key
        if key != "eta=0":
            assert b["latency_bound_tokens_per_s"] <= report["ideal_tokens_per_s"] * 1.05
    assert sf3["frac_of_bound"] == pytest.approx(
        sf3["tokens_per_s"]["mean"] / report["bounds"]["eta=3"]["latency_bound_tokens_per_s"]
    )
    table = (run / "results" / "compare.md").read_text()
    assert "NOT a steady-state measurement" in table and "Latency-aware bound" in table
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ")]
    assert "prefill" in rows[0] and {len(r) for r in rows} == {len(rows[0])}  # every column
    # a run above the steady-step bound is explained under the table, and only then
    above = any((r["frac_of_bound"] or 0.0) > 1.0 for r in report["summary"])
    assert ("Above 100 % of the bound" in table) == above
    report["summary"][0]["frac_of_bound"] = 1.2
    assert "Above 100 % of the bound" in markdown_table(report)
    for r in report["summary"]:
        r["frac_of_bound"] = None if r["frac_of_bound"] is None else 0.9
    assert "Above 100 % of the bound" not in markdown_table(report)
    assert report["split"]["rollout_gpus"] == 4
    for name in ("compare.md", "throughput.png", "staleness.png", "timelines.png"):
        assert (run / "results" / name).is_file()


def test_simulate_to_a_file_prints_a_line_per_step(tmp_path: Path) -> None:
    """stdout redirected (a cluster job): one plain line per step, even with the bar on, and
    throughput that never reads 0 for a step that trained a batch."""
    import subprocess
    import sys

    run = tmp_path / "run"
    log = tmp_path / "run.log"
    with log.open("w") as fh:
        done = subprocess.run(
            [sys.executable, "-m", "staleflow_trainer.cli", "simulate",
             str(EXAMPLES / "sim-tiny.yaml"), f"run_dir={run}", "trainer.steps=8",
             "metrics.progress_bar=true", "metrics.log_every=1"],
            stdout=fh, stderr=subprocess.PIPE, text=True, timeout=300,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = log.read_text().splitlines()
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == [f"{i}/8" for i in range(1, 9)]
    assert all("trained" in ln and "generated" in ln and "tok/s" in ln for ln in steps)
    assert not any("\x1b[" in ln for ln in lines)  # no terminal escapes in the file
    # stderr: a few key=value log lines, no per-cycle chatter, no float noise, no warnings
    err = done.stderr.splitlines()
    assert len(err) <= 3, err
    assert not any(" cycle " in ln or re.search(r"\d\.\d{8,}", ln) for ln in err), err
    assert not any("warn" in ln.lower() for ln in err), err
    assert any(ln.startswith("simulated 8 steps") for ln in lines)
    rows = read_jsonl(run / "metrics.jsonl")
    assert len(rows) == 8
    for r in rows:
        assert r["tokens"] > 0 and r["samples"] > 0
        rates = {k: v for k, v in r.items() if k.endswith("tokens_per_s")}
        assert set(rates) == {"tokens_per_s", "gen_tokens_per_s"}
        assert all(v > 0 for v in rates.values()), (r["step"], rates)
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_s"])
        assert not any(k.startswith("level_") or k == "None" for k in r["queue_depth"])
