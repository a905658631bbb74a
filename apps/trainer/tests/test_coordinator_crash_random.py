"""Randomized coordinator crashes against the real control loop, in one process.

The coordinator actor runs on its own event loop in its own thread (its "process"); everything
else runs on a second loop (the "other processes"): the real trajectory server over TCP, real
rollout actors with sim engines, real reward workers, the real trainer (tiny Qwen2). Calls cross
like Ray calls: they start on the other loop and keep running when the caller dies. Only the
parameter server is a stand-in (an in-memory version counter: weights are not the point here;
the Ray tests use the real one, see ``integration_tests/cpu/test_faults_coordinator_crash_sim.py``
and ``test_faults_vllm.py``).

A crash cancels every task of the coordinator's loop — at each armed crash point of the loop
(``CRASH_POINTS``: after a batch of events is journaled and before its effects, midway through
the effects, before a checkpoint; in a random order) and at random moments wherever it awaits:
mid-cycle, while rewards are scored, while the trainer trains — with no handover; a new actor built with ``recover=True`` replays the
write-ahead journal and carries on. Several seeds, several crashes each. Then: the run reached
its steps, no step trained twice (trainer version = steps, each batch trained once) or lost (records 1..steps), the
ledger balances (consumed = steps x B x n, nothing lost or counted twice), no trajectory routed
twice (TS history order), consumed staleness <= eta.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import random
import threading
import time
import types
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest

from trajectory_server import routes_out_of_queue

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml"
B, N, ETA, STEPS, CRASHES = 4, 4, 1, 8, 6


@attrs.define
class _Pushed:
    version: int
    complete: bool
    nbytes: int


class _FakeParamServer:
    """Stands in for ``param_server.ParamServerClient``: the last pushed weights, in memory."""

    latest = 0
    tensors: ClassVar[dict[str, Any]] = {}

    def __init__(self, *_a: Any, **_k: Any) -> None:
        pass

    def push(self, version: int, tensors: Any) -> _Pushed:
        _FakeParamServer.latest = max(_FakeParamServer.latest, int(version))
        _FakeParamServer.tensors = dict(tensors)
        return _Pushed(version=int(version), complete=True, nbytes=0)

    def status(self) -> dict[str, Any]:
        return {"latest": _FakeParamServer.latest}

    def pull(self, _names: Any, *, version: int | None = None) -> tuple[int, dict[str, Any]]:
        from param_server.errors import VersionUnavailable

        v = _FakeParamServer.latest if version is None else int(version)
        if v != _FakeParamServer.latest:  # like the real one: only what was published
            raise VersionUnavailable(f"version {v} is not held", version=v)
        return v, dict(_FakeParamServer.tensors)

    def close(self) -> None:
        pass


class _Loop:
    """An event loop on a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def crash(self) -> None:
        """Like a killed process: every task stops at its next await, nothing cleans up."""

        def cancel_all() -> None:
            for t in asyncio.all_tasks(self.loop):
                t.cancel()

        self.loop.call_soon_threadsafe(cancel_all)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class _Handle:
    """``handle.method.remote(...)``: runs on the cluster loop; the caller's death does not
    cancel it (as with Ray); awaitable from the caller's loop."""

    def __init__(self, obj: Any, cluster: _Loop) -> None:
        self._obj, self._cluster = obj, cluster

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._obj, name)
        loop = self._cluster.loop

        class _Method:
            @staticmethod
            def remote(*a: Any, **k: Any) -> Any:
                cf: concurrent.futures.Future[Any] = concurrent.futures.Future()

                async def call() -> None:
                    try:
                        if inspect.iscoroutinefunction(fn):
                            r = await fn(*a, **k)
                        else:
                            r = await asyncio.to_thread(fn, *a, **k)
                    except BaseException as e:  # delivered to the caller, if still there
                        if not cf.cancelled():
                            cf.set_exception(e)
                        return
                    if not cf.cancelled():
                        cf.set_result(r)

                loop.call_soon_threadsafe(lambda: loop.create_task(call()))
                return asyncio.wrap_future(cf)

        return _Method


