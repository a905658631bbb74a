"""The five faults on the real deployment: Ray, 2 vLLM-CPU instances, NIXL param
server (2 storage workers, every slice on both), the trajectory server over TCP with a token.

One scenario shares one deployment for faults 1, 2, 3 and 5, then fault 4 restarts the whole
app from its last checkpoint (about 4-5 minutes here in all):

* reward plug-in ``staleflow_trainer.reward.testing:raise_or_hang`` all along (fault 5);
* after step 1: SIGKILL-equivalent ``ray.kill`` of a rollout instance while it generates, then a
  replacement joins (fault 1);
* after step 3, just before fault 3: SIGKILL of the other original instance's vLLM EngineCore
  process, its rollout actor alive: the actor ends its own process and the loop loses the
  instance (fault 1b);
* after step 2: a PS storage worker is killed; the next push fails and is retried; a pull of
  the latest version still succeeds from the replica; the worker restarts (fault 2);
* after step 3: the coordinator actor hands over and is replaced (fault 3, graceful);
* after step 4: the coordinator actor is ``ray.kill``-ed while a training step is in flight,
  with no handover; the driver replaces it from its write-ahead journal (fault 3, crash);
* after step 6: the loop is held right after a step completes (checkpoint written, no step
  running), the trainer is killed there, between steps; the run stops with ComponentLost; a new
  deployment resumes from the last checkpoint and trains two more steps (fault 4).

Each test then asserts one fault's contract plus the ledger check (every admitted trajectory
consumed, in flight or dropped with a reason; none counted twice; consumed staleness <= eta).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fault_checks import assert_ledger_balances, lost_record
from security_probe import own_listeners, probe_security
from tiny_setup import tiny_config
from waiting import wait_for

from trajectory_server import routes_out_of_queue

pytestmark = [
    pytest.mark.fault,
    pytest.mark.ray,
    pytest.mark.vllm,
    pytest.mark.nixl,
    pytest.mark.timeout(900),
]

BATCH, GROUP, ETA = 4, 4, 1
PER_STEP = BATCH * GROUP
#: how the parameter server refuses a push while a storage worker is down
DOWN = "storage workers are down"
# run 1 never reaches its target: the trainer kill (fault 4) ends it, whatever step the loop
# (which keeps training while the driver injects a fault) has reached by then
STEPS_RUN1, MORE_STEPS, CKPT_EVERY = 10_000, 2, 2


def _overrides(run_dir: Path, steps: int, resume: str) -> list[str]:
    return [
        f"trainer.steps={steps}",
        f"run.checkpoint_every={CKPT_EVERY}",
        f"run.resume={resume}",
        f"protocol.batch_size={BATCH}",
        f"protocol.group_size={GROUP}",
        f"protocol.eta={ETA}",
        "reward.fn=staleflow_trainer.reward.testing:raise_or_hang",
        "reward.retries=1",
        "reward.timeout_s=0.3",
        "reward.num_workers=2",
        "param_server.num_workers=2",
        "param_server.replication=2",
    ]


def _scenario(run_dir: Path, tiny_config: Callable[..., Any]) -> dict[str, Any]:
    import ray

    from staleflow_trainer.actors.reconcile import (
        STATE_FILE,
        TRAINER_FILE,
        TS_FILE,
        latest_checkpoint,
    )
    from staleflow_trainer.actors.trainer_actor import digest_of
    from staleflow_trainer.data import load_records
    from staleflow_trainer.errors import ComponentLost
    from staleflow_trainer.report.metrics import read_jsonl
    from staleflow_trainer.runtime.wiring import Deployment
    from staleflow_trainer.trainer.checkpoint import load_torch, read_verified_bytes
    from trajectory_server.checkpoint import load_checkpoint

    out: dict[str, Any] = {"listeners_before": own_listeners()}
    t0 = time.monotonic()
    dep = Deployment(tiny_config(run_dir, *_overrides(run_dir, STEPS_RUN1, "never"))).start()
    out["start_s"] = time.monotonic() - t0
    out["security"] = probe_security(dep, out["listeners_before"])
    done: set[int] = set()

    def fault1() -> None:  # kill a rollout instance mid-generation; a replacement joins
        victim = sorted(dep.rollouts)[-1]
        # its next poll while it generates is held before it writes anything back: the kill
        # lands mid-generation every time (responses are 3 tokens: a kill timed from outside
        # can find everything already written back)
        ray.get(dep.rollouts[victim].hold_poll_with_work.remote())
        working = wait_for(
            lambda: ray.get(dep.rollouts[victim].poll_held.remote()), 120, f"{victim} to generate"
        )
        held = ray.get(dep.coordinator.held_by.remote(victim))
        dep.kill_instance(victim)
        lost = lost_record(dep, victim, "the loop to notice the lost instance")
        out["f1"] = {"victim": victim, "working": working, "held": held, "lost": lost}
        # the groups known now: the run's later coordinator replacements forget settled ones
        out["f1"]["groups"] = ray.get(dep.coordinator.groups.remote())
        out["f1"]["published_before_join"] = ray.get(dep.ps.status.remote())["latest"]
        new = dep.add_instance()
        out["f1"]["replacement"] = new
        probe = ray.get(dep.rollouts[new].probe.remote([1, 2], 1))
        out["f1"]["replacement_version"] = probe["version"]

    def fault1b() -> None:  # kill a vLLM EngineCore under its live rollout actor
        victim = next(i for i in sorted(dep.rollouts) if i != out["f1"]["replacement"])
        h = dep.rollouts[victim]
        try:
            pids = ray.get(h.kill_engine.remote())
        except ray.exceptions.RayActorError:  # it ended itself before the answer left
            pids = None
        lost = lost_record(dep, victim, "the loop to notice the dead engine")
        try:
            ray.get(h.stats.remote(), timeout=10)
            alive = True
        except Exception:
            alive = False
        out["f1b"] = {"victim": victim, "pids": pids, "lost": lost, "actor_alive": alive}

    def fault2() -> None:  # kill a PS storage worker; push fails, pull from replica works
        before = len(ray.get(dep.trainer.push_failures.remote()))
        dep_ps_status = ray.get(dep.ps.status.remote())
        ray.get(dep.ps.kill_worker.remote("w1"))

        # a push in flight when the worker died fails with the connection or the staged
        # version it lost; the trainer retries every 0.5 s, and a retry while w1 is down is
        # refused up front, naming it
        def refused_down() -> list[dict[str, Any]] | None:
            got = ray.get(dep.trainer.push_failures.remote())[before:]
            return got if any(DOWN in f["error"] for f in got) else None

        failures = wait_for(refused_down, 120, "a push refused while the worker is down")
        status_down = ray.get(dep.ps.status.remote())
        live = sorted(dep.rollouts)[0]
        pulled = ray.get(dep.rollouts[live].check_pull.remote(None))
        ray.get(dep.ps.restart_worker.remote("w1"))
        out["f2"] = {
            "status_before": dep_ps_status,
            "status_down": status_down,
            "failures": failures,
            "pulled_while_down": pulled,
        }

    def fault3() -> None:  # replace the coordinator actor
        out["f3"] = {
            "info": dep.restart_coordinator(),
            "protocol_after": dep.protocol_state(),
        }

    def fault3_crash() -> None:  # kill the coordinator mid-step, no handover
        # responses are 3 tokens, so instances are mostly idle between steps; the moment that
        # always comes is a training step in flight: kill the coordinator then. Watched from a
        # thread, so that run() goes on driving the loop (a coordinator replaced by fault 3 in
        # the same batch of records only starts once this callback returns).
        after = max(done)

        def watch() -> None:
            busy = False
            deadline = time.monotonic() + 120
            while not busy and time.monotonic() < deadline:
                busy = bool(ray.get(dep.trainer.busy.remote()))
                if not busy:
                    time.sleep(0.005)
            out["f3c"] = {"after_step": after, "trainer_busy": busy}
            ray.kill(dep.coordinator, no_restart=True)  # run() notices and replaces it

        threading.Thread(target=watch, daemon=True).start()

    def fault4() -> None:  # kill the trainer between two steps
        held = dep.hold_between_steps()
        out["f4_hold"] = {
            **held,
            "trainer_busy": ray.get(dep.trainer.busy.remote()),
            "trainer_version": ray.get(dep.trainer.version.remote()),
        }
        out["f4_killed_after_step"] = held["steps_done"]
        out["trained1"] = ray.get(dep.trainer.trained.remote())
        ray.kill(dep.trainer, no_restart=True)
        dep.release_hold()

    plan = {1: fault1, 2: fault2, 2.5: fault1b, 3: fault3, 4: fault3_crash, 6: fault4}

    def on_record(rec: dict[str, Any]) -> None:
        done.add(int(rec["step"]))
        for step, fn in plan.items():
            if step == 6 and not dep.coordinator_crashes:
                continue  # records of the killed coordinator still arriving: wait for the new one
            if int(rec["step"]) >= step and f"ran{step}" not in out:
                out[f"ran{step}"] = True
                fn()

    try:
        try:
            dep.run(on_record=on_record)
            out["run1_error"] = None
        except Exception as e:  # the trainer kill must end the run with ComponentLost
            out["run1_error"] = e
        out["ledger1"] = dep.ledger()
        out["histories1"] = ray.get(dep.coordinator.histories.remote())
        # each group's ground truth: which groups the reward plug-in drops is a function of it
        records = load_records(dep.cfg)
        rows = {**out.get("f1", {}).get("groups", {}), **ray.get(dep.coordinator.groups.remote())}
        out["truth1"] = {gid: records[row].ground_truth for gid, row in rows.items()}
        out["summary1"] = ray.get(dep.coordinator.summary.remote())
        out["final_instances"] = ray.get(dep.coordinator.instances.remote())
        out["crash_replacements"] = list(dep.coordinator_crashes)
        out["wal1"] = ray.get(dep.coordinator.wal_stats.remote())
    finally:
        dep.close()
    out["run1_s"] = time.monotonic() - t0
    out["component_lost"] = ComponentLost
    out["metrics1"] = read_jsonl(run_dir / "metrics.jsonl")

    # what run 1 saw, for whoever reads a failure (pytest keeps the last runs' directories)
    (run_dir / "scenario_run1.json").write_text(json.dumps(out, default=repr, indent=1))

    # fault 4: the whole app restarts from the last checkpoint
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:  # run 1 ended before its first checkpoint: say why, not just "None"
        raise AssertionError(f"run 1 wrote no checkpoint; it ended with {out['run1_error']}")
    out["ckpt"] = ckpt
    state = json.loads(read_verified_bytes(ckpt / STATE_FILE))
    payload = load_torch(ckpt / TRAINER_FILE)
    out["ckpt_state"] = state
    out["ckpt_digest"] = digest_of(payload["model"], payload["optimizer"], payload["version"])
    ts_ckpt = load_checkpoint(ckpt / TS_FILE)
    out["ckpt_ts_ledger"] = {k: v.state.value for k, v in ts_ckpt.ledger().items()}
    t1 = time.monotonic()
    out["steps2"] = steps2 = int(state["steps_done"]) + MORE_STEPS
    dep2 = Deployment(tiny_config(run_dir, *_overrides(run_dir, steps2, "must"))).start()
    try:
        out["resumed_from"] = dep2.resume_dir
        restored = ray.get(dep2.coordinator.restored.remote())
        out["resumed_protocol"] = restored["protocol"]
        out["resumed_digest"] = ray.get(dep2.trainer.state_digest.remote())
        out["resumed_groups_at_start"] = restored["groups"]
        out["summary2"] = dep2.run()
        out["ledger2"] = dep2.ledger()
        out["groups2"] = ray.get(dep2.coordinator.groups.remote())
        out["histories2"] = ray.get(dep2.coordinator.histories.remote())
        out["trained2"] = ray.get(dep2.trainer.trained.remote())
    finally:
        dep2.close()
    out["run2_s"] = time.monotonic() - t1
    out["metrics2"] = read_jsonl(run_dir / "metrics.jsonl")
    return out


@pytest.fixture(scope="module")
def sc(
    ray_session: None,
    tmp_path_factory: pytest.TempPathFactory,
    engine_required: Callable[[str], None],
) -> dict[str, Any]:
    engine_required("vllm")
    return _scenario(tmp_path_factory.mktemp("faults_vllm"), tiny_config)


# ------------------------------------------------------------------------------ routes check


def assert_never_routed_twice(histories: dict[str, list[list[Any]]], lost: set[str]) -> None:
    """From the TS ledger: a trajectory is routed only from the queue (submitted, returned or
    lost before) — so never to two instances at once, and never after it finished/dropped —
    and no instance receives a route after it was lost (as far as the TS dates the loss: by
    its ``lost`` events; an instance lost holding nothing there has none)."""
    lost_at = {
        iid: min(e[3] for evs in histories.values() for e in evs
                 if e[0] == "lost" and e[1] == iid)
        for iid in lost
        if any(e[0] == "lost" and e[1] == iid for evs in histories.values() for e in evs)
    }  # fmt: skip
    assert routes_out_of_queue(histories) == []
    for tid, events in histories.items():
        for kind, instance, _version, seq in events:
            if kind == "routed":
                assert seq < lost_at.get(instance, seq + 1), f"{tid} routed to lost {instance}"


def assert_staleness_bounded(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        assert 0 <= r["max_staleness"] <= ETA
        assert all(0 <= int(s) <= ETA for s in r["staleness_hist"])
        assert sum(r["staleness_hist"].values()) == BATCH * GROUP


# ------------------------------------------------------------------------------------ tests


def test_fault1_instance_killed_mid_generation(sc: dict[str, Any]) -> None:
    f1 = sc["f1"]
    victim, lost = f1["victim"], f1["lost"]
    # what it held went back to the queue (a LOST event in the TS for each), reservations kept
    assert lost["requeued"], "the killed instance was generating"
    # what it was generating or had not written back when it died was running there in the TS
    assert set(f1["working"]) <= set(f1["held"]) == set(lost["requeued"])
    for tid in lost["requeued"]:
        kinds = [e[0] for e in sc["histories1"][tid]]
        assert "lost" in kinds
        i = kinds.index("lost")
        assert sc["histories1"][tid][i][1] == victim
    # the coordinator stopped routing to it; the replacement joined at the published version
    assert victim not in sc["final_instances"]
    assert f1["replacement"] in sc["final_instances"]
    assert f1["replacement_version"] >= f1["published_before_join"]
    assert sc["summary1"]["counters"]["instances_lost"] == 2  # this one and fault 1b's
    assert sc["summary1"]["counters"]["instances_joined"] == 1
    assert_never_routed_twice(sc["histories1"], {victim})
    assert_ledger_balances(sc["ledger1"], PER_STEP, crashed_mid_step=True)
    # every requeued trajectory was taken up again after the loss: routed to a live instance
    # (and from there trained or dropped with a reason). The one excuse for never being routed
    # again is its group's reward failing (the plug-in drops every group whose ground truth it
    # fails on, a pure function of the data): "dropped" alone would also pass a trajectory
    # forgotten in the queue and later aborted as a straggler, or dropped with its group
    from staleflow_trainer.reward.testing import failure_kind

    for tid in lost["requeued"]:
        kinds = [e[0] for e in sc["histories1"][tid]]
        after = kinds[kinds.index("lost") + 1 :]
        if "routed" not in after:
            gid = tid.rsplit("/", 1)[0]
            assert gid in sc["truth1"], (tid, "never routed again; its group is unknown", kinds)
            truth = sc["truth1"][gid]
            assert "dropped" in after and failure_kind(truth) is not None, (tid, truth, kinds)
        for e in sc["histories1"][tid][kinds.index("lost") + 1 :]:
            if e[0] == "routed":
                assert e[1] != victim, (tid, e)


def test_fault1b_engine_process_killed_under_a_live_actor(sc: dict[str, Any]) -> None:
    f = sc["f1b"]
    victim, lost = f["victim"], f["lost"]
    assert f["pids"] is None or len(f["pids"]) == 1, f["pids"]  # its one EngineCore
    assert not f["actor_alive"]  # the actor ended its own process
    assert victim not in sc["final_instances"]
    assert "f1" in sc and sc["f1"]["replacement"] in sc["final_instances"]
    assert_never_routed_twice(sc["histories1"], {sc["f1"]["victim"], victim})
    # what it held in the TS went back to the queue and ran on the live instance
    for tid in lost["requeued"]:
        events = sc["histories1"][tid]
        at = max(i for i, e in enumerate(events) if e[0] == "lost" and e[1] == victim)
        after = events[at + 1 :]
        assert any(e[0] in ("routed", "dropped") for e in after), (tid, events)
        assert all(e[1] != victim for e in after if e[0] == "routed"), (tid, events)


def test_fault2_storage_worker_killed(sc: dict[str, Any]) -> None:
    f2 = sc["f2"]
    assert f2["status_down"]["dead"] == ["w1"]
    # the push failed with a clear error, and was retried until the worker came back: a
    # retry while it was down was refused up front, naming it (a push in flight when it died
    # failed first with the connection or the staged version it lost)
    assert any(DOWN in f["error"] and "workers=['w1']" in f["error"] for f in f2["failures"]), f2[
        "failures"
    ]
    assert all(f["error"].split(":")[0] in ("PushFailed", "WorkerLost", "TransferFailed")
               for f in f2["failures"])  # fmt: skip
    failed_version = f2["failures"][0]["version"]
    assert sc["summary1"]["version"] >= failed_version  # it was pushed after the restart
    # the latest complete version stayed pullable from the replica while w1 was down
    assert f2["pulled_while_down"]["version"] == f2["status_down"]["latest"]
    assert f2["pulled_while_down"]["nbytes"] > 0
    # no partial version was ever published: the failed version was not complete while down
    assert f2["status_down"]["latest"] < failed_version
    assert failed_version not in f2["status_down"]["versions"]
    assert_ledger_balances(sc["ledger1"], PER_STEP, crashed_mid_step=True)


def test_fault3_coordinator_restarted(sc: dict[str, Any]) -> None:
    f3 = sc["f3"]
    assert f3["info"]["steps_done"] >= 3
    assert f3["info"]["version"] == f3["info"]["steps_done"]
    # the new coordinator kept training after the restart (steps 4 and 5 ran before fault 4)
    assert sc["f4_killed_after_step"] >= 5
    assert_never_routed_twice(sc["histories1"], {sc["f1"]["victim"]})
    assert_ledger_balances(sc["ledger1"], PER_STEP, crashed_mid_step=True)
    assert_staleness_bounded(sc["metrics1"])


def test_fault3_coordinator_crashed_replaced_from_its_journal(sc: dict[str, Any]) -> None:
    """ray.kill while a training step runs, no handover: the driver replaced it from the
    write-ahead journal, the step was not trained twice, the run went on, nothing was routed
    twice or lost, staleness stayed <= eta."""
    f3c = sc["f3c"]
    assert f3c["trainer_busy"], "the kill landed while the trainer trained"
    (rep,) = sc["crash_replacements"]
    assert rep["recovered"] and rep["steps_done"] >= f3c["after_step"]
    assert "ActorDied" in rep["error"] or "RayActorError" in rep["error"], rep["error"]
    # the batch in training was in the journal (unless the step landed and was committed in
    # the moment between seeing the trainer busy and the kill); the replacement finished it
    # exactly once (step records 1..k below; the trainer's idempotent train_step)
    assert rep["training"] in (None, rep["steps_done"])
    # the loop kept training after the crash (fault 4 came later, from the new coordinator)
    assert sc["f4_killed_after_step"] > f3c["after_step"]
    assert [r["step"] for r in sc["metrics1"]] == list(range(1, sc["f4_killed_after_step"] + 1))
    assert_never_routed_twice(sc["histories1"], {sc["f1"]["victim"]})
    assert_ledger_balances(sc["ledger1"], PER_STEP, crashed_mid_step=True)
    assert_staleness_bounded(sc["metrics1"])
    assert sc["wal1"]["appends"] > 0
    # what the trainer itself trained (replayed steps not counted): each consumed version once,
    # in order, and no trajectory in two batches — a batch consumed twice would show here
    versions = [v for v, _ in sc["trained1"]]
    assert versions == list(range(sc["f4_killed_after_step"])), versions
    ids = [t for _, batch in sc["trained1"] for t in batch]
    assert len(ids) == len(set(ids)) == len(versions) * BATCH * GROUP


def test_fault4_trainer_killed_app_resumes_exactly(sc: dict[str, Any]) -> None:
    err = sc["run1_error"]
    assert err is not None and "ComponentLost" in repr(err) and "trainer" in str(err)
    # the kill landed between steps: the loop was held after step k (its checkpoint written if
    # due), no step was running, the trainer was at version k, and no step k+1 completed
    hold = sc["f4_hold"]
    assert hold["train_in_flight"] is False and hold["trainer_busy"] is False
    assert hold["trainer_version"] == hold["version"] == hold["steps_done"]
    assert sc["summary1"]["steps_done"] == hold["steps_done"]
    assert max(r["step"] for r in sc["metrics1"]) == hold["steps_done"]
    ckpt: Path = sc["ckpt"]
    assert Path(sc["resumed_from"]) == ckpt
    state = sc["ckpt_state"]
    assert ckpt.name == f"step_{state['steps_done']:06d}"
    assert state["steps_done"] >= 4 and state["steps_done"] % CKPT_EVERY == 0
    # model, optimizer, protocol come back exactly
    assert sc["resumed_digest"] == sc["ckpt_digest"]
    assert sc["resumed_protocol"] == state["protocol"]
    # the trajectory store: every trajectory the checkpoint knew is still known, same state
    # (those running at checkpoint time are back in the queue)
    ckpt_groups = {gid: row for gid, row, *_ in state["ledger"]["groups"]}
    assert sc["resumed_groups_at_start"] == ckpt_groups
    # prompt feed: groups submitted after the resume continue the checkpoint's feed exactly
    from staleflow_trainer.control.feed import PromptFeed

    feed = PromptFeed.from_dict(state["feed"])
    later = sorted(g for g in sc["groups2"] if g not in ckpt_groups)
    assert later, "the resumed run fed new prompts"
    assert min(later) == f"g{feed.serial:06d}"  # no group id reused or skipped
    assert [sc["groups2"][g] for g in later] == [feed.next_group()[1] for _ in later]
    # the resumed run completed; staleness stayed bounded; the ledger balances
    assert sc["summary2"]["steps_done"] == sc["steps2"]
    assert [r["step"] for r in sc["metrics2"]] == list(range(1, sc["steps2"] + 1))
    assert_staleness_bounded(sc["metrics2"])
    assert_ledger_balances(sc["ledger2"], PER_STEP)
    assert_never_routed_twice(sc["histories2"], set())
    resumed_ts = {t for t in sc["histories2"]}
    assert set(sc["ckpt_ts_ledger"]) <= resumed_ts


def test_fault5_reward_raises_or_hangs(sc: dict[str, Any]) -> None:
    from staleflow_trainer.reward.testing import failure_kind

    failed: dict[str, int] = {}
    for key in ("ledger1", "ledger2"):
        reasons = sc[key]["dropped_reasons"]
        for r, n in reasons.items():
            if r.startswith("reward_failed"):
                failed[r] = failed.get(r, 0) + n
    assert failed, "no reward-dropped trajectories"
    assert any("error: ValueError" in r for r in failed), failed  # raised, retried, dropped
    assert any("timeout" in r for r in failed), failed  # hung, abandoned, dropped
    assert_ledger_balances(sc["ledger1"], PER_STEP, crashed_mid_step=True)
    assert_ledger_balances(sc["ledger2"], PER_STEP)
    assert sc["summary1"]["counters"]["reward_dropped"] > 0
    # the run went on regardless (its steps completed), and the plug-in is deterministic
    assert sc["summary2"]["steps_done"] == sc["steps2"]
    assert failure_kind("3") == failure_kind("4") == "raise"
    assert failure_kind("7") == failure_kind("9") == "hang"
    assert failure_kind("5") is None


def test_security_loopback_and_tokens(sc: dict[str, Any]) -> None:
    sec = sc["security"]
    assert sec["ts"][0] == "127.0.0.1" and sec["ps"][0] == "127.0.0.1"
    assert sec["ts_without_token"] != "accepted" and "token" in sec["ts_without_token"].lower()
    assert sec["ps_wrong_token"] != "accepted" and "token" in sec["ps_wrong_token"].lower()
    # an unauthenticated 16 MiB frame is refused from its header, naming the 4 KiB limit
    assert "MessageTooLarge" in sec["ts_hostile_frame"] and "4096" in sec["ts_hostile_frame"]
    assert "ProtocolError" in sec["ps_hostile_frame"] and "4096" in sec["ps_hostile_frame"]
    # 200 silent connections: the real client is served, and the server closed the silent
    # ones beyond its cap of 32 waiting connections
    for key in ("ts_flood", "ps_flood"):
        assert sec[key]["served"] is True, (key, sec[key])
        assert sec[key]["closed_by_server"] >= 200 - 32, (key, sec[key])
    # Ray (GCS, raylet, workers, agents), the actors, the engines and the PS storage workers'
    # NIXL/UCX endpoints: nothing listens beyond loopback
    assert sec["listening_processes"] > 5
    assert sec["non_loopback_listeners"] == [], sec["non_loopback_listeners"]
    # and the check is live: a listener on all interfaces opened during the run is caught
    assert len(sec["canary"]) == 1, sec["canary"]


def test_every_checkpoint_file_is_verified_on_load(sc: dict[str, Any], tmp_path: Path) -> None:
    """Each file the app writes into a checkpoint is checksummed and a flipped byte is
    refused on load, naming the file; a damaged ``latest`` pointer is passed over."""
    import shutil

    from staleflow_trainer.actors.reconcile import (
        RECORDS_FILE,
        STATE_FILE,
        TRAINER_FILE,
        TS_FILE,
        latest_checkpoint,
    )
    from staleflow_trainer.errors import CheckpointError
    from staleflow_trainer.trainer.checkpoint import load_torch, read_verified_bytes
    from trajectory_server.checkpoint import load_checkpoint
    from trajectory_server.errors import CheckpointCorrupt

    src: Path = sc["ckpt"]
    files = sorted(p.name for p in src.iterdir())
    data_files = [f for f in files if not f.endswith(".sha256")]
    assert set(data_files) == {TRAINER_FILE, STATE_FILE, TS_FILE, RECORDS_FILE}
    for f in data_files:  # a side checksum, or (the TS store) one in its own header
        assert f"{f}.sha256" in files or f == TS_FILE
    loaders = {
        TRAINER_FILE: (load_torch, CheckpointError),
        STATE_FILE: (read_verified_bytes, CheckpointError),
        RECORDS_FILE: (read_verified_bytes, CheckpointError),
        TS_FILE: (load_checkpoint, CheckpointCorrupt),
    }
    for name, (load, err) in loaders.items():
        run = tmp_path / name / "checkpoints"
        d = run / src.name
        shutil.copytree(src, d)
        load(d / name)  # intact: loads
        raw = bytearray((d / name).read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        (d / name).write_bytes(bytes(raw))
        with pytest.raises(err, match=name):
            load(d / name)
    # a pointer without its valid digest is passed over for the newest step directory whose
    # state verifies; a verified pointer naming a directory that is not there is refused
    from staleflow_trainer.atomic_files import atomic_write_bytes

    run_dir = tmp_path / TS_FILE
    (run_dir / "checkpoints" / "latest").write_text("step_999999")
    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / src.name
    atomic_write_bytes(run_dir / "checkpoints" / "latest", b"step_999999")
    with pytest.raises(CheckpointError, match="step_999999"):
        latest_checkpoint(run_dir)
