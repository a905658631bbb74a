"""``benchmarks/bench_trajectory_server.py --smoke``: the server in its own process over
loopback TCP; route, interrupt (return partials) and route again on a small load."""

from __future__ import annotations

import json
from pathlib import Path

import bench_trajectory_server
import pytest

pytestmark = [pytest.mark.timeout(300)]


def test_bench_trajectory_server_smoke(tmp_path: Path) -> None:
    out = tmp_path / "ts.json"
    res = bench_trajectory_server.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert res["smoke"] is True and res["trajectories"] == 256
    for name in ("route_fresh", "interrupt", "route"):
        assert res[f"{name}_per_s"] > 0
        assert res[f"{name}_calls"] == 256 // res["batch"]
        assert 0 < res[f"{name}_p50_ms"] <= res[f"{name}_p99_ms"]
    # every returned token is held by the server: prompt + generated per trajectory
    assert res["server_tokens_held"] >= 256 * 512
