"""``benchmarks/bench_sim_sweep.py batch --smoke``: one sweep of two small points on the
simulator (staleflow against sync), its JSON, table and plot written."""

from __future__ import annotations

import json
from pathlib import Path

import bench_sim_sweep
import pytest

pytestmark = [pytest.mark.sim, pytest.mark.timeout(300)]


def test_bench_sim_sweep_smoke(tmp_path: Path) -> None:
    res = bench_sim_sweep.main(["batch", "--smoke", "--out-dir", str(tmp_path / "sweep")])
    stem = tmp_path / "sweep_batch"
    assert json.loads(stem.with_suffix(".json").read_text())["points"] == res["points"]
    assert stem.with_suffix(".md").read_text().count("\n") >= 4
    assert stem.with_suffix(".png").stat().st_size > 0
    assert [p["value"] for p in res["points"]] == bench_sim_sweep.SMOKE_VALUES["batch"]
    for p in res["points"]:
        (b,) = p["by_seed"]
        assert b["tokens_per_s"]["staleflow"] > 0 and b["tokens_per_s"]["sync"] > 0
        assert b["max_staleness"]["staleflow"] <= res["eta"]
        assert b["max_staleness"]["sync"] == 0
        assert b["ratios"]["sync"] > 0
