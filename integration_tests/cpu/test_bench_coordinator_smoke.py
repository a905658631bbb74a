"""``benchmarks/bench_coordinator.py --smoke``: one cycle of every policy at paper scale (128
instances, 8,192 queued, 4,096 running), twice each, on the protocol the policy runs on."""

from __future__ import annotations

import json
from pathlib import Path

import bench_coordinator
import pytest

from rollout_coordinator.policies import POLICIES

pytestmark = [pytest.mark.timeout(300)]


def test_bench_coordinator_smoke_times_every_policy(tmp_path: Path) -> None:
    out = tmp_path / "coordinator.json"
    res = bench_coordinator.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text())["policies"] == res["policies"]
    assert res["smoke"] is True and res["iterations"] == 2
    assert set(res["policies"]) == set(POLICIES)
    for name, r in res["policies"].items():
        assert 0 < r["cycle_ms_p50"] <= r["cycle_ms_p99"], name
    # with work queued and capacity free, the asynchronous policies route something
    assert res["policies"]["staleflow"]["routes_per_cycle"] > 0
    assert res["policies"]["coarse-async-drop"]["routes_per_cycle"] > 0
