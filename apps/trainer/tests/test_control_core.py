"""The control core against random event sequences (Hypothesis), with crashes and replays.

A small in-memory "world" carries out the core's effects the way a shell would — instances
run what they are routed, return partials when interrupted or synced, report finished
trajectories, a reward worker scores them, a trainer trains — while Hypothesis chooses which
of those things happens next, and when an instance dies, a sync fails, or the core's process
crashes (the core is then rebuilt from its last base state plus the journal of events since,
and must equal the one that crashed). After every step: the ledger agrees with the protocol,
the totals balance, no consumed sample is staler than η, no buffer is trained twice. The runs
cover per-version buffers (staleflow and two ablations) and the FIFOs (``GcFifo`` under
coarse-async-drop, ``UnboundedFifo`` under verl-async and with η unbounded).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rollout_coordinator import CoordinatorConfig, InstanceSnapshot, RunningEntry
from staleflow_trainer.control import ControlCore, CoreConfig
from staleflow_trainer.control import effects as fx
from staleflow_trainer.control.checks import ledger_problems
from staleflow_trainer.control.events import (
    Cycle,
    Event,
    InstanceJoined,
    InstanceLost,
    InstanceSilent,
    Outcome,
    Reported,
    Reward,
    Rewarded,
    SyncDone,
    SyncFailed,
    Trained,
    event_from_dict,
    event_to_dict,
)
from staleness_protocol import ProtocolConfig


def prompt_len(row: int) -> int:
    return 4 + row % 7


def make_config(policy: str = "staleflow", eta: int = 1, **proto: Any) -> CoreConfig:
    return CoreConfig(
        protocol=ProtocolConfig(batch_size=2, group_size=2, eta=eta, **proto),
        # the paper's migration rule: with its tiny loads the default speedup test would
        # refuse every move, and the random runs would never migrate
        coordinator=CoordinatorConfig(policy=policy, migration_min_speedup=None),
        steps=6,
        dynamic_sampling=proto.get("filtering", False),
        stuck_after_s=1.0,
        sync_retries=3,
        rows=20,
    )


#: runs over one FIFO instead of per-version buffers: (policy, eta or None for the drawn one)
FIFO_RUNS = {
    "coarse-async-drop": ("coarse-async-drop", None),  # GcFifo: drops what ages past η
    "verl-async": ("verl-async", None),  # UnboundedFifo under verl's window (s = η)
    "unbounded": ("all-vanilla", "unbounded"),  # UnboundedFifo, no staleness control
}


def make_fifo_config(run: str, eta: int, *, group_redundancy: int, filtering: bool) -> CoreConfig:
    """A FIFO run's core config, built the way both shells build theirs (from the app
    config, by ``core_config``)."""
    from staleflow_trainer.config import load_config
    from staleflow_trainer.control.config import core_config

    policy, fixed = FIFO_RUNS[run]
    over = [
        f"coordinator.policy={policy}",
        f"protocol.eta={eta if fixed is None else fixed}",
        "protocol.batch_size=2",
        "protocol.group_size=2",
        f"protocol.group_redundancy={group_redundancy}",
        "coordinator.sync_retries=3",
        "trainer.steps=6",
        f"trainer.dynamic_sampling={str(filtering).lower()}",
    ]
    return core_config(load_config(None, over), rows=20)


class World:
    """Carries out effects; holds what a shell and its components would."""

    def __init__(self) -> None:
        self.running: dict[str, dict[str, int]] = {}  # instance -> tid -> generated
        self.version: dict[str, int] = {}
        self.syncing: dict[str, int] = {}
        self.seq: dict[str, int] = {}
        self.reports: dict[str, list[Outcome]] = {}
        self.to_score: list[str] = []
        self.training: fx.Train | None = None
        self.trained_versions: list[int] = []
        self.halted = False
        self.silent: set[str] = set()  # a call to it is overdue: nothing new may go there

    def apply(self, effects: list[fx.Effect]) -> None:
        for e in effects:
            if isinstance(e, fx.Route):
                # routes wait for a sync to finish; a new trajectory starts at the instance's
                # version, a partial keeps its V_traj
                assert e.instance_id not in self.syncing, "routed to an instance mid-sync"
                assert e.instance_id not in self.silent, "routed to a silent instance"
                v = self.syncing.get(e.instance_id, self.version[e.instance_id])
                assert e.version <= v
                for t in e.trajectory_ids:
                    self.running[e.instance_id][t] = 0
            elif isinstance(e, fx.Interrupt):
                # (an abort may still go there: its output is discarded either way)
                assert not e.requeue or e.instance_id not in self.silent, "migrated from silent"
                self._stop(e.instance_id, e.trajectory_ids)
            elif isinstance(e, fx.Sync):
                assert e.instance_id not in self.silent, "synced a silent instance"
                self._stop(e.instance_id, list(self.running.get(e.instance_id, {})))
                self.syncing[e.instance_id] = e.version
            elif isinstance(e, fx.Score):
                self.to_score.extend(e.trajectory_ids)
            elif isinstance(e, fx.Train):
                assert self.training is None, "a second batch while one trains"
                assert e.version not in self.trained_versions, f"buffer {e.version} trained twice"
                self.training = e
            elif isinstance(e, fx.Halt):
                self.halted = True

    def _stop(self, iid: str, tids: Any) -> None:
        run = self.running.get(iid)
        if run is None:
            return
        for t in list(tids):
            if t in run:
                self.reports.setdefault(iid, []).append(
                    Outcome(trajectory_id=t, generated=run.pop(t))
                )

    def snapshot(self, iid: str, at: float) -> InstanceSnapshot:
        self.seq[iid] = self.seq.get(iid, 0) + 1
        run = self.running[iid]
        return InstanceSnapshot(
            instance_id=iid,
            seq=self.seq[iid],
            time_s=at,
            version=self.version[iid],
            running=tuple(
                RunningEntry(trajectory_id=t, prompt_tokens=5, generated_tokens=g)
                for t, g in run.items()
            ),
            kv_used_tokens=sum(5 + g for g in run.values()),
            kv_capacity_tokens=10_000,
        )


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return f"{path}: {a!r} != {b!r}"


class CoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.t = 0.0
        self.world = World()
        self.core: ControlCore
        self.base: dict[str, Any] = {}
        self.journal: list[dict[str, Any]] = []

    @initialize(
        policy=st.sampled_from(["staleflow", "all-vanilla", "vanilla-sync", *FIFO_RUNS]),
        eta=st.integers(0, 2),
        redundancy=st.integers(0, 1),
        filtering=st.booleans(),
        stuck=st.booleans(),
        instances=st.integers(1, 3),
    )
    def start(
        self, policy: str, eta: int, redundancy: int, filtering: bool, stuck: bool, instances: int
    ) -> None:
        if policy in FIFO_RUNS:  # no buffer to get stuck; verl's window refuses filtering
            self.config = make_fifo_config(
                policy,
                eta,
                group_redundancy=redundancy,
                filtering=filtering and policy != "verl-async",
            )
        else:
            self.config = make_config(
                policy,
                eta,
                group_redundancy=redundancy,
                filtering=filtering,
                stuck_threshold=1 if stuck else None,
            )
        self.core = ControlCore(self.config, prompt_len=prompt_len)
        self.base = self.core.to_dict()
        for i in range(instances):
            self._join(f"i{i}")

    # ---- feeding -------------------------------------------------------------------------

    def feed(self, event: Event) -> None:
        if self.world.halted or self.core.done:
            return
        self.journal.append(event_to_dict(event))
        effects = self.core.handle(event)
        halts = [i for i, e in enumerate(effects) if isinstance(e, fx.Halt)]
        # nothing after a halt: the shell stops there, so the core's state must not count on
        # effects that are never carried out (a batch consumed with no Train, ...)
        assert halts in ([], [len(effects) - 1]), effects
        self.world.apply(effects)

    def _tick(self) -> float:
        self.t += 0.25
        return self.t

    def _join(self, iid: str) -> None:
        self.world.running[iid] = {}
        self.world.version[iid] = self.core.published
        self.feed(
            InstanceJoined(
                at=self.t, instance_id=iid, kv_capacity_tokens=10_000, version=self.core.published
            )
        )

    # ---- rules ---------------------------------------------------------------------------

    @rule()
    def cycle(self) -> None:
        at = self._tick()
        for iid in sorted(self.world.running):
            if iid in self.world.syncing or iid in self.world.silent:
                continue  # (a silent one has a call out: the shell has no view of it)
            out = self.world.reports.pop(iid, [])
            self.feed(
                Reported(
                    at=at, instance_id=iid, outcomes=out, snapshot=self.world.snapshot(iid, at)
                )
            )
        self.feed(Cycle(at=at))

    @rule(data=st.data(), finish=st.booleans(), tokens=st.integers(1, 5))
    def progress(self, data: st.DataObject, finish: bool, tokens: int) -> None:
        busy = sorted((i, t) for i, run in self.world.running.items() for t in run)
        if not busy:
            return
        iid, tid = data.draw(st.sampled_from(busy))
        gen = self.world.running[iid].pop(tid) + tokens
        o = Outcome(trajectory_id=tid, generated=gen, finish="stop" if finish else None)
        self.feed(Reported(at=self._tick(), instance_id=iid, outcomes=[o]))

    @rule(tokens=st.integers(1, 40))
    def settle(self, tokens: int) -> None:
        """Every sync in flight succeeds, everything running finishes and is reported, every
        finished trajectory is scored (members of a group apart, so filtering keeps it), and
        a cycle follows: the run moves on to training (the rules one step at a time rarely
        get a whole batch there)."""
        for iid in sorted(self.world.syncing):
            version = self.world.syncing.pop(iid)
            self.world.version[iid] = version
            self.feed(SyncDone(at=self._tick(), instance_id=iid, version=version))
        for iid in sorted(self.world.running):
            if iid in self.world.syncing or iid in self.world.silent:
                continue
            run = self.world.running[iid]
            done = [Outcome(trajectory_id=t, generated=g + tokens, finish="stop")
                    for t, g in sorted(run.items())]  # fmt: skip
            run.clear()
            if done:
                self.feed(Reported(at=self._tick(), instance_id=iid, outcomes=done))
        if self.world.to_score:
            scores = [Reward(trajectory_id=t, score=float(int(t.rsplit("/", 1)[1]) % 2),
                             reason="")
                      for t in sorted(self.world.to_score)]  # fmt: skip
            self.world.to_score.clear()
            self.feed(Rewarded(at=self._tick(), rewards=scores))
        self.cycle()

    @rule(data=st.data(), fail=st.integers(0, 9))
    def reward(self, data: st.DataObject, fail: int) -> None:
        if not self.world.to_score:
            return
        tid = data.draw(st.sampled_from(sorted(self.world.to_score)))
        self.world.to_score.remove(tid)
        score = None if fail == 0 else float(data.draw(st.integers(0, 1)))
        self.feed(
            Rewarded(
                at=self._tick(), rewards=[Reward(trajectory_id=tid, score=score, reason="boom")]
            )
        )

    @precondition(lambda self: self.world.training is not None)
    @rule()
    def trained(self) -> None:
        tr = self.world.training
        assert tr is not None
        self.world.training = None
        self.world.trained_versions.append(tr.version)
        self.feed(Trained(at=self._tick(), version=tr.version + 1))

    @rule(data=st.data(), ok=st.booleans())
    def sync_outcome(self, data: st.DataObject, ok: bool) -> None:
        if not self.world.syncing:
            return
        iid = data.draw(st.sampled_from(sorted(self.world.syncing)))
        version = self.world.syncing.pop(iid)
        if ok:
            self.world.version[iid] = version
            self.feed(SyncDone(at=self._tick(), instance_id=iid, version=version))
        else:
            self.feed(SyncFailed(at=self._tick(), instance_id=iid, error="pull failed"))

    @rule(data=st.data())
    def instance_dies(self, data: st.DataObject) -> None:
        if len(self.world.running) < 2:
            return
        iid = data.draw(st.sampled_from(sorted(self.world.running)))
        run = self.world.running.pop(iid)
        self.world.syncing.pop(iid, None)
        self.world.silent.discard(iid)
        self.world.reports.pop(iid, None)
        self.world.version.pop(iid)
        # some may have finished in the store, their report lost with the instance
        done = data.draw(st.lists(st.sampled_from(sorted(run)), unique=True)) if run else []
        finished = [Outcome(trajectory_id=t, generated=run[t] + 1, finish="stop") for t in done]
        requeued = [(t, 0) for t in run if t not in done]
        self.feed(InstanceLost(at=self._tick(), instance_id=iid, requeued=requeued,
                               finished=finished))  # fmt: skip

    @rule(data=st.data(), answers=st.booleans())
    def instance_silent(self, data: st.DataObject, answers: bool) -> None:
        """A call to an instance is overdue: it is silent, and some of the routes to it that
        the shell never sent come back; or a silent one answers again."""
        if answers:
            if self.world.silent:
                iid = data.draw(st.sampled_from(sorted(self.world.silent)))
                self.world.silent.discard(iid)
                self.feed(InstanceSilent(at=self._tick(), instance_id=iid, silent=False))
            return
        if not self.world.running:
            return
        iid = data.draw(st.sampled_from(sorted(self.world.running)))
        run = self.world.running[iid]
        unsent = sorted(t for t, g in run.items() if g == 0)
        back = data.draw(st.lists(st.sampled_from(unsent), unique=True)) if unsent else []
        for t in back:
            del run[t]
        self.world.silent.add(iid)
        self.feed(InstanceSilent(at=self._tick(), instance_id=iid, withdrawn=back))

    @rule(n=st.integers(0, 9))
    def instance_joins(self, n: int) -> None:
        iid = f"j{n}"
        if iid in self.world.running or len(self.world.running) >= 4:
            return
        self._join(iid)

    @rule()
    def crash_and_replay(self) -> None:
        """The core's process dies: a new core from the base state plus the journal must
        equal the one that crashed."""
        before = self.core.to_dict()
        core = ControlCore.restore(self.base, self.config, prompt_len=prompt_len)
        for d in self.journal:
            core.handle(event_from_dict(json.loads(json.dumps(d))))
        after = json.loads(json.dumps(core.to_dict()))
        before = json.loads(json.dumps(before))
        assert after == before, _first_difference(before, after)
        self.core = core

    @rule()
    def compact(self) -> None:
        """A checkpoint: the journal restarts from the current state."""
        self.base = json.loads(json.dumps(self.core.to_dict()))
        self.journal = []

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def ledger_balances(self) -> None:
        if hasattr(self, "core"):
            problems = ledger_problems(self.core)
            assert problems == [], problems

    @invariant()
    def versions_in_order(self) -> None:
        v = self.world.trained_versions
        assert v == sorted(set(v))


CoreMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("STALEFLOW_CORE_EXAMPLES", "150")),
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCoreMachine = CoreMachine.TestCase


# ---- determinism across processes ---------------------------------------------------------


_REPLAY = r"""
import json, sys
from staleflow_trainer.config import load_config
from staleflow_trainer.sim.shell import Simulation
from staleflow_trainer.control import ControlCore
from staleflow_trainer.control.events import event_to_dict
cfg = load_config(sys.argv[1], sys.argv[2:])
journal = []
orig = ControlCore.handle
def handle(self, ev):
    journal.append(event_to_dict(ev))
    return orig(self, ev)
