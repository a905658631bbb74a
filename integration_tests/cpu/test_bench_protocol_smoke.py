"""``benchmarks/bench_protocol.py --smoke`` runs, exits 0 and writes its JSON report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_protocol.py"


def test_bench_protocol_smoke_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "protocol.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["smoke"] is True
    points = res["long_run"]["at_step"]
    assert len(points) == 2
    for point in points.values():
        assert point["checkpoint_bytes"] > 0 and point["ledger_trajectories"] > 0
        assert all(point[f"{op}_n"] > 0 for op in ("can_reserve", "reserve", "finish", "consume"))
    scale = res["scale"]
    assert [s["in_flight"] >= n for s, n in zip(scale, (2000, 8000), strict=True)] == [True, True]
    assert scale[0]["batch_size"] < scale[1]["batch_size"]
    for s in scale:
        assert s["checkpoint_bytes"] > 0 and s["to_dict_ms"] > 0
    assert scale[0]["growth"]["in_flight"] is None
    assert scale[1]["growth"]["checkpoint_bytes"] == round(
        scale[1]["checkpoint_bytes"] / scale[0]["checkpoint_bytes"], 2
    )
    assert set(res["meets_targets"]) == {
        "can_reserve_p50_le_5us",
        "reserve_p50_le_5us",
        "finish_p50_le_5us",
        "consume_p50_le_1ms",
    }
    assert "checkpoint bytes" in proc.stdout
