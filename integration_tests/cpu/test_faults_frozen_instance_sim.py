"""A rollout instance whose process is frozen (``SIGSTOP``: a hung driver, a debugger, a host
that stops scheduling it) on the real deployment with sim engines: Ray, the trajectory server
over TCP, the real rollout, control, reward and trainer actors.

The frozen instance answers nothing: its poll is overdue after ``ANSWER_WAIT_S`` (2 s), so it
is *silent* (``actors.silence``): the control core leaves it out of every cycle, the routes
held for its sync and those queued behind its overdue call go to the other instance, and
training goes on. ``coordinator.poll_timeout_s`` later its actor is killed and it is lost.
Before, the router kept it as it last answered (free), the next batch's work waited there for
its sync, and the trainer waited for that batch until the instance was lost.

The instance is frozen right after a step, at a moment it holds no work in the trajectory
server (work it holds cannot be had before it is lost: that batch waits for the loss). If the
first call that finds it frozen is a route (it looked free), or a route was on its way as it
froze, that route's work would wait for the loss too: the instance is thawed and frozen again
after a later step (the control core's own record of what it routed there says so).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from fault_checks import assert_ledger_balances, lost_record, run_watched
from tiny_setup import tiny_config
from waiting import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.ray, pytest.mark.sim, pytest.mark.timeout(300)]

STEPS, PER_STEP = 14, 64  # the tiny example's batch: 8 groups of 8
POLL_TIMEOUT_S = 20.0
WATCHDOG_S = 180.0


@pytest.fixture(scope="module")
def frozen(
    ray_session: None,
    tmp_path_factory: pytest.TempPathFactory,
    engine_required: Callable[[str], None],
) -> dict[str, Any]:
    engine_required("sim")
    import ray

    from staleflow_trainer.runtime.wiring import Deployment

    cfg = tiny_config(
        tmp_path_factory.mktemp("frozen_instance_sim"),
        f"trainer.steps={STEPS}",
        "run.checkpoint_every=0",
        "run.resume=never",
        f"coordinator.poll_timeout_s={POLL_TIMEOUT_S}",
        "trainer.step_delay_s=0.3",
        backend="sim",
    )
    out: dict[str, Any] = {"steps_at": {}}
    dep = Deployment(cfg).start()

    def holds_work(iid: str) -> bool:
        """Work the instance holds in the trajectory server, or that the control core routed
        to it (a route in flight when it froze: the instance never took that work from the
        server, and it waits for the loss all the same)."""
        in_store = ray.get(dep.coordinator.held_by.remote(iid))
        routed = ray.get(dep.coordinator.__ray_call__.remote(
            lambda actor: actor.core.ledger.held_by(iid)))  # fmt: skip
        return bool(in_store or routed)

    def on_record(rec: dict[str, Any]) -> None:
        step = int(rec["step"])
        out["steps_at"][step] = time.monotonic()
        if step < 3 or "victim" in out:
            return
        victim = sorted(dep.rollouts)[0]
        h = dep.rollouts[victim]
        pid = ray.get(h.__ray_call__.remote(lambda actor: os.getpid()))
        if holds_work(victim):
            return  # it holds work: freeze it after a later step
        silent = ray.get(dep.coordinator.summary.remote())["counters"]["instances_silent"]
        os.kill(pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        # the first call that finds it frozen makes it silent; if that call was a route, its
        # work waits for the loss (what the instance holds cannot be had before): thaw it and
        # freeze it after a later step (a sync, the usual first call, holds no work)
        wait_for(
            lambda: (
                ray.get(dep.coordinator.summary.remote())["counters"]["instances_silent"] > silent
            ),
            30,
            f"{victim} to be found silent",
            every_s=0.05,
        )
        if holds_work(victim):
            os.kill(pid, signal.SIGCONT)
            out["thawed"] = out.get("thawed", 0) + 1
            return
        out.update(victim=victim, pid=pid, frozen_at=frozen_at, frozen_after=step)

    try:
        out["summary"] = run_watched(dep, out, WATCHDOG_S, on_record)
        out["record"] = lost_record(dep, out["victim"], f"the loop to lose {out['victim']}")
        out["ledger"] = dep.ledger()
        out["instances"] = ray.get(dep.coordinator.instances.remote())
    finally:
        if "pid" in out:
            with contextlib.suppress(ProcessLookupError):  # killed by the control side already
                os.kill(out["pid"], signal.SIGKILL)
        dep.close()
    return out


def test_training_goes_on_while_the_instance_is_frozen(frozen: dict[str, Any]) -> None:
    assert "stopped_by_watchdog" not in frozen, frozen["summary"]["counters"]
    assert frozen["summary"]["steps_done"] == STEPS
    assert frozen["frozen_after"] < STEPS - 3, frozen["steps_at"]  # steps were left to train
    # every step after the freeze trained without waiting for the frozen instance's loss
    # (before, the next batch waited there until poll_timeout_s had run out)
    took = frozen["steps_at"][STEPS] - frozen["frozen_at"]
    assert took < POLL_TIMEOUT_S - 5, (took, frozen["steps_at"])
    counters = frozen["summary"]["counters"]
    assert counters["instances_silent"] >= 1, counters


def test_the_frozen_instance_is_lost_after_the_poll_timeout(frozen: dict[str, Any]) -> None:
    rec, victim = frozen["record"], frozen["victim"]
    assert (
        f"poll on {victim!r} did not return within coordinator.poll_timeout_s=20" in rec["error"]
    ), rec
    assert frozen["summary"]["counters"]["instances_lost"] == 1
    assert frozen["instances"] == [i for i in ("sim-0", "sim-1") if i != victim]


def test_every_admitted_trajectory_is_consumed_or_dropped_with_a_reason(
    frozen: dict[str, Any],
) -> None:
    assert_ledger_balances(frozen["ledger"], PER_STEP)
