"""An instance that dies after writing finished output to the trajectory store (TS) and before
its poll answer reached the control actor: the control side learns what the TS holds of every
trajectory it believed ran there — finished ones go on to reward, dropped ones are dropped with
a reason, only those the TS put back in the queue are routed again. And a route the TS refuses
for a trajectory it holds as finished or dropped settles it instead of requeueing it forever.

The control actor's real loop (``_cycle``: polls, ``ShellIO.lose``, the journal, the core) over
a real in-process TS; the instances are fakes that route, finish and die on that TS the way the
rollout actor does. The Ray test with real rollout actors is
``integration_tests/cpu/test_faults_lost_after_flush_sim.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine_adapters import pack_ids, unpack_ids
from staleflow_trainer.actors import effect_calls, shell_io
from staleflow_trainer.actors.control import ControlActor
from staleflow_trainer.actors.in_store import in_store
from staleflow_trainer.actors.rollout_wire import pack_outcomes
from staleflow_trainer.actors.shell_io import ShellIO
from staleflow_trainer.config import load_config, to_dict
from staleflow_trainer.control import ControlCore, core_config
from staleflow_trainer.control import effects as fx
from staleflow_trainer.control.checks import ledger_problems
from staleflow_trainer.control.events import (
    InstanceJoined,
    InstanceLost,
    Outcome,
    Reported,
    event_from_dict,
    event_to_dict,
)
from staleflow_trainer.control.ledger import Where
from staleflow_trainer.data import PromptLengths
from trajectory_server import Completion, SamplingParams, Segment, TrajectoryStore
from trajectory_server.client import InProcessTrajectoryClient
from trajectory_server.errors import TrajectoryServerError

SIM_TINY = Path(__file__).resolve().parents[3] / "examples" / "sim-tiny.yaml"
TOKENS = 3


class _Dead(Exception):
    """What a call to a killed instance raises (Ray's RayActorError in the deployment)."""


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _Instance:
    """Routes on the TS like ``RolloutActor.submit`` (a refused id is reported by the next
    poll); each poll first finishes everything it runs in the TS (like ``_flush``), then
    answers — or, once ``die_after_flush`` is set, dies before the answer leaves."""

    def __init__(self, iid: str, store: TrajectoryStore) -> None:
        self.iid, self.store = iid, store
        self.running: list[str] = []
        self.refused: list[str] = []
        self.refusals = 0
        self.die_after_flush = False
        self.dead = False
        self.finished_unreported: list[str] = []
        self.stopped: list[list[Any]] = []
        self.submit = _Remote(self._submit)
        self.poll = _Remote(self._poll)
        self.interrupt = _Remote(self._interrupt)

    async def _interrupt(self, packed: list[Any] | None, report: bool = False) -> Any:
        if self.dead:
            raise _Dead(self.iid)
        ids = None if packed is None else unpack_ids(packed)
        stop = [t for t in self.running if ids is None or t in ids]
        for tid in stop:
            self.running.remove(tid)
            held = self.store.get(tid).generated_len
            self.store.return_partial(self.iid, [Segment(
                trajectory_id=tid, start=held, token_ids=[], logprobs=[], versions=[])])  # fmt: skip
            self.stopped.append([tid, held, None])
        if not report:
            return len(stop)
        # like the real actor: the answer carries the partial lengths (in the order asked),
        # and those outcomes do not come with the next poll
        lengths = {o[0]: o[1] for o in self.stopped}
        self.stopped = [o for o in self.stopped if o[0] not in (ids or ())]
        return [lengths.get(t) for t in ids or ()]

    async def _submit(self, version: int, packed: list[Any]) -> int:
        if self.dead:
            raise _Dead(self.iid)
        ids = unpack_ids(packed)
        for tid in ids:
            try:
                self.store.route(self.iid, [tid], version)
                self.running.append(tid)
            except TrajectoryServerError:
                self.refused.append(tid)
                self.refusals += 1
        return len(ids)

    async def _poll(self, *_: Any) -> list[Any] | None:
        if self.dead:
            raise _Dead(self.iid)
        outcomes = []
        for tid in self.running:
            t = self.store.get(tid)
            version = int(t.v_traj or 0)
            self.store.finish(self.iid, [Completion(
                trajectory_id=tid, start=t.generated_len, token_ids=[1] * TOKENS,
                logprobs=[0.0] * TOKENS, versions=[version] * TOKENS, finish_reason="stop",
            )])  # fmt: skip
            outcomes.append([tid, t.generated_len + TOKENS, "stop"])
        self.running = []
        outcomes += self.stopped
        self.stopped = []
        if self.die_after_flush and outcomes:
            self.dead = True  # the finishes are in the TS; the answer dies with the process
            self.finished_unreported = [o[0] for o in outcomes]
            raise _Dead(self.iid)
        refused, self.refused = self.refused, []
        # the rollout actor's answer: [delta, outcomes, refused], trailing empty ones left out
        answer = [None, pack_outcomes([tuple(o) for o in outcomes]), pack_ids(refused)]
        while answer and not answer[-1]:
            answer.pop()
        return answer or None


def _actor(tmp_path: Path, store: TrajectoryStore) -> tuple[ControlActor, dict[str, _Instance]]:
    over = [f"run.run_dir={tmp_path}", "protocol.batch_size=2", "protocol.group_size=2",
            "protocol.eta=1", "protocol.stuck_threshold=0", "rollout.num_instances=2"]  # fmt: skip
    cfg = load_config(SIM_TINY, over)
    insts = {iid: _Instance(iid, store) for iid in ("a", "b")}
    actor = ControlActor(cfg=to_dict(cfg), prompts=PromptLengths(()), ts_address=("127.0.0.1", 1),
                         ts_token="t", rollouts=dict(insts), trainer=None, rewards=[])  # fmt: skip
    actor.core = ControlCore(core_config(cfg, rows=None), prompt_len=lambda row: 3)
    actor.io.ts = InProcessTrajectoryClient(store)

    async def submit(groups: list[fx.GroupSpec]) -> None:
        for g in groups:
            store.submit_group(g.group_id, [7, 8, 9], g.members,
                               sampling=SamplingParams(max_new_tokens=64))  # fmt: skip

    actor.io._submit = submit  # type: ignore[method-assign]
    actor.io.spawn = lambda coro: coro.close()  # type: ignore[method-assign]
    for iid in insts:
        actor.core.handle(InstanceJoined(at=0.0, instance_id=iid, kv_capacity_tokens=100_000,
                                         version=0, setup=True))  # fmt: skip
    actor._wal.reset(actor.core.to_dict())
    return actor, insts


def _scored(actor: ControlActor, wal_dir: Path) -> set[str]:
    """Trajectories the core asked the reward workers to score (from the journal's replay)."""
    base, records = actor._wal.load()
    core = ControlCore.restore(base, actor.core.config, prompt_len=lambda row: 3)
    out: set[str] = set()
    for rec in records:
        for d in rec["events"]:
            for e in core.handle(event_from_dict(d)):
                if isinstance(e, fx.Score):
                    out.update(e.trajectory_ids)
    assert json.dumps(core.to_dict(), sort_keys=True) == json.dumps(
        actor.core.to_dict(), sort_keys=True
    )  # the journal replays to the same state
    assert ledger_problems(actor.core) == []  # ledger and protocol agree, totals balance
    return out


@pytest.fixture(autouse=True)
def _fake_deaths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shell_io, "is_actor_death", lambda e: isinstance(e, _Dead))
    monkeypatch.setattr(effect_calls, "is_actor_death", lambda e: isinstance(e, _Dead))


