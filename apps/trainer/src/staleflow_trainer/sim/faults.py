"""Randomized faults on the simulator: instance deaths and restarts, trainer crashes that
restart the whole app from its last checkpoint. Checks the ledger after every fault.

Theory of operation
-------------------
:class:`FaultySimulation` is the :class:`~staleflow_trainer.sim.loop.Simulation` with three
more timed events, drawn from a seeded RNG (:class:`FaultPlan`):

* *instance death* — a live instance's engine disappears; what it held goes back to the queue
  with what the store held (output since the last return is lost, as ``ts.instance_lost``
  does), ``coordinator.remove_instance`` stops routing to it, the protocol keeps every
  reservation. A *restart* brings it back ``down_s`` later serving the latest published
  version (``coordinator.add_instance``), as a replacement instance that pulled it;
* *trainer crash* — everything reverts to the last checkpoint (taken every
  ``checkpoint_every`` steps: protocol state, the trajectory ledger, the prompt cursor, the
  step count). Work running at checkpoint time returns to the queue; trajectories reserved but
  not yet routed are queued at their V_traj (never reserved twice); every instance restarts
  on the checkpoint's version; pending training, syncs and rewards are lost.

After every fault, and at the end, :meth:`TrajectoryLedger.check` proves every admitted
trajectory is consumed, in flight or dropped with a reason and agrees with the protocol; the
protocol's staleness histogram proves consumed staleness stayed <= eta.
"""

from __future__ import annotations

import copy
import heapq
import math
import random
from typing import Any

import attrs

from engine_adapters.sim import SimEngineCore
from rollout_coordinator import Coordinator
from staleflow_trainer.sim.ledger import TrajectoryLedger, Where
from staleflow_trainer.sim.loop import _PUSH_DONE, Simulation
from staleflow_trainer.sim.spec import SimSpec
from staleness_protocol import StalenessProtocol, TrajectoryState

_KILL = 100
_REVIVE = 101
_CRASH = 102


@attrs.frozen(kw_only=True)
class FaultPlan:
    """Rates are per virtual second. ``min_alive``: deaths never leave fewer live instances."""

    seed: int = 0
    instance_death_rate: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    down_s: float = attrs.field(default=5.0, validator=attrs.validators.gt(0.0))
    trainer_crash_rate: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    checkpoint_every: int = attrs.field(default=5, validator=attrs.validators.ge(1))
    min_alive: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    check_every_fault: bool = True


@attrs.frozen(kw_only=True)
class _Checkpoint:
    steps_done: int
    protocol: dict[str, Any]
    ledger: TrajectoryLedger
    next_group: int


