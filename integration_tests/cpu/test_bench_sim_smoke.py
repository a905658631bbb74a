"""``benchmarks/bench_sim_matrix.py --smoke`` runs every preset's comparison through the same
code path as the full matrix, exits 0 and writes its report with every bar evaluated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_sim_matrix.py"

pytestmark = pytest.mark.sim


def test_bench_sim_matrix_smoke_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "matrix"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--out-dir", str(out), "--seeds", "0,1",
         "--policies", "staleflow,all-vanilla,verl-async,coarse-async-drop,sync,one-step"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=BENCH.parents[1],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((out / "sim_matrix.json").read_text())
    assert res["smoke"] is True
    assert res["presets"] == [
        "sim-paper-30b-a3b", "sim-paper-30b-a3b-40k", "sim-paper-30b-a3b-rollout-bound",
        "sim-paper-7b", "sim-paper-14b",
    ]  # fmt: skip
    for rep in res["reports"].values():
        assert rep["protocol"]["seeds"] == [0, 1]
        assert {(r["policy"], r["eta"]) for r in rep["summary"]} >= {
            ("staleflow", 1), ("staleflow", 3), ("verl-async", 3), ("sync", 0), ("one-step", 1)
        }  # fmt: skip
        assert set(rep["bounds"]) == {"eta=0", "eta=1", "eta=3"}
    assert set(res["bars"]) == {
        "never_loses", "vs_strict_async", "vs_all_vanilla", "vs_sync", "of_bound", "matrix_time"
    }  # fmt: skip
    verdicts = {True: "PASS ", False: "MISS ", None: "NOT MEASURED "}
    for key, bar in res["bars"].items():
        assert f"{verdicts[bar['holds']]}{key}:" in proc.stdout
    # the smoke runs sync, one-step and staleflow: those bars are measured, not skipped
    assert res["bars"]["vs_sync"]["holds"] is not None
    assert res["bars"]["never_loses"]["holds"] is not None
    # each ratio bar carries its cap (staleflow at its bound); the smoke computes the bounds
    caps = res["bars"]["vs_sync"]["cap_per_preset"]
    assert set(caps) == set(res["presets"])
    assert res["bars"]["vs_sync"]["reachable"] is not None
    assert "cap meets the target" in proc.stdout
    # a smoke (or partial) matrix says nothing about the full matrix's time
    assert res["bars"]["matrix_time"]["holds"] is None
    assert res["bars"]["matrix_time"]["wall_s"] > 0
    assert (out / "sim_matrix.md").is_file()
