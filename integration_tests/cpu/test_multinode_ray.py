"""The Ray deployment on a multi-node cluster: several raylets on this machine
(``ray.cluster_utils.Cluster``, loopback), each role placed by its custom resource — a control
node (the control actor, the trajectory server, the parameter server), a rollout node (the
instances) and a trainer node (the trainer, the reward workers) — runs a short training run
unchanged. The trajectory and parameter servers are reached from the other nodes through
their configured bind host and token (the trajectory server with ``allow_remote``).

The reward worker is killed before the run starts: the control process replaces it from the
spec it was given (the tokenizer backend the driver put in the object store included) on the
trainer node, and every score comes from the replacement."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from tiny_setup import tiny_config

pytestmark = [pytest.mark.ray, pytest.mark.sim, pytest.mark.timeout(900)]

STEPS = 2
ROLES = {"control": "sf_control", "rollout": "sf_rollout", "trainer": "sf_trainer",
         "reward": "sf_trainer"}  # fmt: skip


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    # raylets on loopback whatever an earlier module of this process set (Ray's cluster mode
    # would advertise the machine's external address)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    c = None
    for attempt in range(3):  # Ray gives each raylet a fixed 30 s to register: retry when busy
        c = Cluster()
        try:
            c.add_node(num_cpus=1, resources={"sf_control": 1})
            c.add_node(num_cpus=2, resources={"sf_rollout": 1})
            c.add_node(num_cpus=1, resources={"sf_trainer": 1})
            c.wait_for_nodes()
            break
        except Exception as e:
            c.shutdown()
            if "timed out during startup" not in str(e) or attempt == 2:
                raise
    assert c is not None
    try:
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def run(
    cluster: Any,
    tmp_path_factory: pytest.TempPathFactory,
    engine_required: Callable[[str], None],
) -> dict[str, Any]:
    engine_required("sim")
    import ray
    from ray._private import state

    from staleflow_trainer.runtime.wiring import Deployment

    cfg = tiny_config(
        tmp_path_factory.mktemp("multinode"),
        f"trainer.steps={STEPS}",
        "run.checkpoint_every=2",
        "run.resume=never",
        f"ray.address={cluster.address}",
        *(f"ray.{role}_resource={res}" for role, res in ROLES.items()),
        "ray.trajectory_server_host=127.0.0.1",
        "param_server.bind_host=127.0.0.1",
        backend="sim",
    )
    out: dict[str, Any] = {}
    dep = Deployment(cfg).start()
    try:
        ray.kill(dep.rewards[0], no_restart=True)
        out["summary"] = dep.run()
        out["ledger"] = dep.ledger()
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        out["placed"] = [
            (a["ActorClassName"], nodes.get(a["Address"]["NodeID"], {}))
            for a in state.actors().values()
            if a["State"] == "ALIVE"
        ]
        out["reward_actors"] = sorted(
            a["State"] for a in state.actors().values() if a["ActorClassName"] == "RewardActor"
        )
    finally:
        dep.close()
    return out


def test_a_run_completes_on_several_nodes(run: dict[str, Any]) -> None:
    assert run["summary"]["steps_done"] == STEPS
    assert run["ledger"]["problems"] == []
    assert run["ledger"]["consumed"] == STEPS * 8 * 8


def test_a_lost_reward_worker_is_replaced_and_scores_everything(run: dict[str, Any]) -> None:
    assert run["reward_actors"] == ["ALIVE", "DEAD"]
    assert run["summary"]["counters"]["reward_dropped"] == 0


def test_each_role_runs_on_its_node(run: dict[str, Any]) -> None:
    want = {
        "ControlActor": "sf_control",
        "TrajectoryServerActor": "sf_control",
        "ParamServerHost": "sf_control",
        "RolloutActor": "sf_rollout",
        "TrainerActor": "sf_trainer",
        "RewardActor": "sf_trainer",
    }
    seen: dict[str, set[str]] = {}
    for cls, resources in run["placed"]:
        if cls in want:
            seen.setdefault(cls, set()).update(r for r in resources if r.startswith("sf_"))
    assert set(seen) == set(want), run["placed"]
    for cls, res in want.items():
        assert seen[cls] == {res}, (cls, seen[cls])
