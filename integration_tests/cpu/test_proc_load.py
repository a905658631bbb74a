"""``benchmarks/proc_load.py``: what a run's processes want of the host, from ``/proc``, over the
window its ``metrics.jsonl`` marks. A child process that spins on a core for part of the window
shows up under its name (a Ray-style title loses the method it runs), with the cores it used
and at least as many threads runnable; a run that ends before its last mark measures nothing."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_load import HostLoad, _title

SPIN_S = 0.6
PROBE = "probe::Spinner.spin"  # the title the child runs under (as Ray names an actor's call)


@pytest.mark.parametrize(
    ("argv0", "name"),
    [
        ("ray::RolloutActor.close", "ray::RolloutActor"),
        ("ray::ControlActor", "ray::ControlActor"),
        ("VLLM::EngineCore", "VLLM::EngineCore"),
        ("/usr/bin/python3.11", "python3.11"),
    ],
)
def test_a_process_is_named_by_its_title_or_program(argv0: str, name: str) -> None:
    assert _title(argv0) == name


_CHILD = """
import sys, time
from pathlib import Path
d = Path(sys.argv[1])
def spin(s):
    t = time.process_time()
    while time.process_time() - t < s:
        pass
spin({before})
(d / "spun").touch()
while not (d / "go").exists():
    time.sleep(0.01)
spin({during})
(d / "done").touch()
time.sleep(60)
"""


def _wait_for(f: Path) -> None:
    end = time.monotonic() + 60
    while not f.exists():
        assert time.monotonic() < end, f"{f} never appeared"
        time.sleep(0.01)


def test_a_spinning_child_is_measured_over_the_marked_window(tmp_path: Path) -> None:
    """It spins 0.5 s before the window opens and ``SPIN_S`` inside it: only the second
    counts."""
    metrics = tmp_path / "metrics.jsonl"
    code = tmp_path / "child.py"
    code.write_text(_CHILD.format(before=0.5, during=SPIN_S))
    child = subprocess.Popen(
        ["bash", "-c", f'exec -a "{PROBE}" {sys.executable} {code} {tmp_path}']
    )
    try:
        load = HostLoad(tmp_path, 1, 2)
        _wait_for(tmp_path / "spun")
        metrics.write_text('{"step": 1}\n')  # the window opens
        time.sleep(0.3)
        (tmp_path / "go").touch()
        _wait_for(tmp_path / "done")
        with metrics.open("a") as f:
            f.write('{"step": 2}\n')  # ... and closes while the child is alive
        time.sleep(0.3)
        got = load.result()
    finally:
        child.kill()
        child.wait()
    assert got is not None and got["window_s"] >= SPIN_S, got
    cores, runnable = got["by_process"]["probe::Spinner"]
    assert SPIN_S * 0.95 <= cores * got["window_s"] <= SPIN_S + 0.25, got
    assert runnable >= cores, got


def test_a_run_that_ends_early_measures_nothing(tmp_path: Path) -> None:
    load = HostLoad(tmp_path, 1, 3)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    time.sleep(0.2)
    assert load.result() is None
