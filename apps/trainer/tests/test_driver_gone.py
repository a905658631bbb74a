"""A killed ``staleflow train`` driver: the control loop stops at its next cycle, and the
step records the driver never wrote travel in the checkpoint and fill ``metrics.jsonl`` on
resume (no gap in the steps). A failed trainer stops the loop the same way, with the error."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import structlog

from staleflow_trainer.actors.control import ControlActor
from staleflow_trainer.errors import ComponentLost
from staleflow_trainer.report.metrics import MetricsWriter, read_jsonl


def _row(step: int) -> dict[str, Any]:
    return {"step": step, "version": step, "tokens_per_s": 1.0, "max_staleness": 0,
            "mean_staleness": 0.0, "reward_mean": 0.0, "trainer_wait_s": 0.0}  # fmt: skip


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _actor(driver_pid: int | None) -> Any:
    """A ControlActor shell around stand-ins for the core and the I/O: only the loop's
    driver check, ``drain`` and the unconfirmed-record bookkeeping run for real."""
    a: Any = ControlActor.__new__(ControlActor)
    a._driver_pid = driver_pid
    a._stop = False
    a._running = False
    a._records, a._unconfirmed = [], []
    a._log = structlog.get_logger("test")
    a.cfg = SimpleNamespace(coordinator=SimpleNamespace(snapshot_interval_s=0.01))
    a.core = SimpleNamespace(done=False, steps_done=0, take_timeline=list)
    a.io = SimpleNamespace(fatal=None, wake=asyncio.Event(), rollouts={})
    a.cycles = 0

    async def cycle() -> None:
        a.cycles += 1
        if a.cycles >= 50:
            a._stop = True

    async def settle() -> None:
        pass

    a._cycle, a._settle = cycle, settle
    a.summary_now = lambda: {"cycles": a.cycles}
    return a


@pytest.mark.fault
def test_the_loop_stops_when_the_driver_is_gone() -> None:
    gone = _actor(_dead_pid())
    assert asyncio.run(gone.run()) == {"cycles": 0}
    alive = _actor(None)  # no driver to watch (a remote driver): runs on
    assert asyncio.run(alive.run()) == {"cycles": 50}
    import os

    me = _actor(os.getpid())
    assert asyncio.run(me.run()) == {"cycles": 50}


@pytest.mark.fault
def test_the_loop_stops_once_the_trainer_failed() -> None:
    """No cycle after the failure: no new routes, no polls, so the trajectory server stays
    as the core last saw it (a resume starts from the checkpoint)."""
    a = _actor(None)
    a._trains_running = 0
    seen: list[int] = []

    async def train(e: Any) -> dict[str, Any]:
        seen.append(a._trains_running)
        raise RuntimeError("trainer process died")

    async def cycle() -> None:
        a.cycles += 1
        if a.cycles == 3:
            await a._train(SimpleNamespace(version=2))
        if a.cycles >= 50:
            a._stop = True

    a.io.train, a._cycle = train, cycle
    with pytest.raises(ComponentLost, match="trainer process died") as err:
        asyncio.run(a.run())
    assert err.value.component == "trainer"
    assert a.cycles == 3
    assert seen == [1] and a._trains_running == 0  # counted while the call ran


def test_records_stay_unconfirmed_until_the_driver_wrote_them() -> None:
    a = _actor(None)
    a._records = [_row(1), _row(2)]
    a._unconfirmed = [_row(1), _row(2)]
    out = asyncio.run(a.drain(0))
    assert [r["step"] for r in out["records"]] == [1, 2]
    assert [r["step"] for r in a._unconfirmed] == [1, 2]  # handed out, not yet confirmed
    a._unconfirmed.append(_row(3))
    asyncio.run(a.drain(2))
    assert [r["step"] for r in a._unconfirmed] == [3]


@pytest.mark.fault
def test_resume_fills_the_metrics_gap_from_the_checkpoint(tmp_path: Path) -> None:
    w = MetricsWriter(tmp_path, tensorboard=False)
    for k in (1, 2, 3, 4, 7):  # 7: written after the checkpoint by the dead run
        w.log_step(_row(k))
    w.close()
    w = MetricsWriter(tmp_path, tensorboard=False, resume_step=6,
                      backfill=[_row(4), _row(5), _row(6)])  # fmt: skip
    w.log_step(_row(7))
    w.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6, 7]
