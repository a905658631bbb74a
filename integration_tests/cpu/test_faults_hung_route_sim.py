"""A rollout instance that stops answering as a route reaches it, on the real deployment with
sim engines: Ray, the trajectory server (TS) over TCP, the real rollout, control, reward and
trainer actors.

After step 1 one instance's next route never returns, before the instance asks the TS for
anything (``hang_next_route``: an instance that froze as the work reached it; its trajectories
stay queued in the TS). A well instance answers a route as soon as the TS handed it the work,
so the route is bounded like a poll: ``coordinator.poll_timeout_s`` after it went out the
control actor kills the instance's actor and loses it, and the route's trajectories, which it
never took, run on the other instance. Before, a route waited ``coordinator.call_timeout_s``
(120 s by default), and the batch that needed its work waited with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from fault_checks import assert_ledger_balances, lost_record, run_watched
from tiny_setup import tiny_config
from waiting import wait_for

from trajectory_server import routes_out_of_queue

pytestmark = [pytest.mark.fault, pytest.mark.ray, pytest.mark.sim, pytest.mark.timeout(300)]

BATCH, GROUP, STEPS = 4, 4, 10
POLL_TIMEOUT_S = 8.0
CALL_TIMEOUT_S = 120.0  # the default: a route once waited this long
WATCHDOG_S = 100.0  # well under CALL_TIMEOUT_S: the old bound would stop the run here


@pytest.fixture(scope="module")
def hung(
    ray_session: None,
    tmp_path_factory: pytest.TempPathFactory,
    engine_required: Callable[[str], None],
) -> dict[str, Any]:
    engine_required("sim")
    import ray

    from staleflow_trainer.runtime.wiring import Deployment

    cfg = tiny_config(
        tmp_path_factory.mktemp("hung_route_sim"),
        f"trainer.steps={STEPS}",
        "run.checkpoint_every=0",
        "run.resume=never",
        f"protocol.batch_size={BATCH}",
        f"protocol.group_size={GROUP}",
        "protocol.eta=1",
        "rollout.sampling.max_new_tokens=48",
        "rollout.max_model_len=80",
        "sim.workload.response_len_median=24",
        f"coordinator.poll_timeout_s={POLL_TIMEOUT_S}",
        f"coordinator.call_timeout_s={CALL_TIMEOUT_S}",
        "trainer.step_delay_s=1.0",
        backend="sim",
    )
    out: dict[str, Any] = {}
    dep = Deployment(cfg).start()

    def on_record(rec: dict[str, Any]) -> None:
        if int(rec["step"]) < 1 or "victim" in out:
            return
        victim = out["victim"] = sorted(dep.rollouts)[0]
        h = dep.rollouts[victim]
        ray.get(h.hang_next_route.remote())
        out["held"] = wait_for(
            lambda: ray.get(h.route_held.remote()), 60, f"a route to reach {victim}", every_s=0.02
        )
        held_at = time.monotonic()  # the route went out just before (bounded by the poll above)
        out["record"] = lost_record(dep, victim, f"the loop to lose {victim}", timeout_s=60)
        out["lost_after_s"] = time.monotonic() - held_at

    try:
        out["summary"] = run_watched(dep, out, WATCHDOG_S, on_record)
        out["ledger"] = dep.ledger()
        out["histories"] = ray.get(dep.coordinator.histories.remote())
    finally:
        dep.close()
    return out


def test_the_instance_is_lost_after_the_poll_timeout_and_the_run_completes(
    hung: dict[str, Any],
) -> None:
    assert "stopped_by_watchdog" not in hung, hung["summary"]["counters"]
    assert hung["summary"]["steps_done"] == STEPS
    rec, victim = hung["record"], hung["victim"]
    assert (
        f"route on {victim!r} did not return within coordinator.poll_timeout_s=8" in rec["error"]
    ), rec
    # lost once the poll limit ran out after the route went out, long before call_timeout_s
    assert POLL_TIMEOUT_S - 1 <= hung["lost_after_s"] < POLL_TIMEOUT_S + 20, hung["lost_after_s"]


def test_the_routes_trajectories_ran_elsewhere(hung: dict[str, Any]) -> None:
    held, rec, hist = hung["held"], hung["record"], hung["histories"]
    assert held
    # never taken from the TS: queued there when the instance was lost, routed again later
    # (to the other instance) or dropped with their group
    assert set(held) <= set(rec["queued"]), (held, rec)
    for tid in held:
        routed = [e[1] for e in hist[tid] if e[0] == "routed"]
        assert hung["victim"] not in routed, (tid, hist[tid])
        assert routed or any(e[0] == "dropped" for e in hist[tid]), (tid, hist[tid])
    assert routes_out_of_queue(hist) == []
    assert_ledger_balances(hung["ledger"], BATCH * GROUP)