ControlCore.handle = handle
sim = Simulation(cfg)
sim.run()
print(json.dumps({"journal": journal, "state": sim.core.to_dict()}))
"""


def test_replay_in_another_process_gives_the_same_state(tmp_path: Any) -> None:
    """Events recorded in one process (hash seed 1) replayed in another (hash seed 2) from a
    fresh core give the identical state: nothing the core decides depends on hash order."""
    from pathlib import Path

    examples = Path(__file__).resolve().parents[3] / "examples"
    args = [str(examples / "sim-tiny.yaml"), "trainer.steps=6", "metrics.timeline=false"]
    env = {**os.environ, "PYTHONHASHSEED": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _REPLAY, *args], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    script = r"""
import json, sys
from staleflow_trainer.config import load_config
from staleflow_trainer.control import ControlCore, core_config
from staleflow_trainer.control.events import event_from_dict
from staleflow_trainer.sim.spec import spec_from_app_config
from staleflow_trainer.sim.workload import PromptStream
cfg = load_config(sys.argv[1], sys.argv[2:-1])
stream = PromptStream(spec_from_app_config(cfg))
core = ControlCore(core_config(cfg, rows=None), prompt_len=lambda r: stream.group(r).prompt_len)
for d in json.load(open(sys.argv[-1]))["journal"]:
    core.handle(event_from_dict(d))
