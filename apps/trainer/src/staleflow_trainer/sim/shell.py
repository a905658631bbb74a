"""The simulator: the control core driving sim engines in virtual time.

Theory of operation
-------------------
One process, one virtual clock ``now``. The shell owns what the core does not decide: the
clock, one ``SimEngineCore`` per rollout instance (closed-form continuous batching), the
synthetic prompt stream (prompt and response lengths, rewards), and the modeled trainer and
parameter server (:class:`~staleflow_trainer.sim.spec.SimSpec` timings). Every decision —
feeding prompts, admission, routing, syncs, migration, aborts, filtering, training, stuck
buffers — is the :class:`~staleflow_trainer.control.ControlCore`'s, the same one the Ray
deployment runs.

The loop jumps to the earliest pending thing, in this order at equal times: engine
boundaries (completions and the end of a weight load become ``Reported`` / ``SyncDone``),
timed events (rewards computed, a step trained and pushed), then a coordinator cycle (fresh
snapshots of the instances that changed, then ``Cycle``). Cycles run on a fixed grid of
``cycle_period_s`` and are coalesced: one is scheduled only when something changed since the
last, at the next grid point. Effects are carried out at once; an effect that produces
results (an interrupt, a sync) feeds them back as events after the current effects are done.

The shell reads the core's ledger for a routed trajectory's lengths — the length-only
stand-in for the trajectory store the Ray deployment reads payloads from.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Any

import attrs
import structlog

from engine_adapters import SamplingParams
from engine_adapters.sim import SimEngineCore
from rollout_coordinator import InstanceSnapshot, RunningEntry, RunningRows
from staleflow_trainer.control import ControlCore, core_config
from staleflow_trainer.control import effects as fx
from staleflow_trainer.control.events import (
    Cycle,
    Event,
    InstanceJoined,
    Outcome,
    Reported,
    Reward,
    Rewarded,
    SyncDone,
    Trained,
)
from staleflow_trainer.errors import StaleflowError
from staleflow_trainer.sim.host import SharedHost
from staleflow_trainer.sim.metrics import RunRecorder
from staleflow_trainer.sim.requests import build_request
from staleflow_trainer.sim.spec import SimSpec, spec_from_app_config
from staleflow_trainer.sim.workload import PromptStream

_log = structlog.get_logger("staleflow.simulate")

_REWARDS = 0
_TRAINED = 1
_PUSHED = 2
_COMPUTED = 3  # sim.host_cores: the trainer's compute ends (payload: the SharedHost token)
_EPS = 1e-9  # the sim engine's boundary tolerance
#: The collector's first threshold while the loop runs. The loop allocates millions of
#: short-lived tuples and records that reference counting frees; at Python's default (700
#: allocations) the collector scans the young objects thousands of times a run for the few
#: cycles among them, 5-7 % of a run's time. Results do not depend on it.
_GC_GEN0 = 100_000


class SimulationHalted(StaleflowError, RuntimeError):
    """The core halted the simulated run (e.g. an instance failed to sync too often); the CLI
    prints it as one line, as it does the deployment's ``ComponentLost``."""