async def test_finished_in_the_store_before_the_answer_goes_to_reward_not_back_to_the_queue(
    tmp_path: Path,
) -> None:
    store = TrajectoryStore()
    actor, insts = _actor(tmp_path, store)
    a, b = insts["a"], insts["b"]
    await actor._cycle()  # submits groups and routes to both instances
    assert a.running and b.running
    a.die_after_flush = True
    await actor._cycle()  # a writes its finishes to the TS and dies before its answer
    assert a.dead and a.finished_unreported
    ((lost,),) = [[x for x in actor.io.lost if x["instance_id"] == "a"]]
    assert sorted(lost["finished"]) == sorted(a.finished_unreported)
    for _ in range(12):
        await actor._cycle()
    # none was routed again: the TS refused nothing; each went on to reward once
    assert b.refusals == 0
    led = actor.core.ledger
    for tid in a.finished_unreported:
        e = led.get(tid)
        assert e is not None and e.where is Where.FINISHED and e.generated == TOKENS, tid
    assert actor.core.counters["lost_finished"] == len(a.finished_unreported)
    assert set(a.finished_unreported) <= _scored(actor, tmp_path)
    assert "a" not in actor.core.instances()
    store.check_invariants()


async def test_dropped_in_the_store_is_dropped_with_its_group_and_a_reason(
    tmp_path: Path,
) -> None:
    store = TrajectoryStore()
    actor, insts = _actor(tmp_path, store)
    a, b = insts["a"], insts["b"]
    await actor._cycle()
    victim = a.running[0]
    store.drop([victim], "aborted elsewhere")  # the TS dropped it while a ran it
    a.running.remove(victim)
    a.dead = True
    for _ in range(12):
        await actor._cycle()
    assert b.refusals == 0
    e = actor.core.ledger.get(victim)
    assert e is None or e.where is Where.DROPPED  # settled (its group retired, or not yet)
    reasons = actor.core.ledger.dropped_reasons
    assert any("dropped in the trajectory store: aborted elsewhere" in r for r in reasons), reasons
    assert actor.core.counters["store_dropped"] == 1
    gid = victim.rsplit("/", 1)[0]
    assert all(store.location(t).state.value == "dropped" for t in store.group(gid))
    _scored(actor, tmp_path)  # the journal replays to the same state


