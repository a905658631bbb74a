"""``benchmarks/bench_sim_speed.py --smoke`` runs both sides (this tree twice, the tiny preset),
exits 0, writes its report and finds the two runs identical."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_sim_speed.py"

pytestmark = pytest.mark.sim


def test_bench_sim_speed_smoke_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "sim_speed.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCH.parents[1],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["smoke"] is True and res["identical"] is True
    assert res["preset"] == "examples/sim-tiny.yaml" and res["pairs"] == 1
    for side in ("before", "after"):
        (run,) = res["runs"][side]
        assert run["cpu_s"] > 0 and run["wall_s"] > 0 and run["cycles"] > 0
    assert res["runs"]["before"][0]["cycles"] == res["runs"]["after"][0]["cycles"]
    assert res["cpu_ratio"] > 0 and res["wall_ratio"] > 0
    assert "results identical: True" in proc.stdout
