"""``benchmarks/bench_coordinator_wal.py --smoke``: a simulated run journaled cycle by cycle, then
replayed from the journal into a core whose state equals the live one exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sim, pytest.mark.timeout(300)]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_coordinator_wal.py"


def test_bench_coordinator_wal_smoke_replays_exactly(tmp_path: Path) -> None:
    out = tmp_path / "wal.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["smoke"] is True
    assert res["steps_done"] == 5
    assert res["replay_identical"] is True
    assert res["hook_changes_nothing"] is True
    assert res["replayed_records"] == res["appends"] > 0
    assert res["replayed_events"] == res["events_journaled"] >= res["appends"]
    assert res["append_bytes_mean"] > 0 and res["full_snapshot_bytes"] > 0
    assert 0 < res["append_s_p50"] <= res["append_s_p99"] <= res["append_s_max"]
    assert "replay_identical" in proc.stdout
