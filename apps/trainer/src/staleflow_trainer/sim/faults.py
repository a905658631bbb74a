"""Randomized faults on the simulator: instance deaths and restarts, and trainer crashes that
restart the whole app from its last checkpoint. The ledger is checked after every fault.

Theory of operation
-------------------
:class:`FaultySimulation` is the :class:`~staleflow_trainer.sim.shell.Simulation` with three
more timed events, drawn from a seeded RNG (:class:`FaultPlan`):

* *instance death* — a live engine disappears; the core is told (``InstanceLost``) with what
  the store held for each trajectory it ran (output since the last report is lost). As in
  the Ray deployment, the first ``rollout.replace_lost`` losses are replaced: a *restart*
  brings the instance back ``down_s`` later (its start-up), serving the latest published
  version (``InstanceJoined``), as a replacement instance that pulled it would; a loss beyond
  them is not replaced (deaths never leave fewer than ``FaultPlan.min_alive``). A share
  ``death_after_finish`` of deaths strike right after the engine finished work and before
  its report reached the core (a real instance killed after writing finished output to the
  trajectory store, its poll answer lost): the loss carries those finished trajectories
  (``InstanceLost.finished``), which go on to reward instead of back to the queue;
* *trainer crash* — the app restarts from the last checkpoint (one every
  ``checkpoint_every`` steps): the core is restored from the state it had then, exactly as
  ``staleflow train`` resumes. Every instance of that state is lost and rejoins fresh at the
  checkpoint's version (their work goes back to the queue), rewards not yet scored are asked
  for again; pending training, syncs and rewards of the crashed app are gone.

After every fault, and at the end, :func:`~staleflow_trainer.control.checks.ledger_problems`
must be empty: every admitted trajectory is consumed, in flight or dropped with a reason, the
totals balance, and consumed staleness stays within η.
"""

from __future__ import annotations

import heapq
import json
import random
from typing import Any

import attrs

from staleflow_trainer.config import MAX_REPLACEMENTS
from staleflow_trainer.control import ControlCore
from staleflow_trainer.control.checks import ledger_problems
from staleflow_trainer.control.events import InstanceLost, Outcome
from staleflow_trainer.sim.shell import _PUSHED, Simulation

_KILL = 100
_REVIVE = 101
_CRASH = 102
_LOSE_UNREPORTED = 103


@attrs.frozen(kw_only=True)
class FaultPlan:
    """Rates are per virtual second. ``min_alive``: deaths never leave fewer live instances."""

    seed: int = 0
    instance_death_rate: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    down_s: float = attrs.field(default=5.0, validator=attrs.validators.gt(0.0))
    trainer_crash_rate: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    min_alive: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    check_every_fault: bool = True
    #: share of instance deaths that strike after the engine's next completion, before the
    #: core saw it (only engines with work; the others die at once)
    death_after_finish: float = attrs.field(
        default=0.0, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)]
    )