class Simulation:
    """One simulated run of an app config; :meth:`run` returns the recorder with the metrics.

    ``on_event``, if given, sees every event just before the core handles it, in order (the
    journal benchmark records them as the Ray shell's write-ahead journal would)."""

    def __init__(
        self,
        cfg: Any,
        *,
        recorder: RunRecorder | None = None,
        on_event: Callable[[Event], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.on_event = on_event
        self.spec: SimSpec = spec_from_app_config(cfg)
        s = self.spec
        self.stream = PromptStream(s)
        stream = self.stream
        self.core = ControlCore(
            core_config(cfg, rows=None), prompt_len=lambda row: stream.group(row).prompt_len
        )
        engine_cfg = s.engine
        self.engine_config = engine_cfg
        self.engines: dict[str, SimEngineCore] = {}
        self._next: dict[str, float] = {}
        self.sampling = SamplingParams(
            max_new_tokens=s.max_response_len, stop_token_ids=(engine_cfg.eos_token_id,)
        )
        self.now = 0.0
        self.rec = recorder if recorder is not None else RunRecorder(s, [])
        self._timed: list[tuple[float, int, int, Any]] = []
        self._tseq = itertools.count()
        self._pending: deque[Event] = deque()
        self._dirty = True
        self._cycle_at: float | None = 0.0
        self._last_cycle = -1.0
        self._changed: set[str] = set()
        self._snap_at: dict[str, float] = {}
        self._seq_len: dict[str, int] = {}  # scored trajectories' prompt + response lengths
        self._streamed: _Streamed | None = None  # the next step's parts (stream_batch)
        self._stream_busy_s = 0.0  # of the step in training: its parts' work before its Train
        self._host = SharedHost(s) if s.host_cores is not None else None
        self._trained_version = 0  # with a shared host: the version the step in compute makes
        self.cycles = 0
        self.wall_s = 0.0
        for i in range(s.num_instances):
            self.add_engine(f"r{i:03d}", version=0, setup=True)

    # ---- instances ---------------------------------------------------------------------------

    def add_engine(self, iid: str, *, version: int, setup: bool = False) -> None:
        config = self.engine_config
        speed = self.spec.speed_of(len(self.engines))
        if speed != 1.0:
            config = attrs.evolve(config, speed_factor=speed)
        eng = SimEngineCore(config, instance_id=iid, version=version)
        self.engines[iid] = eng
        self._next[iid] = eng.next_event_time()
        self._snap_at[iid] = -math.inf
        self._changed.add(iid)
        self.rec.add_instance(iid)
        self.feed(
            InstanceJoined(
                at=self.now,
                instance_id=iid,
                kv_capacity_tokens=self.engine_config.kv_capacity,
                version=eng.version,
                setup=setup,
            )
        )

    # ---- the event loop ----------------------------------------------------------------------

    def feed(self, event: Event) -> None:
        """Hand ``event`` to the core and carry out its effects (and any events they cause)."""
        self._pending.append(event)
        while self._pending:
            ev = self._pending.popleft()
            if self.on_event is not None:
                self.on_event(ev)
            self.apply(self.core.handle(ev))
        self._dirty = True
        self._touch()

    def _at(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._timed, (t, next(self._tseq), kind, payload))

    def _touch(self) -> None:
        if self._cycle_at is None:
            p = self.spec.cycle_period_s
            t = math.ceil(self.now / p - 1e-9) * p
            if t <= self._last_cycle + 1e-12:
                t += p
            self._cycle_at = t

    def run(self) -> RunRecorder:
        thresholds = gc.get_threshold()
        gc.set_threshold(max(_GC_GEN0, thresholds[0]), *thresholds[1:])
        try:
            return self._run()
        finally:
            gc.set_threshold(*thresholds)

    def _run(self) -> RunRecorder:
        wall0 = time.perf_counter()
        nxt = self._next
        timed = self._timed
        while not self.core.done:
            t_eng = min(nxt.values(), default=math.inf)
            t_evt = timed[0][0] if timed else math.inf
            t_cyc = self._cycle_at if self._cycle_at is not None else math.inf
            t = min(t_eng, t_evt, t_cyc)
            if t == math.inf:
                raise RuntimeError(
                    f"simulation deadlocked at t={self.now:.3f}s after {self.core.steps_done} "
                    f"steps (policy {self.spec.policy}, eta {self.spec.eta}): nothing pending; "
                    f"protocol {self.core.protocol.stats()}"
                )
            self.now = t
            if t_eng <= t + _EPS:
                for iid in [i for i, te in nxt.items() if te <= t + _EPS]:
                    self._on_engine(iid)
            while timed and timed[0][0] <= t:
                _, _, kind, payload = heapq.heappop(timed)
                self._on_timed(kind, payload)
            if self._cycle_at is not None and self._cycle_at <= t:
                self._cycle_at = None
                self._cycle()
            if self._host is not None and self._host.training:
                self._share_host()  # who has work may have changed at t
        self.wall_s = time.perf_counter() - wall0
        self.rec.finish(self.now, self.core)
        return self.rec

    def _on_engine(self, iid: str) -> None:
        eng = self.engines[iid]
        was_loading = eng.loading
        outcomes = [
            Outcome(
                trajectory_id=c.trajectory_id, generated=c.num_tokens, finish=c.finish_reason.value
            )
            for c in eng.advance_to(self.now)
        ]
        self._engine_changed(iid)
        if outcomes:
            self._report(iid, outcomes)
        if was_loading and not eng.loading:
            self.feed(SyncDone(at=self.now, instance_id=iid, version=eng.version))
        self._dirty = True
        self._touch()

    def _report(self, iid: str, outcomes: list[Outcome]) -> None:
        """An engine's completions reach the core (its output is in the store)."""
        self.feed(Reported(at=self.now, instance_id=iid, outcomes=outcomes))

    def _engine_changed(self, iid: str) -> None:
        self._changed.add(iid)
        self._next[iid] = self.engines[iid].next_event_time()

    def _on_timed(self, kind: int, payload: Any) -> None:
        if kind == _REWARDS:
            self.feed(Rewarded(at=self.now, rewards=payload))
        elif kind == _COMPUTED:
            host = self._host
            if host is not None and host.training and payload == host.token:
                host.finish()
                self._share_host()
                # the rest of the step is trainer.step_delay_s, a wait: never shared
                self._at(self.now + self.spec.trainer_step_delay_s, _TRAINED, self._trained_version)
        elif kind == _TRAINED:
            self.rec.trainer_phase(self.now, "pushing")
            self._at(self.now + self.spec.push_seconds, _PUSHED, payload)
            self._dirty = True
            self._touch()
        elif kind == _PUSHED:
            self.rec.trainer_phase(self.now, "waiting")
            metrics = {"push_s": self.spec.push_seconds}
            if self.core.config.stream_batch:
                metrics["stream_busy_s"] = self._stream_busy_s
            self.feed(Trained(at=self.now, version=payload, metrics=metrics))

    def _cycle(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        self.cycles += 1
        self._last_cycle = now = self.now
        nxt = self._next  # each engine's next_event_time(), kept current
        for iid in self.engines:  # anything within the engine's tolerance of now
            if nxt[iid] <= now + _EPS:
                self._on_engine(iid)
        # Fresh snapshots of the instances that changed since the last cycle (an event or a
        # command) and of any whose last one is older than snapshot_max_age_s; the core's
        # speculative state carries the others (only their token counts have grown).
        max_age = self.spec.snapshot_max_age_s
        for iid in sorted(self.engines):
            if iid in self._changed or now - self._snap_at[iid] >= max_age:
                self._snap_at[iid] = now
                snap = _instance_snapshot(self.engines[iid], now)
                self._pending.append(Reported(at=now, instance_id=iid, snapshot=snap))
        self._changed.clear()
        self.feed(Cycle(at=now))
        self._dirty = False

    # ---- effects -----------------------------------------------------------------------------

    def apply(self, effects: list[fx.Effect]) -> None:
        for e in effects:
            if isinstance(e, fx.Route):
                self._route(e)
            elif isinstance(e, fx.Interrupt):
                self._take_back(e.instance_id, list(e.trajectory_ids))
            elif isinstance(e, fx.Sync):
                self._take_back(e.instance_id, None)
                eng = self.engines[e.instance_id]
                eng.load_weights(e.version, self.spec.model_bytes, self.now)
                self._engine_changed(e.instance_id)
            elif isinstance(e, fx.Score):
                self._score(e.trajectory_ids)
            elif isinstance(e, fx.TrainPart):
                self._stream_in(e)
            elif isinstance(e, fx.Train):
                self._train(e)
            elif isinstance(e, fx.Record):
                self.rec.add_step(dict(e.row), self)
            elif isinstance(e, fx.Checkpoint):
                self.on_checkpoint(e.step)
            elif isinstance(e, fx.Halt):
                raise SimulationHalted(f"{e.component}: {e.reason}")
            # SubmitGroups, Drop, DropGroup, Release, Done: nothing to store or free here

    def _stream_in(self, part: fx.TrainPart) -> None:
        """Groups settled in the next batch: the trainer works on them while it waits, one
        part after another (a group already in is not counted twice)."""
        st = self._streamed
        if st is None or st.version != part.version:
            st = self._streamed = _Streamed(part.version, self.now)
        lengths, missing = self._pop_lengths(part, st.groups)
        st.groups.update(part.group_ids)
        mean = round(part.tokens / max(len(part.flat_ids), 1))  # one scored before a restore
        tokens = sum(lengths) + missing * mean
        sq = sum(float(n) ** 2 for n in lengths) + missing * float(mean) ** 2
        work, _ = self.spec.train_split(tokens, sq)
        begin = max(st.free_at, self.now)
        st.free_at = begin + work
        self.rec.trainer_streaming(begin, st.free_at)
        st.tokens += tokens
        st.sq += sq
        st.work_s += work

    def _train(self, e: fx.Train) -> None:
        """The step starts once the streamed parts are done; what they did not cover follows,
        then the per-step rest (optimizer, offload, fixed costs)."""
        st, self._streamed = self._streamed, None
        if st is not None and st.version != e.version:
            st = None  # parts of an older step (none reach a shell after their Train)
        sq = self._seq_sq_sum(e, st)  # the groups not streamed in
        start, self._stream_busy_s = self.now, 0.0
        if st is not None:
            start = max(self.now, st.free_at)
            self._stream_busy_s = st.work_s - (start - self.now)
        tokens = e.tokens - (st.tokens if st is not None else 0)
        work, per_step = self.spec.train_split(tokens, sq)
        self.rec.trainer_phase(self.now, "training")
        if self._host is None:
            self._at(start + work + per_step, _TRAINED, e.version + 1)
            return
        # a shared host (no streamed parts there: start is now): the compute is shared
        self._trained_version = e.version + 1
        self._host.start(self.now, work + per_step - self.spec.trainer_step_delay_s)
        self._share_host()

    def _share_host(self) -> None:
        """``sim.host_cores``: take the shares for the instances with work now
        (:class:`SharedHost`), set every instance's pace to it, and schedule the end of the
        trainer's compute when it moved."""
        host = self._host
        if host is None:
            return
        now = self.now
        busy = sum(
            1
            for eng in self.engines.values()
            if (eng.num_running or eng.num_waiting) and not eng.loading
        )
        end = host.shares(now, busy)
        if end is not None:
            self._at(end, _COMPUTED, host.token)
        pace = host.pace
        for iid, eng in self.engines.items():
            if eng.pace != pace:
                eng.set_pace(pace, now)
                self._engine_changed(iid)

    def _seq_sq_sum(self, train: fx.Train, streamed: _Streamed | None = None) -> float:
        """Sum of the squared sequence lengths (prompt + response) of the batch's groups not
        ``streamed`` in: attention cost. Lengths are noted when a trajectory is scored (the
        ledger forgets a group once it is consumed); one not noted (a run restored mid-step)
        counts at the batch's mean."""
        lengths, missing = self._pop_lengths(train, () if streamed is None else streamed.groups)
        total = sum(float(n) ** 2 for n in lengths)
        if missing:
            tokens = train.tokens - (streamed.tokens if streamed is not None else 0)
            total += missing * (max(tokens - sum(lengths), 0) / missing) ** 2
        return total

    def _pop_lengths(
        self, groups: fx.Train | fx.TrainPart, skip: Collection[str]
    ) -> tuple[list[int], int]:
        """The noted sequence lengths (prompt + response) of ``groups``' members outside the
        groups in ``skip``, forgotten here, and how many of those members have none noted."""
        lengths: list[int] = []
        missing = 0
        for gid, members in zip(groups.group_ids, groups.trajectory_ids, strict=True):
            if gid in skip:
                continue
            for tid in members:
                n = self._seq_len.pop(tid, None)
                if n is None:
                    missing += 1
                else:
                    lengths.append(n)
        return lengths, missing

    def on_checkpoint(self, step: int) -> None:
        """A checkpoint is due (the fault simulation keeps the core's state)."""

    def _route(self, r: fx.Route) -> None:
        led = self.core.ledger
        reqs = []
        for tid in r.trajectory_ids:
            e = led.entries.get(tid)
            if e is None:  # let go again later in the same event (its group settled)
                continue
            row = led.groups[e.group].row
            target = self.stream.group(row).response_lens[e.member]
            reqs.append(build_request(tid, e.prompt_len, e.generated, target, self.sampling))
        self.engines[r.instance_id].add_many(reqs, self.now)
        self._engine_changed(r.instance_id)

    def _take_back(self, iid: str, tids: list[str] | None) -> None:
        eng = self.engines.get(iid)
        if eng is None:
            return
        # completions that land exactly now are collected first (they finished, not stopped)
        done = eng.advance_to(self.now)
        held = None if tids is None else [t for t in tids if eng.holds(t)]
        stopped = eng.interrupt(held, self.now) if held is None or held else []
        outcomes = [
            Outcome(
                trajectory_id=c.trajectory_id, generated=c.num_tokens, finish=c.finish_reason.value
            )
            for c in done
        ] + [Outcome(trajectory_id=c.trajectory_id, generated=c.num_tokens) for c in stopped]
        self._engine_changed(iid)
        if outcomes:
            self._pending.append(Reported(at=self.now, instance_id=iid, outcomes=outcomes))

    def _score(self, tids: tuple[str, ...]) -> None:
        led = self.core.ledger
        rewards = []
        for tid in tids:
            e = led.entries.get(tid)
            if e is None:  # dropped later in the same event (its group settled)
                continue
            self._seq_len[tid] = e.prompt_len + e.generated
            row = led.groups[e.group].row
            rewards.append(Reward(trajectory_id=tid, score=self.stream.reward(row, e.member)))
        if self.spec.reward_time_s > 0:
            self._at(self.now + self.spec.reward_time_s, _REWARDS, tuple(rewards))
        else:
            self._pending.append(Rewarded(at=self.now, rewards=rewards))


class _Streamed:
    """The parts of the next training step streamed in so far (``trainer.stream_batch``)."""

    __slots__ = ("free_at", "groups", "sq", "tokens", "version", "work_s")

    def __init__(self, version: int, now: float) -> None:
        self.version = version
        self.free_at = now  # the trainer is done with the parts so far
        self.groups: set[str] = set()
        self.tokens = 0
        self.sq = 0.0
        self.work_s = 0.0


def _instance_snapshot(eng: SimEngineCore, now: float) -> InstanceSnapshot:
    """``InstanceSnapshot.from_engine(eng.snapshot(now))``, without the engine's own
    per-trajectory records, and unchecked: the simulated engine's snapshots meet the checks
    by construction (``tests/test_sim_snapshots_checked.py`` runs a simulation with every
    snapshot checked). The running list is :class:`RunningRows` over the engine's columns:
    its entries are built only if the coordinator reads them (most cycles of most policies
    read only the count)."""
    r = eng.snapshot_rows(now)
    head = r.head
    running = RunningRows(
        r.running_ids,
        r.running_prompts,
        r.running_base,
        r.decode_steps,
        () if head is None else (RunningEntry(*head),),
    )
    return InstanceSnapshot.unchecked(
        r.instance_id,
        r.seq,
        r.time_s,
        r.version,
        running,
        r.waiting,
        r.kv_used_tokens,
        r.kv_capacity_tokens,
        r.throughput_tokens_per_s,
    )


def run_simulation(cfg: Any) -> Simulation:
    """Build and run one simulation of ``cfg``; returns it (``.rec`` holds the metrics)."""
    sim = Simulation(cfg)
    sim.run()
    _log.info(
        "simulation_done",
        policy=sim.spec.policy,
        eta=sim.spec.eta,
        steps=sim.core.steps_done,
        virtual_s=round(sim.now, 1),
        wall_s=round(sim.wall_s, 2),
        cycles=sim.cycles,
    )
    return sim