print(json.dumps(core.to_dict()))
"""
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(rec))
    env["PYTHONHASHSEED"] = "2"
    out2 = subprocess.run(
        [sys.executable, "-c", script, *args, str(path)], env=env, capture_output=True, text=True
    )
    assert out2.returncode == 0, out2.stderr[-3000:]
    replayed = json.loads(out2.stdout.strip().splitlines()[-1])
    assert len(rec["journal"]) > 100
    assert json.dumps(replayed, sort_keys=True) == json.dumps(rec["state"], sort_keys=True)


@pytest.mark.parametrize("policy", ["staleflow", "coarse-async-drop"])
def test_events_round_trip_through_the_journal_form(policy: str) -> None:
    snap = InstanceSnapshot(
        instance_id="a",
        seq=1,
        time_s=0.5,
        version=0,
        kv_capacity_tokens=9,
        running=(RunningEntry(trajectory_id="g/0", prompt_tokens=1, generated_tokens=2),),
    )
    events: list[Event] = [
        Cycle(at=1.0),
        Reported(
            at=1.0,
            instance_id="a",
            outcomes=[Outcome(trajectory_id="g/0", generated=3, finish="stop")],
            snapshot=snap,
        ),
        Rewarded(at=2.0, rewards=[Reward(trajectory_id="g/0", score=None, reason="x")]),
        SyncDone(at=3.0, instance_id="a", version=2),
        SyncFailed(at=3.0, instance_id="a", error="e"),
        Trained(at=4.0, version=1, metrics={"loss": 0.5}),
        InstanceJoined(at=5.0, instance_id="b", kv_capacity_tokens=7, version=1),
        InstanceLost(at=6.0, instance_id="b", requeued=[("g/1", 4)]),
        InstanceLost(
            at=7.0,
            instance_id="c",
            finished=[Outcome(trajectory_id="g/2", generated=5, finish="length")],
            dropped=[("g/3", "why")],
        ),
        Reported(at=8.0, instance_id="a", dropped=[("g/4", "why")]),
        InstanceSilent(at=9.0, instance_id="a", withdrawn=["g/5", "g/6"]),
        InstanceSilent(at=9.5, instance_id="a", silent=False),
    ]
    for e in events:
        assert event_from_dict(json.loads(json.dumps(event_to_dict(e)))) == e


def test_setup_joins_and_recovery_rejoins_are_not_membership_changes() -> None:
    """``instances_joined`` / ``instances_lost`` count changes of the run's membership only: a
    run's first instances and a live instance re-attached by recovery (``setup``) are not."""
    core = ControlCore(make_config(), prompt_len=prompt_len)
    for iid in ("a", "b"):
        core.handle(InstanceJoined(at=0.0, instance_id=iid, kv_capacity_tokens=4096, version=0,
                                   setup=True))  # fmt: skip
    core.handle(InstanceLost(at=1.0, instance_id="a", setup=True))  # recovery: a is live
    core.handle(InstanceJoined(at=1.0, instance_id="a", kv_capacity_tokens=4096, version=0,
                               setup=True))  # fmt: skip
    assert (core.counters["instances_joined"], core.counters["instances_lost"]) == (0, 0)
    core.handle(InstanceLost(at=2.0, instance_id="b"))  # died
    core.handle(InstanceJoined(at=2.0, instance_id="c", kv_capacity_tokens=4096, version=0))
    assert (core.counters["instances_joined"], core.counters["instances_lost"]) == (1, 1)
    assert sorted(core.instances()) == ["a", "c"]
    for ev in (InstanceLost(at=3.0, instance_id="a", requeued=[("g/0", 2)], setup=True),
               InstanceJoined(at=3.0, instance_id="a", kv_capacity_tokens=8, version=1,
                              setup=True)):  # fmt: skip
        assert event_from_dict(json.loads(json.dumps(event_to_dict(ev)))) == ev


