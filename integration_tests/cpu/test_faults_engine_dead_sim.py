"""A rollout instance whose engine dies under a live actor (the engine process crashed; the
actor, its Ray worker, is still there) — on the real deployment with sim engines: Ray, the
trajectory server (TS) over TCP, the real rollout, control, reward and trainer actors.

The instance holds work when its engine dies: its fault hook holds the next poll made while
it generates (``hold_poll_with_work``), then ``kill_engine`` kills the engine (the sim engine's
``kill``: every waiting call fails with ``EngineDead``). The actor must end its own process, so
that the control side sees a lost instance, as for a killed actor: what the TS held there goes
back to the queue and is routed to the other instance, and the run completes. Without it, the
instance stayed in the run failing or never answering, and its work was stuck.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from tiny_setup import tiny_config
from waiting import wait_for

from trajectory_server import routes_out_of_queue

pytestmark = [pytest.mark.fault, pytest.mark.ray, pytest.mark.sim, pytest.mark.timeout(600)]

BATCH, GROUP, ETA, STEPS = 4, 4, 1, 8
WATCHDOG_S = 240.0  # a run that has not completed by then is stopped


@pytest.fixture(scope="module")
def dead(
    ray_session: None,
    tmp_path_factory: pytest.TempPathFactory,
    engine_required: Callable[[str], None],
) -> dict[str, Any]:
    engine_required("sim")
    import ray

    from staleflow_trainer.wiring import Deployment

    run_dir = tmp_path_factory.mktemp("engine_dead_sim")
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
        "sim.workload.response_len_median=24",
        backend="sim",
    )
    out: dict[str, Any] = {}
    dep = Deployment(cfg).start()
    finished = threading.Event()

    def watchdog() -> None:
        if not finished.wait(WATCHDOG_S):
            out["stopped_by_watchdog"] = True
            ray.get(dep.coordinator.stop.remote())

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
        out["lost_record"] = wait_for(
            lambda: [
                x for x in ray.get(dep.coordinator.lost_instances.remote())
                if x["instance_id"] == victim
            ],
            60, "the loop to notice the lost instance", every_s=0.05,
        )[0]  # fmt: skip
        out["noticed_s"] = time.monotonic() - t0

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        out["summary"] = dep.run(on_record=on_record)
        finished.set()
        out["ledger"] = dep.ledger()
        out["histories"] = ray.get(dep.coordinator.histories.remote())
        out["instances"] = ray.get(dep.coordinator.instances.remote())
        out["actor_alive"] = _alive(dep.rollouts.get(out["victim"]))
    finally:
        finished.set()
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
    assert dead["summary"]["counters"]["instances_lost"] == 1
    assert dead["victim"] not in dead["instances"]
    assert dead["actor_alive"] is not True  # its process ended itself
    assert dead["noticed_s"] < 30


def test_what_it_held_went_back_to_the_queue_and_ran_elsewhere(dead: dict[str, Any]) -> None:
    victim, held, rec = dead["victim"], dead["held"], dead["lost_record"]
    assert held, "the instance was generating when its engine died"
    assert set(held) <= set(rec["requeued"]) | set(rec["finished"]) | set(rec["dropped"])
    hist = dead["histories"]
    for tid in rec["requeued"]:
        kinds = [e[0] for e in hist[tid]]
        assert "lost" in kinds, (tid, hist[tid])
        after = hist[tid][kinds.index("lost") + 1 :]
        assert all(e[1] != victim for e in after if e[0] == "routed"), (tid, hist[tid])
        assert [e for e in after if e[0] == "routed"] or "dropped" in [e[0] for e in after], (
            tid,
            hist[tid],
        )
    assert routes_out_of_queue(hist) == []


def test_every_admitted_trajectory_is_consumed_or_dropped_with_a_reason(
    dead: dict[str, Any],
) -> None:
    ledger = dead["ledger"]
    assert ledger["problems"] == []
    assert (
        ledger["consumed"] + ledger["in_flight"] + ledger["waiting_consume"] + ledger["dropped"]
        == ledger["trajectories"]
    )
    assert ledger["consumed"] == STEPS * BATCH * GROUP
    assert all(reason and reason != "?" for reason in ledger["dropped_reasons"])
