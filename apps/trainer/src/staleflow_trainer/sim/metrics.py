"""What a simulated run records: per-step metrics, instance timelines, a summary.

Files:

* ``metrics.jsonl`` — one object per training step (the app's metrics contract: ``step``,
  ``version``, ``tokens_per_s``, ``max_staleness``, ``mean_staleness``, ``reward_mean``,
  ``trainer_wait_s``; plus the staleness histogram, per-instance busy fraction, sync /
  migration / interrupt counts, queue depths and the virtual time).
* ``timeline.jsonl`` — one object per interval ``{"instance", "state", "start_s", "end_s",
  "version"}`` with state ``busy`` / ``syncing`` / ``idle``; ``trainer_timeline.jsonl`` the
  trainer's ``training`` / ``pushing`` / ``waiting`` intervals.
* ``summary.json`` — the whole-run numbers the comparison uses (see :meth:`summary`).

(:func:`staleflow_trainer.simulate.run_and_write` writes them.)
"""

from __future__ import annotations

from typing import Any

from staleflow_trainer.sim.spec import SimSpec

_STATE = {0: "idle", 1: "busy", 2: "syncing"}


class RunRecorder:
    """Accumulates a run's metrics as the simulation reports them (virtual time)."""

    def __init__(self, spec: SimSpec, instances: list[str]) -> None:
        self.spec = spec
        self.instances = instances
        self.steps: list[dict[str, Any]] = []
        self.timeline: list[tuple[str, str, float, float, int]] = []
        self._version = dict.fromkeys(instances, 0)
        self._state = dict.fromkeys(instances, 0)
        self._since = dict.fromkeys(instances, 0.0)
        self._busy_total = dict.fromkeys(instances, 0.0)
        self._busy_at_step = dict.fromkeys(instances, 0.0)
        self._trainer_phase = ("waiting", 0.0)
        self._pending: dict[str, Any] | None = None
        self._last_step_t = 0.0
        self._last_counts: dict[str, int] = {}
        self.last_cycle_time = -1.0
        self.staleness_hist: dict[int, int] = {}
        # counters
        self.routes = 0
        self.syncs = 0
        self.syncs_done = 0
        self.sync_interrupts = 0
        self.migrations = 0
        self.bounces = 0
        self.interrupts = 0
        self.aborts = 0
        self.stuck_resolved = 0
        self.groups_filtered = 0
        self.tokens_wasted = 0
        self.tokens_generated_final = 0
        self.cycle_count = 0
        self.queue_depth_max = 0
        self._queue_depth: dict[str, int] = {}
        self.end_time = 0.0
        # Token-rate utilisation: generated tokens (kept or later wasted) over what the
        # instances would generate at their best throughput (the ideal's per-instance T*).
        from staleflow_trainer.sim.ideal import ideal_throughput

        self.best_gen_tokens_per_s = ideal_throughput(spec)["instance_best_gen_tokens_per_s"]
        self._gen_at_step = 0
        self.generated_total = 0

    # ---- instance and trainer state ---------------------------------------------------------

    def instance_state(
        self, iid: str, now: float, loading: bool, active: int, version: int = 0
    ) -> None:
        new = 2 if loading else (1 if active else 0)
        old = self._state[iid]
        if new == old:
            self._version[iid] = version
            return
        start = self._since[iid]
        if now > start:
            if old == 1:
                self._busy_total[iid] += now - start
            if self.spec.timeline:
                self.timeline.append((iid, _STATE[old], start, now, self._version[iid]))
        self._state[iid] = new
        self._version[iid] = version
        self._since[iid] = now

    def _busy_until(self, iid: str, now: float) -> float:
        extra = now - self._since[iid] if self._state[iid] == 1 else 0.0
        return self._busy_total[iid] + extra

    def trainer_phase(self, now: float, phase: str) -> None:
        old, start = self._trainer_phase
        if now > start and self.spec.timeline:
            self.timeline.append(("trainer", old, start, now, 0))
        self._trainer_phase = (phase, now)

    # ---- coordinator cycles -----------------------------------------------------------------

    def cycle(self, now: float, report: Any, ledger: Any) -> None:
        self.cycle_count += 1
        depth = ledger.partials_queued
        self.queue_depth_max = max(self.queue_depth_max, depth)
        self._queue_depth = ledger.level_counts()

    # ---- steps ------------------------------------------------------------------------------

    def step_consumed(
        self,
        now: float,
        batch: Any,
        *,
        tokens: int,
        response_tokens: int,
        reward_mean: float,
        wait_s: float,
        train_s: float,
    ) -> None:
        hist: dict[int, int] = {}
        total = 0
        count = 0
        for per_group in batch.trajectory_staleness:
            for st in per_group:
                hist[st] = hist.get(st, 0) + 1
                total += st
                count += 1
        for st, c in hist.items():
            self.staleness_hist[st] = self.staleness_hist.get(st, 0) + c
        self._pending = {
            "trained_version": batch.version,
            "consumed_at_s": now,
            "tokens": tokens,
            "response_tokens": response_tokens,
            "samples": count,
            "max_staleness": max(hist) if hist else 0,
            "mean_staleness": total / count if count else 0.0,
            "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
            "reward_mean": reward_mean,
            "trainer_wait_s": wait_s,
            "train_s": train_s,
        }

    def step_done(self, now: float, version: int, sim: Any) -> None:
        p = self._pending or {}
        self._pending = None
        dt = now - self._last_step_t
        busy = {
            iid: (self._busy_until(iid, now) - self._busy_at_step[iid]) / dt if dt > 0 else 0.0
            for iid in self.instances
        }
        for iid in self.instances:
            self._busy_at_step[iid] = self._busy_until(iid, now)
        counts = {
            "syncs": self.syncs,
            "migrations": self.migrations,
            "bounces": self.bounces,
            "interrupts": self.interrupts + self.sync_interrupts,
            "aborts": self.aborts,
            "routes": self.routes,
        }
        delta = {k: v - self._last_counts.get(k, 0) for k, v in counts.items()}
        self._last_counts = counts
        versions: dict[str, int] = {}
        gen = 0
        for eng in sim.engines.values():
            versions[str(eng.version)] = versions.get(str(eng.version), 0) + 1
            gen += eng.total_generated_tokens
        self.generated_total = gen
        gen_step = gen - self._gen_at_step
        self._gen_at_step = gen
        capacity = dt * len(self.instances) * self.best_gen_tokens_per_s
        row = {
            "step": len(self.steps) + 1,
            "version": version,
            "time_s": now,
            "step_time_s": dt,
            "tokens_per_s": p.get("tokens", 0) / dt if dt > 0 else 0.0,
            **p,
            "push_s": self.spec.push_seconds,
            # generated tokens / (instances x best per-instance rate x step time): real use
            "rollout_busy_frac": gen_step / capacity if capacity > 0 else 0.0,
            # share of instance-time with any work at all (a lightly loaded instance counts 1)
            "rollout_active_frac": sum(busy.values()) / max(len(busy), 1),
            "generated_tokens": gen_step,
            "instance_busy_frac": {k: round(v, 4) for k, v in busy.items()},
            **delta,
            "queue_depth": dict(self._queue_depth),
            "in_flight": sim.protocol.stats().trajectories_by_state.get("in_flight", 0),
            "instance_versions": versions,
            "cycles": self.cycle_count,
        }
        self.steps.append(row)
        self._last_step_t = now

    def finish(self, now: float) -> None:
        self.end_time = now
        for iid in self.instances:
            self.instance_state(iid, now, False, 0)  # close open intervals
            if self._state[iid] != 0:
                self._state[iid] = 0
        self.trainer_phase(now, "done")

    # ---- summary and files ------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        s = self.spec
        w = min(s.warmup_steps, len(self.steps) - 1)
        window = self.steps[w:]
        t0 = self.steps[w - 1]["time_s"] if w > 0 else 0.0
        t1 = self.steps[-1]["time_s"]
        span = max(t1 - t0, 1e-12)
        tokens = sum(r["tokens"] for r in window)
        samples = sum(r["samples"] for r in window)
        wait = sum(r["trainer_wait_s"] for r in window)
        busy = sum(r["rollout_busy_frac"] * r["step_time_s"] for r in window) / span
        active = sum(r["rollout_active_frac"] * r["step_time_s"] for r in window) / span
        return {
            "policy": s.policy,
            "eta": s.eta,
            "steps": len(self.steps),
            "warmup_steps": w,
            "tokens_per_s": tokens / span,
            # what a policy trains, not only how fast: a policy that drops the long tail
            # trains shorter samples (fewer tokens each) at the same samples/s
            "samples_per_s": samples / span,
            "tokens_per_sample": tokens / samples if samples else 0.0,
            "mean_step_s": span / len(window),
            "trainer_idle_frac": wait / span,
            "rollout_busy_frac": busy,
            "rollout_active_frac": active,
            "max_staleness": max((r["max_staleness"] for r in self.steps), default=0),
            "mean_staleness": sum(r["mean_staleness"] for r in window) / len(window),
            "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
            "virtual_time_s": self.end_time,
            "syncs": self.syncs,
            "migrations": self.migrations,
            "bounces": self.bounces,
            "interrupts": self.interrupts + self.sync_interrupts,
            "aborts": self.aborts,
            "stuck_resolved": self.stuck_resolved,
            "tokens_wasted": self.tokens_wasted,
            "rollout_instances": len(self.instances),
            "rollout_gpus": s.rollout_gpus_used,
            "train_gpus": s.train_gpus_used,
        }
