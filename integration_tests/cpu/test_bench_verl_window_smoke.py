"""``benchmarks/bench_verl_window.py --smoke`` runs staleflow and verl-async's windows on every
preset through ``staleflow simulate``'s code path, exits 0 and writes its report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_verl_window.py"

pytestmark = pytest.mark.sim


def test_bench_verl_window_smoke_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "vw"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--out-dir", str(out), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=BENCH.parents[1],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((out / "verl_window.json").read_text())
    assert res["smoke"] is True and res["seeds"] == [0, 1]
    assert set(res["presets"]) == {
        "sim-paper-30b-a3b", "sim-paper-30b-a3b-40k", "sim-paper-30b-a3b-rollout-bound",
        "sim-paper-7b", "sim-paper-14b",
    }  # fmt: skip
    for rep in res["presets"].values():
        runs = rep["runs"]
        assert {(r["policy"], r["eta_or_window"]) for r in runs} == {
            ("staleflow", 1.0), ("staleflow", 3.0),
            ("verl-async", 0.0), ("verl-async", 1.0), ("verl-async", 3.0),
        }  # fmt: skip
        assert len(runs) == 10 and all(r["tokens_per_s"] > 0 for r in runs)
        # a window of B groups a sync: every batch generated at the version that trains it
        assert [r["max_staleness"] for r in runs if r["eta_or_window"] == 0.0] == [0, 0]
        assert all(row["verl_at_eta"]["tokens_per_s"] > 0 for row in rep["rows"])
        for row in rep["rows"]:
            eta = row["eta"]
            assert row["staleflow_max_staleness"] <= eta
            kept = row["verl_kept"]
            if kept is not None:  # the widest window whose runs all stayed within eta
                assert kept["max_staleness"] <= eta
                wider = [r for r in runs if r["policy"] == "verl-async"
                         and r["eta_or_window"] > kept["window"]]  # fmt: skip
                assert all(
                    max(r["max_staleness"] for r in wider if r["eta_or_window"] == w) > eta
                    for w in {r["eta_or_window"] for r in wider}
                )
    assert "staleflow ÷ it" in proc.stdout
