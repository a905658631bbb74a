"""A rollout instance killed after it wrote finished trajectories to the trajectory server (TS)
and before the poll answer carrying them reached the control actor — on the real deployment
with sim engines: Ray, the TS over TCP, the real rollout, control, reward and trainer actors.

The instance is held in that window by its fault hook (``hold_poll_after_finish``: the next
poll that reports a finished trajectory writes it to the TS, then never answers), then killed
(``ray.kill``). The control side must learn from the TS that those trajectories finished: they
go on to reward and training instead of back to the queue, where the TS would refuse every
route of them forever. Then: the run completed its steps; each held trajectory finished once,
on the killed instance, and was never routed again; the ledger balances (every admitted
trajectory consumed, in flight or dropped with a reason); no route was refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fault_checks import assert_ledger_balances, run_watched
from tiny_setup import tiny_config
from waiting import wait_for

from trajectory_server import routes_out_of_queue

pytestmark = [pytest.mark.fault, pytest.mark.ray, pytest.mark.sim, pytest.mark.timeout(600)]

BATCH, GROUP, ETA, STEPS = 4, 4, 1, 8
#: a run that has not completed by then is stopped (a refusal loop never completes)
WATCHDOG_S = 240.0


def _wait(pred: Callable[[], Any], timeout_s: float, what: str) -> Any:
    return wait_for(pred, timeout_s, what, every_s=0.05)


@pytest.fixture(scope="module")
def lost(
    ray_session: None,
    tmp_path_factory: pytest.TempPathFactory,
    engine_required: Callable[[str], None],
) -> dict[str, Any]:
    engine_required("sim")
    import ray

    from staleflow_trainer.runtime.wiring import Deployment

    run_dir = tmp_path_factory.mktemp("lost_after_flush_sim")
    cfg = tiny_config(
        run_dir,
        f"trainer.steps={STEPS}",
        "run.checkpoint_every=0",
        "run.resume=never",
        f"protocol.batch_size={BATCH}",
        f"protocol.group_size={GROUP}",
        f"protocol.eta={ETA}",
        "rollout.sampling.max_new_tokens=6",
        "sim.workload.response_len_median=4",
        backend="sim",
    )
    out: dict[str, Any] = {}
    dep = Deployment(cfg).start()

    def on_record(rec: dict[str, Any]) -> None:
        if int(rec["step"]) < 1 or "victim" in out:
            return
        victim = sorted(dep.rollouts)[-1]
        out["victim"] = victim
        h = dep.rollouts[victim]
        ray.get(h.hold_poll_after_finish.remote())
        # the control loop waits on that poll now: the TS has the finishes, the core not
        out["held"] = _wait(
            lambda: ray.get(h.poll_held.remote()), 60, "a poll answer with finished work"
        )
        dep.kill_instance(victim)

    try:
        out["summary"] = run_watched(dep, out, WATCHDOG_S, on_record)
        out["ledger"] = dep.ledger()
        out["histories"] = ray.get(dep.coordinator.histories.remote())
        out["lost"] = ray.get(dep.coordinator.lost_instances.remote())
    finally:
        dep.close()
    return out


def test_the_run_completed_without_a_refusal_loop(lost: dict[str, Any]) -> None:
    assert "stopped_by_watchdog" not in lost, lost["summary"]["counters"]
    assert lost["summary"]["steps_done"] == STEPS
    counters = lost["summary"]["counters"]
    # a refused route is reported as an instance error: none (a loop makes thousands)
    assert counters.get("generate_errors", 0) == 0, counters


def test_the_held_finishes_went_on_to_reward_not_back_to_the_queue(lost: dict[str, Any]) -> None:
    victim, held = lost["victim"], lost["held"]
    assert held
    (rec,) = [x for x in lost["lost"] if x["instance_id"] == victim]
    # the control side had not seen them; at the loss it learned from the TS they finished
    assert sorted(rec["finished"]) == sorted(held)
    assert not set(held) & set(rec["requeued"])
    assert lost["summary"]["counters"]["lost_finished"] == len(held)
    hist = lost["histories"]
    for tid in held:
        kinds = [e[0] for e in hist[tid]]
        assert kinds.count("finished") == 1, (tid, hist[tid])
        i = kinds.index("finished")
        assert hist[tid][i][1] == victim, (tid, hist[tid])
        after = kinds[i + 1 :]
        assert "routed" not in after, (tid, hist[tid])
        assert set(after) <= {"released", "dropped"}, (tid, hist[tid])
    assert routes_out_of_queue(hist) == []


def test_every_admitted_trajectory_is_consumed_or_dropped_with_a_reason(
    lost: dict[str, Any],
) -> None:
    assert_ledger_balances(lost["ledger"], BATCH * GROUP)
    assert lost["ledger"]["steps_done"] == STEPS
    assert lost["summary"]["counters"]["instances_lost"] == 1
