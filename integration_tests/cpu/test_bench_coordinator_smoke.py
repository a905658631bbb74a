"""``benchmarks/bench_coordinator.py --smoke`` runs, exits 0 and writes its JSON report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rollout_coordinator.policies import POLICIES

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_coordinator.py"


def test_bench_coordinator_smoke_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "coordinator.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["smoke"] is True
    assert len(res["load_average"]) == 3
    # every registered policy ran at the paper point and did some work
    paper = res["paper"]["policies"]
    assert set(paper) == set(POLICIES)
    assert all(r["cycle_ms_p50"] > 0 for r in paper.values())
    assert paper["staleflow"]["routes_per_cycle"] > 0
    # the curve: one row per point per policy, growth ratios from the second point on
    curve = res["scale"]["points"]
    assert set(curve) == {"staleflow", "all-vanilla"}
    for rows in curve.values():
        assert [(r["instances"], r["queued"]) for r in rows] == [(8, 256), (16, 512)]
        assert rows[0]["growth_p50"] is None and rows[1]["growth_cpu_p50"] is not None
        assert rows[1]["growth_p50"] == round(rows[1]["cycle_ms_p50"] / rows[0]["cycle_ms_p50"], 2)
    assert res["scale"]["profile_largest"]["staleflow"][0]["own_pct"] > 0
    assert set(res["meets_target_p50"]) == {
        "paper_point",
        "paper_point_cpu",
        "largest_point",
        "largest_point_cpu",
    }
    assert "x prev p50" in proc.stdout and "load average" in proc.stdout
