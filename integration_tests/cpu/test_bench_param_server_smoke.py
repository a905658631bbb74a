"""``benchmarks/bench_param_server.py --smoke``: push and pull of 16 MiB between processes over
real NIXL, beside a bare NIXL read of the same bytes; the pulled bytes equal the pushed ones."""

from __future__ import annotations

import json
from pathlib import Path

import bench_param_server
import pytest

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(300)]


def test_bench_param_server_smoke(tmp_path: Path) -> None:
    out = tmp_path / "ps.json"
    res = bench_param_server.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    assert res["smoke"] is True and res["model_bytes"] == 16 << 20
    for key in ("push_gbps", "pull_gbps", "pull_noverify_gbps", "raw_nixl_gbps", "xxh3_gbps"):
        assert res[key] > 0, key
    assert res["pull_efficiency"] > 0
