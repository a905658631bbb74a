"""``benchmarks/bench_engine.py --smoke``: every part runs on a tiny load and passes its checks.

The full benchmark (32 instances, up to 32,768 trajectories) reports the figures; this keeps it
from rotting: a crash, a load that never finishes or an empty metric fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import bench_engine
import pytest

pytestmark = [pytest.mark.sim, pytest.mark.timeout(120)]


def test_bench_engine_smoke(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    bench_engine.main(["--smoke", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["sim_paper_step_trajectories"] == 128
    assert data["fidelity_paper_step_tokens"] > 0
    assert 218_000 <= data["fidelity_kv_capacity_tokens"] <= 283_000
