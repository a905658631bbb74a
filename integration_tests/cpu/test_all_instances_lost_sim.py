"""Every rollout instance lost and none to replace (``rollout.replace_lost=0``): the run stops
with ``ComponentLost`` naming each loss, on the real deployment with sim engines (Ray, the
trajectory server over TCP, the real rollout, control, reward and trainer actors). Before,
it waited for work that nothing could generate, for ever.

Both instances' actors are killed after step 1. The run must end with the error within
``WATCHDOG_S`` of the kills; the watchdog stops a run that does not (and the test fails)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from fault_checks import run_watched
from tiny_setup import tiny_config

pytestmark = [pytest.mark.fault, pytest.mark.ray, pytest.mark.sim, pytest.mark.timeout(300)]

WATCHDOG_S = 60.0


def test_a_run_left_without_instances_stops_naming_them(
    ray_session: None, tmp_path: Path, engine_required: Any
) -> None:
    engine_required("sim")
    from staleflow_trainer.errors import ComponentLost
    from staleflow_trainer.runtime.wiring import Deployment

    cfg = tiny_config(
        tmp_path,
        "trainer.steps=30",
        "run.checkpoint_every=0",
        "run.resume=never",
        "protocol.batch_size=4",
        "protocol.group_size=4",
        "rollout.num_instances=2",
        "rollout.replace_lost=0",
        "rollout.sampling.max_new_tokens=48",
        "rollout.max_model_len=80",
        "trainer.step_delay_s=0.5",
        "sim.workload.response_len_median=24",
        backend="sim",
    )
    out: dict[str, Any] = {}
    dep = Deployment(cfg).start()
    victims = sorted(dep.rollouts)

    def on_record(rec: dict[str, Any]) -> None:
        if int(rec["step"]) >= 1 and "killed_at" not in out:
            out["killed_at"] = time.monotonic()
            for iid in victims:
                dep.kill_instance(iid)

    try:
        with pytest.raises(ComponentLost) as info:
            run_watched(dep, out, WATCHDOG_S, on_record)
        out["ended_at"] = time.monotonic()
    finally:
        dep.close()
    assert "stopped_by_watchdog" not in out, "the run did not stop when no instance was left"
    assert info.value.component == "rollout"
    msg = str(info.value)
    assert all(f"{iid}: " in msg for iid in victims), msg
    assert "of rollout.replace_lost=0 replacements" in msg
    assert out["ended_at"] - out["killed_at"] < WATCHDOG_S
