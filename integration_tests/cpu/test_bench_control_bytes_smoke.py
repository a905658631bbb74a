"""``benchmarks/bench_control_bytes.py --smoke``: two short runs of the real deployment (Ray,
trajectory server, parameter server, trainer, sim engine instances) at response lengths 16 and
256; the control process's byte counts are read from the control actor and reported per
trajectory. The full benchmark reports the ratio; this keeps it running and its counts real."""

from __future__ import annotations

import json
from pathlib import Path

import bench_control_bytes
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.sim, pytest.mark.timeout(900)]


def test_bench_control_bytes_smoke(ray_session: None, tmp_path: Path) -> None:
    out = tmp_path / "control_bytes.json"
    res = bench_control_bytes.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert res["smoke"] is True
    assert [r["response_len"] for r in res["runs"]] == [16, 256]
    for r in res["runs"]:
        assert r["steps"] == 2
        assert r["consumed"] == 2 * 8 * 8
        assert r["trajectories"] >= r["consumed"]
        # every consumed response really is L - 1 or L tokens long (in the store, not here)
        assert r["tokens_generated"] >= r["consumed"] * (r["response_len"] - 1)
        assert all(r["bytes"][k] > 0 for k in bench_control_bytes.KINDS)
    assert res["length_ratio"] == 16
    assert res["ratio_longest_over_shortest"]["total"] > 0
    # no payload crosses the control process: what it exchanges with the store, the reward
    # workers and the trainer per trajectory does not grow with a 16x longer response
    for kind in ("ts", "rewards", "trainer"):
        assert res["ratio_longest_over_shortest"][kind] < 1.25, (kind, res)
