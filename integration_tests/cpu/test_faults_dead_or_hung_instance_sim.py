"""A rollout instance whose engine dies under a live actor, then one whose sync hangs, then one
whose poll hangs — on the real deployment with sim engines: Ray, the trajectory server (TS) over TCP, the real rollout,
control, reward and trainer actors. One run:

* after step 1, **a dead engine** (the engine process crashed; the actor, its Ray worker, is
  still there). The instance holds work when its engine dies: its fault hook holds the next poll
  made while it generates (``hold_poll_with_work``), then ``kill_engine`` kills the engine (the
  sim engine's ``kill``: every waiting call fails with ``EngineDead``). The actor must end its
  own process, so that the control side sees a lost instance, as for a killed actor: what the TS
  held there goes back to the queue and is routed elsewhere. Without it, the instance stayed in
  the run failing or never answering, and its work was stuck. A replacement joins.
* **a hung instance**: the other first instance's first sync (right after step 1) never
  returns (``hang_next_sync``, armed before the run; its engine is fine). After
  ``coordinator.sync_timeout_s`` the control actor kills its actor and loses it. Without it,
  the instance stayed "syncing" for good. (``trainer.step_delay_s`` keeps the run going past
  the timeout.)
* **a silent instance**: a second replacement joins; the first one's next poll made while it
  generates never answers (``hold_poll_with_work``, never released; its actor and engine are
  fine). After ``coordinator.poll_timeout_s`` the control actor kills its actor and loses it.
  Without it, the whole control loop waited on that poll for good; and the loop does not wait
  for it meanwhile: the other instance's outcomes come in.

Then the run completes on the second replacement, and the ledger balances.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from fault_checks import assert_ledger_balances, assert_routes_stopped, lost_record, run_watched
from structlog.testing import capture_logs
from tiny_setup import tiny_config
from waiting import wait_for

from staleflow_trainer.runtime.prepare import ray_prints_worker_logs

pytestmark = [pytest.mark.fault, pytest.mark.ray, pytest.mark.sim, pytest.mark.timeout(600)]

BATCH, GROUP, ETA, STEPS = 4, 4, 1, 16
#: an instance's first sync sets up its transfers (about 2 s here): the limit leaves room
SYNC_TIMEOUT_S = 12.0
CALL_TIMEOUT_S = 8.0  # the dying instance's held poll ends sooner: its process exits
STEP_DELAY_S = 2.0  # the steps after step 1 take longer than the limit
WATCHDOG_S = 240.0  # a run that has not completed by then is stopped


@pytest.fixture(scope="module")
def dead(
    ray_session: None,
    tmp_path_factory: pytest.TempPathFactory,
    engine_required: Callable[[str], None],
) -> dict[str, Any]:
    engine_required("sim")
    import ray

    from staleflow_trainer.runtime.wiring import Deployment

    run_dir = tmp_path_factory.mktemp("dead_or_hung_instance_sim")
    cfg = tiny_config(
        run_dir,
        f"trainer.steps={STEPS}",
        "run.checkpoint_every=0",
        "run.resume=never",
        f"protocol.batch_size={BATCH}",
        f"protocol.group_size={GROUP}",
        f"protocol.eta={ETA}",
        "rollout.sampling.max_new_tokens=48",
        "rollout.max_model_len=80",
        f"coordinator.sync_timeout_s={SYNC_TIMEOUT_S}",
        f"coordinator.call_timeout_s={CALL_TIMEOUT_S}",
        f"coordinator.poll_timeout_s={CALL_TIMEOUT_S}",
        f"trainer.step_delay_s={STEP_DELAY_S}",
        "sim.workload.response_len_median=24",
        backend="sim",
    )
    out: dict[str, Any] = {}
    dep = Deployment(cfg).start()
    hung = out["hung"] = sorted(dep.rollouts)[0]
    ray.get(dep.rollouts[hung].hang_next_sync.remote())
    armed = time.monotonic()

    def on_record(rec: dict[str, Any]) -> None:
        if int(rec["step"]) < 1 or "victim" in out:
            return
        victim = sorted(dep.rollouts)[-1]
        out["victim"] = victim
        h = dep.rollouts[victim]
        ray.get(h.hold_poll_with_work.remote())
        out["held"] = wait_for(
            lambda: ray.get(h.poll_held.remote()), 60, f"{victim} to generate", every_s=0.05
        )
        try:
            out["killed_pids"] = ray.get(h.kill_engine.remote())
        except ray.exceptions.RayActorError:  # it ended itself before the answer left
            out["killed_pids"] = []
        t0 = time.monotonic()
        out["lost_record"] = lost_record(dep, victim, f"the loop to lose {victim}")
        out["noticed_s"] = time.monotonic() - t0
        out["replacement"] = dep.add_instance()
        out["hung_record"] = lost_record(dep, hung, f"the loop to lose {hung}")
        out["hung_after_s"] = time.monotonic() - armed
        out["hung_alive"] = _alive(dep.rollouts[hung])
        silent = out["silent"] = out["replacement"]
        out["replacement2"] = dep.add_instance()
        h = dep.rollouts[silent]
        ray.get(h.hold_poll_with_work.remote())
        held_from = time.monotonic()
        out["silent_held"] = wait_for(
            lambda: ray.get(h.poll_held.remote()), 60, f"{silent} to generate", every_s=0.05
        )
        out["tokens_at_hold"] = ray.get(dep.coordinator.summary.remote())["tokens_total"]
        out["silent_record"] = lost_record(dep, silent, f"the loop to lose {silent}")
        out["tokens_at_loss"] = ray.get(dep.coordinator.summary.remote())["tokens_total"]
        out["silent_after_s"] = time.monotonic() - held_from
        out["silent_alive"] = _alive(h)

    try:
        with capture_logs() as logs:  # the driver's own, and those relayed from the control
            out["summary"] = run_watched(dep, out, WATCHDOG_S, on_record)
        out["relayed"] = [e for e in logs if e.get("relayed_from") == "control"]
        out["relaying"] = not ray_prints_worker_logs()  # else Ray prints them (a developer's)
        out["ledger"] = dep.ledger()
        out["histories"] = ray.get(dep.coordinator.histories.remote())
        out["instances"] = ray.get(dep.coordinator.instances.remote())
        out["actor_alive"] = _alive(dep.rollouts.get(out["victim"]))
    finally:
        dep.close()
    return out


def _alive(handle: Any) -> bool | None:
    """Whether the Ray actor behind ``handle`` still answers (None: no handle kept)."""
    if handle is None:
        return None
    import ray

    try:
        ray.get(handle.stats.remote(), timeout=10)
    except Exception:
        return False
    return True


def test_the_instance_was_lost_and_the_run_completed(dead: dict[str, Any]) -> None:
    assert "stopped_by_watchdog" not in dead, dead["summary"]["counters"]
    assert dead["summary"]["steps_done"] == STEPS
    assert dead["killed_pids"] == []  # the sim engine died in place: no process was killed
    # the dead one, the hung one and the silent one
    assert dead["summary"]["counters"]["instances_lost"] == 3
    assert dead["summary"]["counters"]["instances_joined"] == 2
    assert dead["instances"] == [dead["replacement2"]]
    assert dead["actor_alive"] is not True  # its process ended itself
    assert dead["noticed_s"] < 30


def test_a_hung_sync_loses_the_instance_after_the_timeout(dead: dict[str, Any]) -> None:
    rec = dead["hung_record"]
    assert "did not return within coordinator.sync_timeout_s" in rec["error"], rec
    assert dead["hung_alive"] is False  # its actor was killed
    # lost once the limit ran out, not before (the hang was armed before its first sync began)
    assert SYNC_TIMEOUT_S <= dead["hung_after_s"] < SYNC_TIMEOUT_S + 60
    assert_routes_stopped(dead["histories"], rec)


def test_a_hung_poll_loses_the_instance_after_the_call_timeout(dead: dict[str, Any]) -> None:
    rec, silent = dead["silent_record"], dead["silent"]
    assert (
        f"poll on {silent!r} did not return within coordinator.poll_timeout_s=8" in (rec["error"])
    ), rec
    assert dead["silent_alive"] is False  # its actor was killed
    assert CALL_TIMEOUT_S <= dead["silent_after_s"] < CALL_TIMEOUT_S + 60
    # the loop went on with the other instance while the poll was out: its outcomes came in
    # (a loop that waited on the poll handled none until the timeout)
    assert dead["tokens_at_loss"] > dead["tokens_at_hold"], dead
    # the run's own output said so, from the control actor's log
    said = {(e["event"], e["log_level"]) for e in dead["relayed"] if e.get("instance") == silent}
    if dead["relaying"]:  # STALEFLOW_RAY_LOGS unset, as in CI
        assert {("instance_answer_late", "warning"), ("instance_hung", "error")} <= said, said
    held = dead["silent_held"]
    assert held and set(held) <= set(rec["requeued"]) | set(rec["finished"]) | set(rec["dropped"])
    assert_routes_stopped(dead["histories"], rec)


def test_what_it_held_went_back_to_the_queue_and_ran_elsewhere(dead: dict[str, Any]) -> None:
    held, rec = dead["held"], dead["lost_record"]
    assert held, "the instance was generating when its engine died"
    assert set(held) <= set(rec["requeued"]) | set(rec["finished"]) | set(rec["dropped"])
    assert_routes_stopped(dead["histories"], rec)


def test_every_admitted_trajectory_is_consumed_or_dropped_with_a_reason(
    dead: dict[str, Any],
) -> None:
    assert_ledger_balances(dead["ledger"], BATCH * GROUP)
    assert dead["ledger"]["steps_done"] == STEPS