class FaultySimulation(Simulation):
    """``Simulation`` + :class:`FaultPlan`; counters in :attr:`faults`."""

    def __init__(self, spec: SimSpec, plan: FaultPlan) -> None:
        super().__init__(spec)
        self.plan = plan
        self._rng = random.Random(plan.seed)
        self._engine_cfg = next(iter(self.engines.values())).config
        self._coord_cfg = self.coord.config
        self._ckpt: _Checkpoint | None = None
        self._dead: set[str] = set()
        self._check_due = False
        self.faults: dict[str, int] = dict.fromkeys(
            ("instance_deaths", "instance_restarts", "lost_requeued", "trainer_crashes",
             "steps_rolled_back", "ledger_checks"),
            0,
        )  # fmt: skip
        self.steps_trained = 0  # training steps completed, counting those later rolled back
        self._schedule(_KILL, plan.instance_death_rate)
        self._schedule(_CRASH, plan.trainer_crash_rate)

    # ---- scheduling -----------------------------------------------------------------------

    def _schedule(self, kind: int, rate: float) -> None:
        if rate > 0:
            self._at(self.now + self._rng.expovariate(rate), kind, None)

    def _on_event(self, kind: int, payload: Any) -> None:
        if kind == _KILL:
            self._kill()
            self._schedule(_KILL, self.plan.instance_death_rate)
        elif kind == _REVIVE:
            self._revive(payload)
        elif kind == _CRASH:
            self._crash()
            self._schedule(_CRASH, self.plan.trainer_crash_rate)
        else:
            super()._on_event(kind, payload)
            if kind == _PUSH_DONE:
                self.steps_trained += 1
                if self._steps_done % self.plan.checkpoint_every == 0:
                    self._checkpoint()
            return
        if self.plan.check_every_fault:
            self._check_due = True
            self._check_if_settled()
        self._dirty = True
        self._touch()

    # ---- faults ---------------------------------------------------------------------------

    def _kill(self) -> None:
        live = sorted(self.engines)
        if len(live) <= self.plan.min_alive:
            return
        iid = self._rng.choice(live)
        self._lose_engine(iid)
        self.coord.remove_instance(iid)
        self._dead.add(iid)
        self.faults["instance_deaths"] += 1
        self._at(self.now + self.plan.down_s, _REVIVE, iid)

    def _lose_engine(self, iid: str) -> None:
        """The engine is gone: what it held goes back to the queue with what the store held."""
        del self.engines[iid]
        del self._next[iid]
        self._snap_at.pop(iid, None)
        self._changed.discard(iid)
        for tid in self.ledger.held_by(iid):
            e = self.ledger.entries[tid]
            self.ledger.return_partial(tid, e.generated)
            self.faults["lost_requeued"] += 1
        self.rec.instance_state(iid, self.now, False, 0)

    def _revive(self, iid: str) -> None:
        if iid not in self._dead:
            return
        self._dead.discard(iid)
        self._add_engine(iid, self.coord.latest_version)
        self.faults["instance_restarts"] += 1

    def _add_engine(self, iid: str, version: int) -> None:
        self.engines[iid] = SimEngineCore(self._engine_cfg, instance_id=iid, version=version)
        self._next[iid] = math.inf
        self._snap_at[iid] = -math.inf
        self._changed.add(iid)
        self.coord.add_instance(
            iid, kv_capacity_tokens=self.spec.kv_capacity_tokens, version=version
        )

    def _checkpoint(self) -> None:
        self._ckpt = _Checkpoint(
            steps_done=self._steps_done,
            protocol=self.protocol.to_dict(),
            ledger=copy.deepcopy(self.ledger),
            next_group=self._next_group,
        )

    def _crash(self) -> None:
        """The trainer died: the whole app restarts from the last checkpoint."""
        ck = self._ckpt
        if ck is None:
            return
        self.faults["trainer_crashes"] += 1
        self.faults["steps_rolled_back"] += self._steps_done - ck.steps_done
        self.protocol = StalenessProtocol.from_dict(ck.protocol)
        self.ledger = copy.deepcopy(ck.ledger)
        self._next_group = ck.next_group
        self._steps_done = ck.steps_done
        version = self.protocol.published_version
        # work on instances at checkpoint time goes back to the queue
        for iid in list(self.ledger.held):
            for tid in self.ledger.held_by(iid):
                self.ledger.return_partial(tid, self.ledger.entries[tid].generated)
        # reserved but never routed (held for a sync): queue at their V_traj
        for e in self.ledger.entries.values():
            if e.where is Where.QUEUED and e.v_traj is None and self._in_flight(e.tid):
                self.ledger._unqueue(e.tid)
                e.v_traj = self.protocol.trajectory(e.tid).version
                self.ledger._requeue(e)
        # fresh coordinator and instances (all restart on the checkpoint's version)
        self.coord = Coordinator(self._coord_cfg, self.protocol, clock=lambda: self.now)
        alive = sorted(self.engines)
        for iid in alive:
            del self.engines[iid]
            del self._next[iid]
        for iid in alive:
            self._add_engine(iid, version)
        # pending training, pushes, syncs and rewards died with the app; faults stay scheduled
        self._events[:] = [ev for ev in self._events if ev[2] >= _KILL]
        heapq.heapify(self._events)
        self._trainer_busy = False
        self._trainer_free_at = self.now
        self._stuck_checked_at = -math.inf
        self._released = set()
        self._changed.update(self.engines)

    def _in_flight(self, tid: str) -> bool:
        try:
            return self.protocol.trajectory(tid).state is TrajectoryState.IN_FLIGHT
        except Exception:  # unknown to the protocol: never admitted
            return False

    # ---- checks ---------------------------------------------------------------------------

    def _check_if_settled(self) -> None:
        """Aborts the protocol decided are executed by the next cycle; until then the ledger
        legitimately still shows those trajectories live, so the check waits for that cycle."""
        if self._check_due and self.protocol.stats().pending_notices == 0:
            self._check_due = False
            self.check()

    def _cycle(self) -> None:
        super()._cycle()
        self._check_if_settled()

    def check(self) -> dict[str, int]:
        """The ledger check (raises on any lost or double-counted trajectory) plus
        consumed staleness <= eta; returns the per-state counts."""
        counts = self.ledger.check(self.protocol)
        hist = self.protocol.stats().staleness_histogram
        bounded = isinstance(self.spec.eta, int)  # "unbounded" measures, never enforces
        if hist and bounded and max(int(s) for s in hist) > int(self.spec.eta):
            raise AssertionError(f"consumed staleness {dict(hist)} exceeds eta={self.spec.eta}")
        consumed = sum(hist.values())
        if consumed != counts[Where.CONSUMED.value]:
            raise AssertionError(
                f"protocol consumed {consumed} trajectories, the ledger {counts['consumed']}"
            )
        self.faults["ledger_checks"] += 1
        return counts

    def run(self) -> Any:
        rec = super().run()
        self.check()
        return rec


def faulty_spec(
    *, instances: int = 8, steps: int = 50, batch: int = 4, group: int = 4, eta: int = 1,
    seed: int = 0, response_len_median: int = 64,
) -> SimSpec:  # fmt: skip
    """A small, fast workload for fault runs (tiny responses, cheap trainer)."""
    return SimSpec(
        eta=eta,
        steps=steps,
        seed=seed,
        batch_size=batch,
        group_size=group,
        total_gpus=instances + 1,
        rollout_gpus=instances,
        train_gpus=1,
        prompt_len=16,
        prompt_len_max=32,
        response_len_median=response_len_median,
        max_response_len=4 * response_len_median,
        trainer_time_a_s=0.5,
        trainer_time_b_s_per_token=0.0,
        model_bytes=10_000_000,
        warmup_steps=0,
    )
