"""The worked example runs end to end (it is the README's main job until the trainer exists)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from staleness_protocol.example import run


@pytest.mark.parametrize("train_ticks", [1, 3, 12])
def test_example_trains_the_requested_steps_within_the_bound(train_ticks: int) -> None:
    lines: list[str] = []
    summary = run(steps=5, seed=1, train_ticks=train_ticks, emit=lines.append)
    assert summary["steps"] == 5
    assert sum(1 for line in lines if line.startswith("step ")) == 5
    assert max(summary["staleness_histogram"]) <= 2
    # the weights each sample was really generated with: never more than eta behind
    assert max(summary["true_staleness_histogram"]) <= 2
    assert summary["true_staleness_histogram"] == summary["staleness_histogram"]
    assert summary["replacements_drained"] == summary["replacements_requested"]
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