class FaultySimulation(Simulation):
    """``Simulation`` + :class:`FaultPlan`; counters in :attr:`faults`. Checkpoints follow the
    config's ``run.checkpoint_every``."""

    def __init__(self, cfg: Any, plan: FaultPlan) -> None:
        self.plan = plan
        self._rng = random.Random(plan.seed)
        self._ckpt: dict[str, Any] | None = None
        self._dead: set[str] = set()
        self.faults: dict[str, int] = dict.fromkeys(
            (
                "instance_deaths",
                "instance_restarts",
                "replacements_started",
                "lost_requeued",
                "deaths_after_finish",
                "lost_finished",
                "trainer_crashes",
                "steps_rolled_back",
                "ledger_checks",
            ),
            0,
        )
        self.steps_trained = 0  # training steps completed, counting those later rolled back
        self._doomed: set[str] = set()  # to die right after their next completion
        self._unreported: dict[str, list[Outcome]] = {}  # finished, their report never sent
        super().__init__(cfg)
        self._schedule(_KILL, plan.instance_death_rate)
        self._schedule(_CRASH, plan.trainer_crash_rate)

    # ---- scheduling -----------------------------------------------------------------------

    def _schedule(self, kind: int, rate: float) -> None:
        if rate > 0:
            self._at(self.now + self._rng.expovariate(rate), kind, None)

    def _on_timed(self, kind: int, payload: Any) -> None:
        if kind == _KILL:
            self._kill()
            self._schedule(_KILL, self.plan.instance_death_rate)
        elif kind == _REVIVE:
            self._revive(payload)
        elif kind == _CRASH:
            self._crash()
            self._schedule(_CRASH, self.plan.trainer_crash_rate)
        elif kind == _LOSE_UNREPORTED:
            finished = self._unreported.pop(payload, None)
            if finished is None:  # the app restarted meanwhile
                return
            self._die(payload, finished=finished)
            self.faults["deaths_after_finish"] += 1
        else:
            if kind == _PUSHED:
                self.steps_trained += 1
            super()._on_timed(kind, payload)
            return
        if self.plan.check_every_fault:
            self.check()

    def on_checkpoint(self, step: int) -> None:
        self._ckpt = json.loads(json.dumps(self.core.to_dict()))

    # ---- faults ---------------------------------------------------------------------------

    def _kill(self) -> None:
        live = sorted(i for i in self.engines if i not in self._doomed | set(self._unreported))
        if len(live) <= self.plan.min_alive:
            return
        iid = self._rng.choice(live)
        after = self.plan.death_after_finish
        if after and self._rng.random() < after and self.core.ledger.held_by(iid):
            self._doomed.add(iid)  # dies at its next completion (see _report)
            return
        self._die(iid)

    def _die(self, iid: str, *, finished: list[Outcome] | None = None) -> None:
        """``iid`` dies now (see :meth:`_lose_engine`); while ``rollout.replace_lost`` allows
        another replacement, it comes back ``down_s`` later."""
        self._lose_engine(iid, finished=finished)
        self._dead.add(iid)
        self.faults["instance_deaths"] += 1
        if self.faults["replacements_started"] < self.cfg.rollout.replace_lost:
            self.faults["replacements_started"] += 1
            self._at(self.now + self.plan.down_s, _REVIVE, iid)

    def _report(self, iid: str, outcomes: list[Outcome]) -> None:
        if iid not in self._doomed or not any(o.finish is not None for o in outcomes):
            super()._report(iid, outcomes)
            return
        # the output is in the store, the report dies with the engine: it leaves once this
        # moment's engine boundaries are handled (a timed event at the same time)
        self._doomed.discard(iid)
        self._unreported[iid] = outcomes
        self._at(self.now, _LOSE_UNREPORTED, iid)

    def _lose_engine(self, iid: str, *, finished: list[Outcome] | None = None) -> None:
        """The engine is gone: what it ran goes back to the queue with what the store held;
        ``finished``: what it finished (in the store) that the core has not seen."""
        del self.engines[iid]
        del self._next[iid]
        self._snap_at.pop(iid, None)
        self._changed.discard(iid)
        led = self.core.ledger
        done = list(finished or ())
        ids = {o.trajectory_id for o in done}
        held = [(t, led.entries[t].generated) for t in led.held_by(iid) if t not in ids]
        self.faults["lost_requeued"] += len(held)
        self.faults["lost_finished"] += len(done)
        self.feed(InstanceLost(at=self.now, instance_id=iid, requeued=held, finished=done))

    def _revive(self, iid: str) -> None:
        if iid not in self._dead:
            return
        self._dead.discard(iid)
        self.add_engine(iid, version=self.core.published)
        self.faults["instance_restarts"] += 1

    def _crash(self) -> None:
        """The trainer died: the whole app restarts from the last checkpoint."""
        if self._ckpt is None:
            return
        self.faults["trainer_crashes"] += 1
        stream = self.stream
        restored = ControlCore.restore(
            self._ckpt, self.core.config, prompt_len=lambda row: stream.group(row).prompt_len
        )
        self.faults["steps_rolled_back"] += self.core.steps_done - restored.steps_done
        self.core = restored
        restored.now = self.now  # the shell's clock goes on
        work = restored.pending_work()  # before any event: they may start new work
        # pending training, pushes, syncs and rewards died with the app; faults stay scheduled
        self._timed[:] = [ev for ev in self._timed if ev[2] >= _KILL]
        heapq.heapify(self._timed)
        self._streamed, self._stream_busy_s = None, 0.0  # its streamed parts died with it
        self.rec.trainer_phase(self.now, "waiting")
        self._doomed.clear()
        self._unreported.clear()
        alive = sorted(self.engines)
        for iid in alive:
            del self.engines[iid]
            del self._next[iid]
        for iid in restored.instances():  # every instance of the checkpoint restarts
            led = restored.ledger
            held = [(t, led.entries[t].generated) for t in led.held_by(iid)]
            self.feed(InstanceLost(at=self.now, instance_id=iid, requeued=held))
        self.apply(work)
        for iid in alive:
            self.add_engine(iid, version=restored.published)

    # ---- checks ---------------------------------------------------------------------------

    def check(self) -> dict[str, int]:
        """The ledger check (raises on any lost or double-counted trajectory, or a consumed
        sample staler than η); returns the per-state counts."""
        problems = ledger_problems(self.core)
        if problems:
            raise AssertionError(f"ledger problems at t={self.now:.2f}: {problems[:5]}")
        self.faults["ledger_checks"] += 1
        return self.core.ledger.counts()

    def run(self) -> Any:
        rec = super().run()
        self.check()
        return rec


def faulty_config(
    *,
    instances: int = 8,
    steps: int = 50,
    batch: int = 4,
    group: int = 4,
    eta: int = 1,
    seed: int = 0,
    response_len_median: int = 64,
    checkpoint_every: int = 5,
    replace_lost: int = MAX_REPLACEMENTS,
) -> Any:
    """A small, fast workload for fault runs (tiny responses, cheap trainer); by default every
    lost instance is replaced."""
    from staleflow_trainer.config import load_config

    return load_config(
        None,
        [
            "rollout.backend=sim",
            f"rollout.num_instances={instances}",
            f"rollout.replace_lost={replace_lost}",
            "rollout.max_running=64",
            f"rollout.max_model_len={32 + 4 * response_len_median}",
            f"rollout.sampling.max_new_tokens={4 * response_len_median}",
            "data.max_prompt_len=32",
            f"protocol.batch_size={batch}",
            f"protocol.group_size={group}",
            f"protocol.eta={eta}",
            "protocol.stuck_threshold=0",
            f"trainer.steps={steps}",
            f"run.seed={seed}",
            f"run.checkpoint_every={checkpoint_every}",
            f"sim.total_gpus={instances + 1}",
            "sim.train_gpus=1",
            "sim.kv_capacity_tokens=65536",
            "sim.trainer_time_a_s=0.5",
            "sim.trainer_time_b_s_per_token=0.0",
            "sim.model_bytes=10000000",
            "sim.warmup_steps=0",
            "sim.workload.prompt_len=16",
            f"sim.workload.response_len_median={response_len_median}",
            "metrics.timeline=false",
            "metrics.tensorboard=false",
            "metrics.progress_bar=false",
        ],
    )