def test_nothing_follows_a_halt() -> None:
    """A reward failure that halts the run, in the same event as the rewards that complete a
    batch: the Halt is the last effect (a shell stops there), and no batch is consumed for a
    Train that would never be carried out."""
    import attrs

    core = ControlCore(attrs.evolve(make_config(eta=1), reward_failures_in_row=1),
                       prompt_len=prompt_len)  # fmt: skip
    world = World()
    world.running["a"], world.version["a"] = {}, 0
    world.apply(core.handle(InstanceJoined(at=0.0, instance_id="a", kv_capacity_tokens=10_000,
                                           version=0)))  # fmt: skip
    for t in range(1, 20):  # route what is admitted and finish it
        world.apply(core.handle(Cycle(at=float(t))))
        run = world.running["a"]
        outs = [Outcome(trajectory_id=tid, generated=3, finish="stop") for tid in sorted(run)]
        run.clear()
        if outs:
            world.apply(core.handle(Reported(at=float(t), instance_id="a", outcomes=outs)))
    ids = sorted(world.to_score)
    assert len(ids) >= 3 * 2  # three groups of two: a batch of two groups is complete
    rewards = [Reward(trajectory_id=t, score=1.0) for t in ids[:-1]]
    effects = core.handle(Rewarded(at=30.0, rewards=[*rewards, Reward(
        trajectory_id=ids[-1], score=None, reason="boom")]))  # fmt: skip
    assert isinstance(effects[-1], fx.Halt), effects
    assert core.training is None and not any(isinstance(e, fx.Train) for e in effects)


