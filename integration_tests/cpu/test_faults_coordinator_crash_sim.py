"""Coordinator crashes (no handover) on the real deployment with sim engines: Ray, the TS over
TCP, the NIXL param server, the real trainer; only the engines are simulated, so one run can
crash the coordinator at every write-ahead point within a minute or two.

The control actor is killed four times in one run — ``ray.kill`` while the trainer trains a
batch (the replacement re-issues it; the trainer must not train it twice), and ``os._exit`` at the three crash points of the control shell (after a
batch of events is journaled, before any of its effects; midway through an event's effects;
before a checkpoint is written). Each time the driver replaces it from
the write-ahead journal and the run goes on. Then: the run completed its steps, no trajectory
was routed twice, the ledger balances (every admitted trajectory consumed once, in flight, or
dropped with a reason), consumed staleness <= eta, and no step was trained twice (trainer
version = steps, metrics rows 1..steps exactly once, each batch trained once).

Two more tests: the driver's check of the rollout actors before a replacement starts (hung
and dead ones are killed), and a crash while one instance's sync hangs (the replacement waits
for it within its limits only, then kills and loses it).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
from fault_checks import assert_ledger_balances, run_watched
from tiny_setup import tiny_config
from waiting import wait_for

from staleflow_trainer.actors.fault_hooks import CRASH_RECORD
from trajectory_server import routes_out_of_queue

pytestmark = [pytest.mark.fault, pytest.mark.ray, pytest.mark.sim, pytest.mark.timeout(600)]

# the crashes are armed from the driver's step records (read every 0.5 s), so each lands a few
# steps after its plan's step (the loop runs a short step in tenths of a second): enough
# steps that the last one still finds a checkpoint to hit (each is armed only once the last
# one's replacement runs, and the points after_journal and mid_effects are reached at once)
BATCH, GROUP, ETA, STEPS = 4, 4, 1, 32


@pytest.fixture(scope="module")
def crashed(
    ray_session: None,
    tmp_path_factory: pytest.TempPathFactory,
    engine_required: Callable[[str], None],
) -> dict[str, Any]:
    engine_required("sim")
    import ray

    from staleflow_trainer.report.metrics import read_jsonl
    from staleflow_trainer.runtime.wiring import Deployment

    run_dir = tmp_path_factory.mktemp("coord_crash_sim")
    cfg = tiny_config(
        run_dir,
        f"trainer.steps={STEPS}",
        "run.checkpoint_every=3",
        "run.resume=never",
        "run.coordinator_restarts=4",
        f"protocol.batch_size={BATCH}",
        f"protocol.group_size={GROUP}",
        f"protocol.eta={ETA}",
        "rollout.sampling.max_new_tokens=6",
        "sim.workload.response_len_median=4",
        backend="sim",
    )
    out: dict[str, Any] = {"crashes": []}
    rng = random.Random(0)
    dep = Deployment(cfg).start()

    def kill_now() -> None:  # ray.kill while the trainer trains a batch, instances generating
        deadline = time.monotonic() + 60
        while not ray.get(dep.trainer.busy.remote()) and time.monotonic() < deadline:
            time.sleep(rng.uniform(0.001, 0.005))
        ray.kill(dep.coordinator, no_restart=True)
        out["crashes"].append("ray.kill")

    def arm(point: str) -> Callable[[], None]:
        def go() -> None:
            # the loop may reach the point before Ray sends the reply: the crash record in the
            # run directory (checked by the tests) then says which exit it was
            with contextlib.suppress(ray.exceptions.ActorDiedError):
                ray.get(dep.coordinator.inject_crash.remote(point))
            out["crashes"].append(point)

        return go

    plan = [
        (2, kill_now),
        (3, arm("after_journal")),
        (4, arm("mid_effects")),
        (5, arm("before_checkpoint")),
    ]

    def on_record(rec: dict[str, Any]) -> None:
        # one crash at a time: the next only once the last one's replacement runs (records of
        # a crashed coordinator may still arrive in the same batch)
        crash_pending = len(dep.coordinator_crashes) < len(out["crashes"])
        if plan and int(rec["step"]) >= plan[0][0] and not crash_pending:
            plan.pop(0)[1]()

    try:
        out["summary"] = dep.run(on_record=on_record)
        out["ledger"] = dep.ledger()
        out["histories"] = ray.get(dep.coordinator.histories.remote())
        out["replacements"] = list(dep.coordinator_crashes)
        out["trainer_version"] = ray.get(dep.trainer.version.remote())
        out["trained"] = ray.get(dep.trainer.trained.remote())
        out["wal"] = ray.get(dep.coordinator.wal_stats.remote())
    finally:
        dep.close()
    out["metrics"] = read_jsonl(run_dir / "metrics.jsonl")
    record = run_dir / CRASH_RECORD
    out["injected"] = record.read_text().split() if record.exists() else []
    return out


def test_every_crash_was_replaced_and_the_run_completed(crashed: dict[str, Any]) -> None:
    assert crashed["crashes"] == ["ray.kill", "after_journal", "mid_effects", "before_checkpoint"]
    # the three armed crashes were the process exiting at its point, not some other death
    assert crashed["injected"] == ["after_journal", "mid_effects", "before_checkpoint"]
    assert len(crashed["replacements"]) == 4
    assert all(r["recovered"] for r in crashed["replacements"])
    # each replacement replayed the journal written since the last checkpoint
    assert all(r["replayed"] > 0 for r in crashed["replacements"])
    assert crashed["summary"]["steps_done"] == STEPS


def test_no_step_trained_twice_or_lost(crashed: dict[str, Any]) -> None:
    # the first crash hit a batch in training: its replacement re-issued that batch, which the
    # trainer must answer from its record of the step, not train again
    assert crashed["replacements"][0]["training"] is not None, crashed["replacements"][0]
    assert crashed["trainer_version"] == STEPS
    # what the trainer itself trained (a replayed step is not retrained): each version once,
    # and no trajectory in two batches
    assert [v for v, _ in crashed["trained"]] == list(range(STEPS))
    ids = [t for _, batch in crashed["trained"] for t in batch]
    assert len(ids) == len(set(ids)) == STEPS * BATCH * GROUP
    assert [r["step"] for r in crashed["metrics"]] == list(range(1, STEPS + 1))
    for r in crashed["metrics"]:
        assert 0 <= r["max_staleness"] <= ETA
        assert sum(r["staleness_hist"].values()) == BATCH * GROUP


def test_ledger_balances_and_nothing_routed_twice(crashed: dict[str, Any]) -> None:
    led = crashed["ledger"]
    assert led["problems"] == []
    assert led["consumed"] == STEPS * BATCH * GROUP
    assert (
        led["consumed"] + led["in_flight"] + led["waiting_consume"] + led["dropped"]
        == led["trajectories"]
    )
    assert all(reason and reason != "?" for reason in led["dropped_reasons"])
    assert routes_out_of_queue(crashed["histories"]) == []


def test_the_journal_was_written(crashed: dict[str, Any]) -> None:
    wal = crashed["wal"]
    assert wal["appends"] > 0 and wal["bytes"] > 0


def test_instances_that_do_not_answer_at_a_replacement_are_killed(ray_session: None) -> None:
    """Before a new control actor recovers, the driver asks every rollout actor whether it is
    there, all at once within ``coordinator.call_timeout_s``. A dead one is left out; one that
    does not answer is killed as well, so that it cannot hold its resources or write beside
    the instance that replaces it."""
    import asyncio

    import ray

    from staleflow_trainer.actors.liveness import unresponsive_actors

    @ray.remote(num_cpus=0)
    class Peer:
        def __init__(self, hang_s: float) -> None:
            self.hang_s = hang_s

        async def stats(self) -> dict[str, Any]:
            await asyncio.sleep(self.hang_s)
            return {}

    peers = {"ok": Peer.remote(0.0), "hung": Peer.remote(600.0), "hung2": Peer.remote(600.0),
             "dead": Peer.remote(0.0), "slow": Peer.remote(1.0)}  # fmt: skip
    ray.get([h.__ray_ready__.remote() for h in peers.values()])
    ray.kill(peers["dead"], no_restart=True)
    # ray.kill is asynchronous: on a loaded machine a call made at once can still be answered
    # by the actor before it goes, so wait until it is gone before asking
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(peers["dead"].stats.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the killed actor still answers after 60 s")
    t0 = time.monotonic()
    gone = unresponsive_actors(peers, 3.0)
    assert time.monotonic() - t0 < 5.5  # one 3 s wait for all, not one per hung actor
    assert set(gone) == {"hung", "hung2", "dead"}, gone
    assert gone["hung"] == "no answer within coordinator.call_timeout_s=3 s"
    assert "Died" in gone["dead"] or "died" in gone["dead"], gone["dead"]
    for name in ("hung", "hung2"):
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(peers[name].stats.remote(), timeout=60)
    assert ray.get(peers["ok"].stats.remote(), timeout=60) == {}
    assert unresponsive_actors({}, 1.0) == {}


#: the limits of the test below: a recovery waits at most their sum for an instance's quiesce
HUNG_SYNC_TIMEOUT_S, HUNG_CALL_TIMEOUT_S = 10.0, 6.0


def test_a_replacement_does_not_wait_for_an_instance_whose_sync_hangs(
    ray_session: None, tmp_path: Any, engine_required: Callable[[str], None]
) -> None:
    """The control actor dies while an instance's sync hangs (its engine is fine, its actor
    answers other calls). The replacement stops every instance before it goes on, and an
    instance stops only once its sync is over: it waits for that one at most
    ``coordinator.sync_timeout_s`` + ``coordinator.call_timeout_s``, then kills its actor and
    loses it, and the run completes on the other instance. Before, the replacement, and so the
    run, waited for it for good."""
    engine_required("sim")
    import ray

    from staleflow_trainer.runtime.wiring import Deployment

    steps = 6
    cfg = tiny_config(
        tmp_path,
        f"trainer.steps={steps}",
        "run.checkpoint_every=0",
        "run.resume=never",
        "run.coordinator_restarts=1",
        f"protocol.batch_size={BATCH}",
        f"protocol.group_size={GROUP}",
        f"protocol.eta={ETA}",
        "rollout.sampling.max_new_tokens=6",
        "sim.workload.response_len_median=4",
        f"coordinator.sync_timeout_s={HUNG_SYNC_TIMEOUT_S}",
        f"coordinator.call_timeout_s={HUNG_CALL_TIMEOUT_S}",
        backend="sim",
    )
    out: dict[str, Any] = {}
    dep = Deployment(cfg).start()
    hung = sorted(dep.rollouts)[0]
    handle = dep.rollouts[hung]
    ray.get(handle.hang_next_sync.remote())

    def on_record(rec: dict[str, Any]) -> None:
        if "crashed" in out:
            return
        wait_for(lambda: ray.get(handle.sync_hanging.remote()), 60, f"{hung}'s sync to hang",
                 every_s=0.05)  # fmt: skip
        ray.kill(dep.coordinator, no_restart=True)  # well within the loop's own sync limit
        out["crashed"] = int(rec["step"])

    try:
        out["summary"] = run_watched(dep, out, 240.0, on_record)
        out["ledger"] = dep.ledger()
        out["lost"] = ray.get(dep.coordinator.lost_instances.remote())
        out["instances"] = ray.get(dep.coordinator.instances.remote())
        out["replacements"] = list(dep.coordinator_crashes)
    finally:
        dep.close()
    assert "stopped_by_watchdog" not in out
    assert out["summary"]["steps_done"] == steps
    assert len(out["replacements"]) == 1
    limit = HUNG_SYNC_TIMEOUT_S + HUNG_CALL_TIMEOUT_S
    # the replacement waited the limit out for the hung one, and not much longer
    assert limit <= out["replacements"][0]["restart_s"] < limit + 30, out["replacements"]
    assert hung not in out["instances"]
    rec = next(x for x in out["lost"] if x["instance_id"] == hung)
    assert rec["error"] == (
        f"{hung!r} quiesce and start did not return within coordinator.sync_timeout_s + "
        f"coordinator.call_timeout_s={limit:g}"
    ), rec
    with pytest.raises(ray.exceptions.RayActorError):  # its actor was killed
        ray.get(handle.stats.remote(), timeout=30)
    assert_ledger_balances(out["ledger"], BATCH * GROUP)
