"""``rollout.replace_lost``: the driver starts a new instance in place of a lost one, up to the
limit — on the real deployment with sim engines (Ray, the trajectory server over TCP, the
real rollout, control, reward and trainer actors).

One run with two instances and ``rollout.replace_lost=1``: after step 1 the first instance's
actor is killed; a replacement starts on its own (the driver keeps draining records while its
engine starts), pulls the latest version and joins. Once it has joined, the second original
instance is killed: the limit is spent, so it is not replaced, and the run completes on the
replacement alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fault_checks import assert_ledger_balances
from tiny_setup import tiny_config

pytestmark = [pytest.mark.fault, pytest.mark.ray, pytest.mark.sim, pytest.mark.timeout(600)]

BATCH, GROUP, ETA, STEPS = 4, 4, 1, 20


@pytest.fixture(scope="module")
def replaced(
    ray_session: None,
    tmp_path_factory: pytest.TempPathFactory,
    engine_required: Any,
) -> dict[str, Any]:
    engine_required("sim")
    import ray

    from staleflow_trainer.runtime.wiring import Deployment

    run_dir: Path = tmp_path_factory.mktemp("replace_lost_sim")
    cfg = tiny_config(
        run_dir,
        f"trainer.steps={STEPS}",
        "run.checkpoint_every=0",
        "run.resume=never",
        f"protocol.batch_size={BATCH}",
        f"protocol.group_size={GROUP}",
        f"protocol.eta={ETA}",
        "rollout.num_instances=2",
        "rollout.replace_lost=1",
        "rollout.sampling.max_new_tokens=48",
        "rollout.max_model_len=80",
        "trainer.step_delay_s=0.5",
        "sim.workload.response_len_median=24",
        backend="sim",
    )
    out: dict[str, Any] = {"steps_seen": []}
    dep = Deployment(cfg).start()
    first, second = sorted(dep.rollouts)
    out["first"], out["second"] = first, second

    def on_record(rec: dict[str, Any]) -> None:
        step = int(rec["step"])
        out["steps_seen"].append(step)
        if step >= 1 and "killed_first_at" not in out:
            out["killed_first_at"] = step
            dep.kill_instance(first)
            return
        new = [i for i in dep.rollouts if i not in (first, second)]
        if new and "killed_second_at" not in out:  # the replacement has joined
            out["replacement"] = new[0]
            out["killed_second_at"] = step
            dep.kill_instance(second)

    try:
        out["summary"] = dep.run(on_record=on_record)
        assert dep.replacer is not None
        out["replaced"] = dict(dep.replacer.replaced)
        out["not_replaced"] = list(dep.replacer.not_replaced)
        out["ledger"] = dep.ledger()
        out["histories"] = ray.get(dep.coordinator.histories.remote())
        out["instances"] = ray.get(dep.coordinator.instances.remote())
    finally:
        dep.close()
    return out


def test_the_first_loss_is_replaced_and_the_second_is_not(replaced: dict[str, Any]) -> None:
    first, second = replaced["first"], replaced["second"]
    assert "replacement" in replaced, f"no replacement joined; steps {replaced['steps_seen']}"
    new = replaced["replacement"]
    assert replaced["replaced"] == {first: new}
    assert replaced["not_replaced"] == [second]
    assert replaced["instances"] == [new]
    counters = replaced["summary"]["counters"]
    assert counters["instances_lost"] == 2 and counters["instances_joined"] == 1
    assert replaced["summary"]["steps_done"] == STEPS
    assert replaced["killed_second_at"] < STEPS, "the replacement joined too late to be tested"


def test_the_replacement_ran_work_and_the_ledger_balances(replaced: dict[str, Any]) -> None:
    new = replaced["replacement"]
    routed_there = [
        tid for tid, events in replaced["histories"].items()
        if any(e[0] == "routed" and e[1] == new for e in events)
    ]  # fmt: skip
    assert routed_there, "nothing ran on the replacement"
    assert_ledger_balances(replaced["ledger"], BATCH * GROUP)
    assert replaced["ledger"]["steps_done"] == STEPS
