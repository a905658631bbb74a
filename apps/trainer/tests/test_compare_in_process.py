"""Simulated runs in the caller's own process (``run_specs(..., workers=1)``, what ``compare``
and ``plan`` do on one core) quiet their own info lines but leave the process's logging as it
was: a caller's info lines are still heard afterwards."""

from __future__ import annotations

from pathlib import Path

import structlog
from structlog.testing import capture_logs

from staleflow_trainer.config import load_config
from staleflow_trainer.report.compare import run_specs

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def test_runs_in_this_process_leave_its_logging_as_it_was(tmp_path: Path) -> None:
    structlog.reset_defaults()
    wrapper = structlog.get_config()["wrapper_class"]
    run_dir = tmp_path / "run"
    cfg = load_config(
        EXAMPLES / "sim-tiny.yaml",
        [f"run_dir={run_dir}", "trainer.steps=2", "sim.warmup_steps=1", "metrics.log_every=0"],
    )
    [summary] = run_specs([(cfg, run_dir)], workers=1)
    assert summary["steps"] == 2
    assert structlog.get_config()["wrapper_class"] is wrapper
    with capture_logs() as logs:
        structlog.get_logger("caller").info("still_heard")
    assert [e["event"] for e in logs] == ["still_heard"]
