"""The simulator: the real protocol and coordinator driving sim engines in virtual time.

Theory of operation
-------------------
One process, one virtual clock ``now``. Components:

* ``StalenessProtocol`` and ``Coordinator`` (the real ones; the policy is a registry name);
* one ``SimEngineCore`` per rollout instance (closed-form continuous batching);
* a length-only :class:`~staleflow_trainer.sim.ledger.TrajectoryLedger` in place of the
  trajectory server (same multi-level queue order);
* a modeled trainer and param server (:class:`~staleflow_trainer.sim.spec.SimSpec` timings).

The loop repeatedly jumps to the earliest pending event, in this order at equal times:
engine boundaries (completions, KV exhaustion, weight-load end), timed events (sync done,
reward done, training done, push done), then a coordinator cycle. Cycles run on a fixed grid
of ``cycle_period_s`` and are coalesced: a cycle is scheduled only when something changed
since the last one (an engine event, a publish, a finished sync or step, a trainer consume),
at the next grid point. When the trainer is idle and the protocol's buffer is READY it
consumes it, trains for the modeled time, pushes for the modeled time, then publishes the
new version to the coordinator (instances may pull it from then on).

The colocated ``sync`` policy uses every GPU for both phases; its batch barrier only starts a
batch once the previous one is trained and loaded, so rollout never overlaps training.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable
from typing import Any, cast

import structlog

from engine_adapters._contract import FinishReason, SamplingParams
from engine_adapters.sim import SimConfig as EngineSimConfig
from engine_adapters.sim import SimEngineCore
from engine_adapters.sim.cost import CostModel as EngineCost
from rollout_coordinator import (
    Coordinator,
    CoordinatorConfig,
    Drop,
    Interrupt,
    QueueView,
    Route,
    Sync,
)
from rollout_coordinator import CostModel as CoordCost
from staleflow_trainer.config import GC_FIFO_POLICIES
from staleflow_trainer.protocol_mode import gc_fifo_config
from staleflow_trainer.sim.ledger import TrajectoryLedger, TrajEntry, Where
from staleflow_trainer.sim.metrics import RunRecorder
from staleflow_trainer.sim.requests import build_request
from staleflow_trainer.sim.spec import SimSpec
from staleflow_trainer.sim.workload import PromptStream
from staleness_protocol import (
    Abort,
    FinishStatus,
    GcFifo,
    ProtocolConfig,
    StalenessProtocol,
    UnboundedConfig,
    UnboundedFifo,
    UnknownTrajectory,
)

_log = structlog.get_logger("staleflow.simulate")

# timed event kinds
_SYNC_DONE = 0
_REWARD_DONE = 1
_TRAIN_DONE = 2
_PUSH_DONE = 3
_EPS = 1e-9  # the sim engine's boundary tolerance


class Simulation:
    """One simulated run of ``spec``; :meth:`run` returns the recorder with all metrics."""

    def __init__(self, spec: SimSpec, *, recorder: RunRecorder | None = None) -> None:
        self.spec = spec
        self.now = 0.0
        s = spec
        self.protocol: StalenessProtocol | UnboundedFifo
        if s.policy in GC_FIFO_POLICIES:  # η kept by dropping what ages out of one FIFO
            self.protocol = GcFifo(
                gc_fifo_config(s.batch_size, s.group_size, int(s.eta), s.dynamic_sampling)
            )
        elif s.eta == "unbounded":  # no staleness control: same methods, FIFO, no bound
            self.protocol = UnboundedFifo(
                UnboundedConfig(
                    batch_size=s.batch_size,
                    group_size=s.group_size,
                    max_inflight_groups=s.unbounded_inflight_batches * s.batch_size,
                    group_redundancy=s.group_redundancy if s.redundant else 0,
                    filtering=s.dynamic_sampling,
                )
            )
        else:
            self.protocol = StalenessProtocol(
                ProtocolConfig(
                    batch_size=s.batch_size,
                    group_size=s.group_size,
                    eta=int(s.eta),
                    filtering=s.dynamic_sampling,
                    stuck_threshold=(
                        s.stuck_threshold if s.stuck_threshold and s.redundant else None
                    ),
                    batch_redundancy=s.batch_redundancy if s.redundant else 0,
                    group_redundancy=s.group_redundancy if s.redundant else 0,
                )
            )
        coeffs = {"k1": s.k1, "k2": s.k2, "k3": s.k3, "k4": s.k4, "b": s.k_inner}
        self.coord = Coordinator(
            CoordinatorConfig(
                policy=s.policy,
                cost_model=CoordCost(name=s.cost_model, **coeffs),
                theta=s.theta,
                migration_ratio=s.migration_ratio,
                sync_kv_threshold=s.sync_kv_threshold,
            ),
            cast(StalenessProtocol, self.protocol),
            clock=lambda: self.now,
        )
        engine_cfg = EngineSimConfig(
            cost=EngineCost(name=s.cost_model, **coeffs),
            max_running=s.max_running,
            kv_capacity_tokens=s.kv_capacity_tokens,
            max_model_len=s.max_model_len,
            prefill_s_per_token=s.prefill_s_per_token,
            weight_bandwidth_bytes_per_s=s.pull_bandwidth_gb_s * 1e9,
            weight_load_constant_s=s.transfer_overhead_s,
            seed=s.seed,
        )
        self.engines: dict[str, SimEngineCore] = {}
        self._next: dict[str, float] = {}
        for i in range(s.num_instances):
            iid = f"r{i:03d}"
            self.engines[iid] = SimEngineCore(engine_cfg, instance_id=iid)
            self._next[iid] = math.inf
            self.coord.add_instance(iid, kv_capacity_tokens=s.kv_capacity_tokens, version=0)
        self.sampling = SamplingParams(
            max_new_tokens=s.max_response_len, stop_token_ids=(engine_cfg.eos_token_id,)
        )
        self.ledger = TrajectoryLedger()
        self.stream = PromptStream(s)
        self._next_group = 0
        self.rec = recorder if recorder is not None else RunRecorder(spec, list(self.engines))
        self._events: list[tuple[float, int, int, Any]] = []
        self._eseq = itertools.count()
        self._dirty = True
        self._cycle_at: float | None = 0.0
        # trainer
        self._trainer_busy = False
        self._trainer_free_at = 0.0
        self._steps_done = 0
        self._stuck_checked_at = -math.inf
        self._released: set[str] = set()
        self._changed: set[str] = set(self.engines)
        self._snap_at = dict.fromkeys(self.engines, -math.inf)
        self.cycles = 0
        self.skipped_cycles = 0
        self.wall_s = 0.0

    # ---- prompt supply -----------------------------------------------------------------------

    def _stock_prompts(self) -> None:
        """Keep at least one batch of never-routed groups queued (the data loader)."""
        s = self.spec
        members = s.samples_per_group
        want = s.batch_size * members
        while self.ledger.new_queued < want:
            g = self.stream.group(self._next_group)
            gid = f"g{g.index}"
            for m, target in enumerate(g.response_lens[:members]):
                self.ledger.submit(TrajEntry(f"{gid}/{m}", gid, g.index, m, g.prompt_len, target))
            self._next_group += 1

    # ---- scheduling --------------------------------------------------------------------------

    def _at(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._events, (t, next(self._eseq), kind, payload))

    def _touch(self) -> None:
        if self._cycle_at is None:
            p = self.spec.cycle_period_s
            k = math.ceil(self.now / p - 1e-9)
            t = k * p
            if t <= self.rec.last_cycle_time + 1e-12:
                t += p
            self._cycle_at = t

    def _engine_changed(self, iid: str) -> None:
        self._changed.add(iid)
        eng = self.engines[iid]
        self._next[iid] = eng.next_event_time()
        self.rec.instance_state(
            iid, self.now, eng.loading, eng.num_running + eng.num_waiting, eng.version
        )

    # ---- main loop ---------------------------------------------------------------------------

    def run(self) -> RunRecorder:
        wall0 = time.perf_counter()
        s = self.spec
        self._stock_prompts()
        nxt = self._next
        events = self._events
        while self._steps_done < s.steps:
            t_eng = min(nxt.values())
            t_evt = events[0][0] if events else math.inf
            t_cyc = self._cycle_at if self._cycle_at is not None else math.inf
            t = min(t_eng, t_evt, t_cyc)
            if t == math.inf:
                raise RuntimeError(
                    f"simulation deadlocked at t={self.now:.3f}s after {self._steps_done} steps "
                    f"(policy {s.policy}, eta {s.eta}): no engine, timed or cycle event pending; "
                    f"protocol {self.protocol.stats()}"
                )
            self.now = t
            if t_eng <= t + _EPS:
                for iid, te in nxt.items():
                    if te <= t + _EPS:
                        self._on_engine(iid)
            while events and events[0][0] <= t:
                _, _, kind, payload = heapq.heappop(events)
                self._on_event(kind, payload)
            if self._cycle_at is not None and self._cycle_at <= t:
                self._cycle_at = None
                self._cycle()
            self._maybe_train()
        if self.protocol.stats().pending_notices:
            # aborts the protocol queued at the last event (e.g. group surplus) are executed
            # by the next cycle; run it so the run ends with the ledger and protocol agreeing
            self._dirty = True
            self._cycle()
        self.wall_s = time.perf_counter() - wall0
        self.rec.finish(self.now)
        return self.rec

    def _on_engine(self, iid: str) -> None:
        eng = self.engines[iid]
        was_loading = eng.loading
        for c in eng.advance_to(self.now):
            if (
                c.finish_reason is FinishReason.INTERRUPTED
            ):  # pragma: no cover - only via interrupt()
                continue
            self._finished(iid, c.trajectory_id, c.num_tokens)
        if was_loading and not eng.loading:
            self._at(self.now, _SYNC_DONE, (iid, eng.version))
        self._engine_changed(iid)
        self._dirty = True
        self._touch()

    def _ended_reason(self, tid: str) -> str:
        """Why the protocol ended a trajectory that is no longer in flight."""
        try:
            return self.protocol.trajectory(tid).reason or "aborted"
        except UnknownTrajectory:  # ended long ago: its tombstone was retired
            return "aborted"

    def _finished(self, iid: str, tid: str, generated: int) -> None:
        e = self.ledger.entries[tid]
        if self.protocol.live_version(tid) is None:
            # the protocol aborted it while the engine was finishing; its output is discarded
            self.ledger.drop(tid, self._ended_reason(tid), generated)
            self.coord.on_dropped([tid])
            self.rec.tokens_wasted += generated
            return
        reward = self.stream.reward(e.group_index, e.member)
        self.ledger.finish(tid, generated, reward)
        self.rec.tokens_generated_final += generated
        if self.spec.reward_time_s > 0:
            self._at(self.now + self.spec.reward_time_s, _REWARD_DONE, tid)
        else:
            self._rewarded(tid)

    def _rewarded(self, tid: str) -> None:
        e = self.ledger.entries[tid]
        if e.where is not Where.FINISHED:
            return  # dropped while its reward was computed
        if self.protocol.live_version(tid) is None:
            self.rec.tokens_wasted += e.generated
            self.ledger.drop(tid, self._ended_reason(tid))
            self.coord.on_dropped([tid])
            return
        placed = self.protocol.finish(tid).status is FinishStatus.OCCUPIED
        self.coord.on_finished([tid])
        if placed and self.spec.dynamic_sampling:
            finished = cast(tuple[str, ...], self.protocol.group(e.group).finished)  # sim ids: str
            rewards = {self.ledger.entries[t].reward for t in finished}
            if len(rewards) == 1:
                self.protocol.drop_group(e.group, "filtered")
                self.rec.groups_filtered += 1

    def _on_event(self, kind: int, payload: Any) -> None:
        if kind == _SYNC_DONE:
            iid, version = payload
            # Routes held for this sync are released into the next cycle's commands; until
            # they are executed the queue view must not offer them again.
            self._released.update(r.trajectory_id for r in self.coord.pending.held_for(iid))
            self.coord.on_sync_done(iid, version)
            self.rec.syncs_done += 1
        elif kind == _REWARD_DONE:
            self._rewarded(payload)
        elif kind == _TRAIN_DONE:
            self._at(self.now + self.spec.push_seconds, _PUSH_DONE, payload)
            self.rec.trainer_phase(self.now, "pushing")
        elif kind == _PUSH_DONE:
            version = payload
            self.protocol.publish(version)
            self._trainer_busy = False
            self._trainer_free_at = self.now
            self._steps_done += 1
            self.rec.step_done(self.now, version, self)
            self.rec.trainer_phase(self.now, "waiting")
        self._dirty = True
        self._touch()

    # ---- trainer -----------------------------------------------------------------------------

    def _maybe_train(self) -> None:
        if self._trainer_busy or self.protocol.next_buffer >= self.spec.steps:
            return
        proto = self.protocol
        if not proto.ready():
            thr = proto.config.stuck_threshold
            if (
                thr is not None
                and self.now - self._trainer_free_at >= self.spec.stuck_after_s
                and self.now > self._stuck_checked_at
            ):
                self._stuck_checked_at = self.now
                res = proto.resolve_stuck()
                if res.resolved:
                    self.rec.stuck_resolved += 1
                    self._dirty = True
                    self._touch()
            if not proto.ready():
                return
        batch = proto.consume()
        tokens = 0
        resp = 0
        rewards = 0.0
        n = 0
        for tids in batch.trajectory_ids:
            for tid in tids:
                e = self.ledger.consume(str(tid))
                tokens += e.tokens
                resp += e.generated
                rewards += e.reward
                n += 1
        train_s = self.spec.train_seconds(tokens)
        self._trainer_busy = True
        self.rec.step_consumed(
            self.now,
            batch,
            tokens=tokens,
            response_tokens=resp,
            reward_mean=rewards / max(n, 1),
            wait_s=self.now - self._trainer_free_at,
            train_s=train_s,
        )
        self.rec.trainer_phase(self.now, "training")
        self._at(self.now + train_s, _TRAIN_DONE, batch.version + 1)
        self._dirty = True
        self._touch()

    # ---- coordinator cycle -------------------------------------------------------------------

    def _cycle(self) -> None:
        if not self._dirty:
            self.skipped_cycles += 1
            return
        self._dirty = False
        self.cycles += 1
        self.rec.last_cycle_time = self.now
        self._stock_prompts()
        now = self.now
        for iid, eng in self.engines.items():  # anything within the engine's tolerance of now
            if eng.next_event_time() <= now + _EPS:
                self._on_engine(iid)
        # Snapshot the instances that changed since the last cycle (an event or a command) and
        # any whose last snapshot is older than snapshot_max_age_s; the coordinator's
        # speculative state carries the others (only their token counts have grown).
        max_age = self.spec.snapshot_max_age_s
        snap_at = self._snap_at
        changed = self._changed
        snaps = []
        for iid, eng in self.engines.items():
            if iid in changed or now - snap_at[iid] >= max_age:
                snaps.append(eng.snapshot(now))
                snap_at[iid] = now
        changed.clear()
        items = self.ledger.queue_items()
        pending = self.coord.pending
        if len(pending) or self._released:
            held = pending.trajectory_ids() | self._released
            items = [i for i in items if i.trajectory_id not in held]
            self._released = set()
        # the protocol's notices: its aborts become the coordinator's commands (replacement
        # requests need nothing here: the prompt stream is unbounded)
        aborts = [n for n in self.protocol.take_notices() if isinstance(n, Abort)]
        commands = self.coord.abort(aborts) if aborts else []
        commands += self.coord.step(snaps, QueueView(items), now)
        self._execute(commands)
        self.rec.cycle(now, self.coord.last_cycle, self.ledger)

    def _execute(self, commands: list[Any]) -> None:
        touched: set[str] = set()
        for cmd in commands:
            if isinstance(cmd, Route):
                self._route(cmd)
                touched.add(cmd.instance_id)
            elif isinstance(cmd, Interrupt):
                self._interrupt(cmd)
                touched.add(cmd.instance_id)
            elif isinstance(cmd, Sync):
                self._sync(cmd)
                touched.add(cmd.instance_id)
            elif isinstance(cmd, Drop):
                touched.update(self._abort(list(cmd.trajectory_ids), cmd.reason))
        for iid in touched:
            self._engine_changed(iid)

    def _abort(self, tids: list[str], reason: str) -> set[str]:
        """The protocol aborted these: stop them wherever they are, discard their output."""
        touched: set[str] = set()
        dropped: list[str] = []
        by_instance: dict[str, list[str]] = {}
        for tid in tids:
            e = self.ledger.entries.get(tid)
            if e is None:
                continue
            if e.where is Where.RUNNING:
                by_instance.setdefault(e.instance, []).append(tid)  # type: ignore[arg-type]
            elif e.where is Where.QUEUED or e.where is Where.FINISHED:
                self.rec.tokens_wasted += e.generated
                self.ledger.drop(tid, reason)
                dropped.append(tid)
        for iid, ids in by_instance.items():
            out = self._take_back(iid, ids)
            for tid, gen in out:
                self.rec.tokens_wasted += gen
                self.ledger.drop(tid, reason, gen)
                dropped.append(tid)
            self.coord.on_interrupted(iid, [t for t, _ in out])
            touched.add(iid)
        if dropped:
            self.coord.on_dropped(dropped)
            self.rec.aborts += len(dropped)
        return touched

    def _route(self, r: Route) -> None:
        e = self.ledger.route(r.trajectory_id, r.instance_id, r.version)
        req = build_request(e.tid, e.prompt_len, e.generated, e.target, self.sampling)
        self.engines[r.instance_id].add(req, self.now)
        self.rec.routes += 1

    def _take_back(self, iid: str, tids: list[str]) -> list[tuple[str, int]]:
        eng = self.engines[iid]
        held = [t for t in tids if eng.holds(t)]
        if not held:
            return []
        # completions that land exactly now are collected first (they finished, not stopped)
        for c in eng.advance_to(self.now):
            self._finished(iid, c.trajectory_id, c.num_tokens)
        held = [t for t in held if eng.holds(t)]
        return [(c.trajectory_id, c.num_tokens) for c in eng.interrupt(held, self.now)]

    def _interrupt(self, it: Interrupt) -> None:
        if not it.requeue:
            self._abort(list(it.trajectory_ids), it.reason)
            return
        out = self._take_back(it.instance_id, list(it.trajectory_ids))
        for tid, gen in out:
            self.ledger.return_partial(tid, gen)
        self.coord.on_interrupted(it.instance_id, [t for t, _ in out])
        if it.reason == "bounce":
            self.rec.bounces += len(out)
        else:
            self.rec.migrations += len(out)
        self.rec.interrupts += len(out)

    def _sync(self, s: Sync) -> None:
        iid = s.instance_id
        out = self._take_back(iid, self.ledger.held_by(iid))
        for tid, gen in out:
            self.ledger.return_partial(tid, gen)
        if out:
            self.coord.on_interrupted(iid, [t for t, _ in out])
            self.rec.sync_interrupts += len(out)
        eng = self.engines[iid]
        eng.load_weights(s.to_version, self.spec.model_bytes, self.now)
        self.rec.syncs += 1


def run_spec(
    spec: SimSpec, recorder_factory: Callable[[SimSpec, list[str]], RunRecorder] | None = None
) -> Simulation:
    """Build and run one simulation; returns it (``.rec`` holds the metrics)."""
    sim = (
        Simulation(spec)
        if recorder_factory is None
        else Simulation(
            spec, recorder=recorder_factory(spec, [f"r{i:03d}" for i in range(spec.num_instances)])
        )
    )
    sim.run()
    _log.info(
        "simulation_done",
        policy=spec.policy,
        eta=spec.eta,
        steps=spec.steps,
        virtual_s=round(sim.now, 1),
        wall_s=round(sim.wall_s, 2),
        cycles=sim.cycles,
    )
    return sim