async def test_a_refused_route_for_a_finished_trajectory_settles_it_instead_of_looping(
    tmp_path: Path,
) -> None:
    """The control side did not learn at the loss (a shell that could not tell): the next
    route of those trajectories is refused, and the refusal settles them as the TS holds
    them — once, not forever."""
    store = TrajectoryStore()
    actor, insts = _actor(tmp_path, store)
    a, b = insts["a"], insts["b"]
    actor.io.held_by = lambda iid: ()  # lose() learns only what instance_lost put back
    await actor._cycle()
    a.die_after_flush = True
    await actor._cycle()
    assert a.dead and a.finished_unreported
    for _ in range(12):
        await actor._cycle()
    assert 0 < b.refusals <= len(a.finished_unreported)  # each refused once at most
    for tid in a.finished_unreported:
        e = actor.core.ledger.get(tid)
        assert e is not None and e.where is Where.FINISHED, tid
    assert set(a.finished_unreported) <= _scored(actor, tmp_path)


async def test_in_store_sorts_by_what_the_store_holds(tmp_path: Path) -> None:
    store = TrajectoryStore()
    store.submit_group("g", [1, 2, 3], 5, sampling=SamplingParams(max_new_tokens=8))
    store.route("i0", ["g/0", "g/1", "g/2", "g/3"], 0)
    store.finish("i0", [Completion(trajectory_id="g/0", start=0, token_ids=[4, 5],
                                   logprobs=[0.0, 0.0], versions=[0, 0],
                                   finish_reason="length")])  # fmt: skip
    store.drop(["g/1"], "filtered")
    store.instance_lost("i0")  # g/2, g/3 back in the queue
    store.route("i1", ["g/3"], 0)
    ts = InProcessTrajectoryClient(store)
    st = await in_store(ts, ["g/0", "g/1", "g/2", "g/3", "g/4", "nope/0"], "i0")
    assert st.finished == (Outcome(trajectory_id="g/0", generated=2, finish="length"),)
    assert st.queued == (("g/2", 0), ("g/4", 0))
    assert dict(st.dropped) == {
        "g/1": "dropped in the trajectory store: filtered",
        "g/3": "running on i1 in the trajectory store, not i0",
        "nope/0": "unknown to the trajectory store",
    }
    assert st.running == ()
    assert (await in_store(ts, ["g/3"], "i1")).running == ("g/3",)

    io = ShellIO(
        load_config(SIM_TINY, [f"run.run_dir={tmp_path}"]), prompts=PromptLengths(()),
        ts_address=("127.0.0.1", 1), ts_token="t", rollouts={"i1": None}, trainer=None,
        rewards=[], reward_spec={}, held_by=lambda iid: ["g/3"],
    )  # fmt: skip
    io.ts = ts
    lost = await io.lose("i1", RuntimeError("killed"), at=2.0)
    assert lost.requeued == (("g/3", 0),) and not lost.finished and not lost.dropped


def test_the_loss_and_the_refusal_round_trip_through_the_journal_form() -> None:
    events = [
        InstanceLost(
            at=1.0,
            instance_id="a",
            requeued=[("g/1", 4)],
            finished=[Outcome(trajectory_id="g/0", generated=3, finish="stop")],
            dropped=[("g/2", "dropped in the trajectory store: x")],
        ),
        Reported(at=2.0, instance_id="b", dropped=[("g/3", "unknown to the trajectory store")]),
    ]
    for e in events:
        assert event_from_dict(json.loads(json.dumps(event_to_dict(e)))) == e
    # an older journal's record (no such fields) still loads
    old = {"kind": "lost", "at": 1.0, "instance_id": "a", "requeued": [], "setup": False}
    assert event_from_dict(old) == InstanceLost(at=1.0, instance_id="a")