def test_routes_taken_back_then_the_instance_lost_are_requeued_and_counted_once() -> None:
    """The instance's routes were taken back unsent (``InstanceSilent``) and then it was lost,
    with the store listing the same routes as queued there: each goes back to the queue once
    and is counted once, as withdrawn."""
    core = ControlCore(make_config(), prompt_len=prompt_len)
    for iid in ("a", "b"):
        core.handle(InstanceJoined(at=0.0, instance_id=iid, kv_capacity_tokens=10_000, version=0))
        core.handle(Reported(at=0.1, instance_id=iid, snapshot=InstanceSnapshot(
            instance_id=iid, seq=1, time_s=0.1, version=0, kv_capacity_tokens=10_000)))  # fmt: skip
    out = core.handle(Cycle(at=0.2))
    on_a = [t for e in out if isinstance(e, fx.Route) and e.instance_id == "a"
            for t in e.trajectory_ids]  # fmt: skip
    assert on_a, out
    core.handle(InstanceSilent(at=1.0, instance_id="a", withdrawn=on_a))
    core.handle(InstanceLost(at=1.1, instance_id="a", requeued=[(t, 0) for t in on_a]))
    assert ledger_problems(core) == []
    c = core.counters
    assert (c["withdrawn_routes"], c["lost_requeued"], c["instances_silent"]) == (len(on_a), 0, 1)
    assert all(core.ledger.get(t).where.value == "queued" for t in on_a)  # type: ignore[union-attr]