def _crash_here(self: Any, point: str) -> None:
    """The in-process stand-in for the ``os._exit`` at an armed crash point: every task of
    the coordinator's loop stops here, nothing after this line runs."""
    if self._crash_at == point:
        self._crash_at = None
        for t in asyncio.all_tasks():
            t.cancel()
        raise asyncio.CancelledError


def _scenario(tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    from transformers import AutoTokenizer

    import param_server
    from staleflow_trainer.actors.control import ControlActor
    from staleflow_trainer.actors.fault_hooks import CRASH_POINTS
    from staleflow_trainer.actors.reward_actor import RewardActor
    from staleflow_trainer.actors.rollout import RolloutActor
    from staleflow_trainer.actors.trainer_actor import TrainerActor
    from staleflow_trainer.actors.ts_actor import TrajectoryServerActor
    from staleflow_trainer.config import load_config, to_dict
    from staleflow_trainer.data import encode_records
    from staleflow_trainer.runtime.prepare import rollout_kwargs
    from staleflow_trainer.tiny_model import resolve_model_path

    monkeypatch.setattr(param_server, "ParamServerClient", _FakeParamServer)
    _FakeParamServer.latest = 0
    cfg = load_config(
        EXAMPLE,
        [
            f"run_dir={tmp_path}",
            f"trainer.steps={STEPS}",
            "run.checkpoint_every=3",
            f"protocol.batch_size={B}",
            f"protocol.group_size={N}",
            f"protocol.eta={ETA}",
            "protocol.group_redundancy=1",  # surplus members aborted: drops to reconcile
            "rollout.backend=sim",
            "rollout.sampling.max_new_tokens=6",
            "sim.total_gpus=3",
            "sim.workload.response_len_median=4",
            "coordinator.snapshot_interval_s=0.02",
            "metrics.tensorboard=false",
            "metrics.progress_bar=false",
        ],
    )
    model = resolve_model_path(cfg)
    prompts = encode_records(cfg, AutoTokenizer.from_pretrained(str(model)))
    cluster = _Loop()
    ts = TrajectoryServerActor(token="tok", checkpoint_path=str(tmp_path / "ts.bin"))
    ts_addr = cluster.run(ts.start())
    cluster.run(ts.load_prompts(prompts))  # as the deployment does: groups go by row
    rollouts = {}
    for i in range(2):
        r = RolloutActor(
            instance_id=f"sim-{i}",
            **rollout_kwargs(cfg, i, model),
            ts_address=ts_addr,
            ts_token="tok",
            ps_address=("127.0.0.1", 1),
        )
        rollouts[r.instance_id] = r
    trainer = TrainerActor(
        cfg=to_dict(cfg), model_path=str(model), ps_address=("127.0.0.1", 1),
        ts_address=ts_addr, ts_token="tok",
    )  # fmt: skip
    trainer.push()
    reward = RewardActor(
        fn=cfg.reward.fn, retries=cfg.reward.retries, timeout_s=cfg.reward.timeout_s,
        tokenizer_path=str(model), ts_address=ts_addr, ts_token="tok",
    )  # fmt: skip
    handles = {iid: _Handle(r, cluster) for iid, r in rollouts.items()}
    rng = random.Random(seed)
    plan = [*rng.sample(CRASH_POINTS, len(CRASH_POINTS)), "timed", "timed", "timed"]
    out: dict[str, Any] = {"crashes": [], "records": {}, "setups": []}
    try:
        for gen in range(CRASHES + 1):
            for r in rollouts.values():
                cluster.run(r.start())
            actor = ControlActor(
                cfg=to_dict(cfg), prompts=prompts.lengths(), ts_address=ts_addr, ts_token="tok",
                rollouts=handles, trainer=_Handle(trainer, cluster),
                rewards=[_Handle(reward, cluster)], recover=gen > 0,
            )  # fmt: skip
            point = plan[gen] if gen < CRASHES else None
            if point is not None and point != "timed":
                actor._crash_at = point  # what inject_crash arms; here the crash is:
                actor._maybe_crash = types.MethodType(_crash_here, actor)  # type: ignore[method-assign]
            proc = _Loop()
            try:
                out["setups"].append(proc.run(actor.setup()))
            except concurrent.futures.CancelledError:  # crashed at its point while setting up
                out["crashes"].append(point)
                proc.close()
                continue
            running = asyncio.run_coroutine_threadsafe(actor.run(), proc.loop)
            wait_s = rng.uniform(0.05, 0.8) if point == "timed" else 30 if point else 120
            deadline = time.monotonic() + wait_s
            while not running.done() and time.monotonic() < deadline:
                try:
                    drained = proc.run(actor.drain())
                except concurrent.futures.CancelledError:
                    # the crash point fired while this drain ran on the same loop: the crash
                    # cancelled every task there, ours included; the loop's future is done
                    continue
                for rec in drained["records"]:
                    out["records"].setdefault(rec["step"], rec)
                time.sleep(0.02)
            if running.done() and point not in (None, "timed"):  # crashed at its point
                out["crashes"].append(point)
                proc.close()
                continue
            if running.done():
                running.result()
                for rec in proc.run(actor.drain())["records"]:
                    out["records"].setdefault(rec["step"], rec)
                out["ledger"] = proc.run(actor.ledger())
                out["histories"] = proc.run(actor.histories())
                out["summary"] = proc.run(actor.summary())
                proc.run(actor.io.ts.close())
                proc.close()
                break
            steps_before = proc.run(actor.drain())
            for rec in steps_before["records"]:
                out["records"].setdefault(rec["step"], rec)
            out["crashes"].append("timed" if point == "timed" else f"missed {point}")
            proc.crash()
            time.sleep(0.05)
            proc.close()
        out["trainer_version"] = trainer.version()
        out["trained"] = trainer.trained()
    finally:
        for r in rollouts.values():
            cluster.run(r.close())
        cluster.run(ts.stop())
        cluster.close()
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_random_coordinator_crashes_lose_nothing(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from staleflow_trainer.actors.fault_hooks import CRASH_POINTS

    out = _scenario(tmp_path, seed, monkeypatch)
    # every armed point was hit (the timed ones may come after the run ended)
    assert sorted(c for c in out["crashes"] if c != "timed") == sorted(CRASH_POINTS), out["crashes"]
    assert all(s["recovered"] for s in out["setups"][1:])
    assert out["summary"]["steps_done"] == STEPS
    # no step trained twice or lost
    assert out["trainer_version"] == STEPS
    assert sorted(out["records"]) == list(range(1, STEPS + 1))
    assert [v for v, _ in out["trained"]] == list(range(STEPS))  # replays not retrained
    ids = [t for _, batch in out["trained"] for t in batch]
    assert len(ids) == len(set(ids)) == STEPS * B * N  # no trajectory in two batches
    for rec in out["records"].values():
        assert 0 <= rec["max_staleness"] <= ETA
        assert sum(rec["staleness_hist"].values()) == B * N
    assert max(int(s) for s in out["summary"]["staleness_histogram"]) <= ETA
    # the ledger balances: every admitted trajectory consumed once, in flight, or dropped
    led = out["ledger"]
    assert led["problems"] == []
    assert led["consumed"] == STEPS * B * N
    assert led["dropped"] > 0 and all(r and r != "?" for r in led["dropped_reasons"])
    assert (
        led["consumed"] + led["in_flight"] + led["waiting_consume"] + led["dropped"]
        == led["trajectories"]
    )
    # never routed twice: a route only ever follows submitted / returned / lost
    assert routes_out_of_queue(out["histories"]) == []
