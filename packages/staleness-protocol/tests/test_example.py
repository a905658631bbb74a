"""The worked example runs end to end (it is the README's main job until the trainer exists)."""

from __future__ import annotations

import subprocess
import sys

from staleness_protocol.example import run


def test_example_trains_the_requested_steps_within_the_bound() -> None:
    lines: list[str] = []
    summary = run(steps=5, seed=1, emit=lines.append)
    assert summary["steps"] == 5
    assert sum(1 for line in lines if line.startswith("step ")) == 5
    assert max(summary["staleness_histogram"]) <= 2
    assert (
        sum(summary["staleness_histogram"].values()) == summary["trajectories_by_state"]["consumed"]
    )
    assert summary["trajectories_by_state"]["consumed"] == 5 * 4 * 4


def test_example_runs_as_a_module() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "staleness_protocol.example", "--steps", "3"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert "summary:" in out.stdout and "staleness_histogram" in out.stdout
