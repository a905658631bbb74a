"""What a simulated run records: the core's step records plus the simulator's own numbers.

Files (written by :func:`staleflow_trainer.simulate.run_and_write`):

* ``metrics.jsonl`` — one object per training step: the core's record (the metrics contract,
  :mod:`staleflow_trainer.control.report`) plus ``push_s``, ``rollout_busy_frac`` (generated
  tokens over what the instances would generate at their best rate), ``rollout_active_frac``
  (share of instance-time with any work), ``prefill_frac`` (share of instance-time spent
  prefilling: prompts, and contexts again after an interrupt, a preemption or a sync),
  ``preemptions`` (requests the engines preempted for KV room) and ``cycles``;
* ``timeline.jsonl`` — per-instance ``busy`` / ``syncing`` / ``idle`` intervals;
  ``trainer_timeline.jsonl`` the trainer's ``training`` / ``pushing`` / ``waiting`` intervals,
  and ``streaming`` where it works on the next batch's settled groups while it waits
  (``trainer.stream_batch``);
* ``summary.json`` — the whole-run numbers the comparison uses (:meth:`RunRecorder.summary`).
"""

from __future__ import annotations

from typing import Any

from staleflow_trainer.sim.spec import SimSpec


class RunRecorder:
    """Collects a simulated run's step records and timelines (virtual time)."""

    def __init__(self, spec: SimSpec, instances: list[str]) -> None:
        from staleflow_trainer.sim.ideal import ideal_throughput

        self.spec = spec
        self.instances = list(instances)
        self.steps: list[dict[str, Any]] = []
        self.timeline: list[tuple[str, str, float, float, int]] = []
        self._trainer_phase = ("waiting", 0.0)
        self._streaming: list[tuple[float, float]] = []  # the current phase's streamed parts
        self.staleness_hist: dict[int, int] = {}
        self.end_time = 0.0
        self.counters: dict[str, int] = {}
        self.tokens_wasted = 0
        self.best_gen_tokens_per_s = ideal_throughput(spec)["instance_best_gen_tokens_per_s"]
        # per instance: its engine, and its prefill seconds and preemptions at the last step
        self._engine_seen: dict[str, tuple[Any, float, int]] = {}

    def add_instance(self, iid: str) -> None:
        if iid not in self.instances:
            self.instances.append(iid)

    def trainer_phase(self, now: float, phase: str) -> None:
        old, start = self._trainer_phase
        if self.spec.timeline:
            for begin, end in self._streaming:  # one after another, in time order
                begin, end = max(begin, start), min(end, now)
                if begin < end:
                    if begin > start:
                        self.timeline.append(("trainer", old, start, begin, 0))
                    self.timeline.append(("trainer", "streaming", begin, end, 0))
                    start = end
            if now > start:
                self.timeline.append(("trainer", old, start, now, 0))
        self._streaming.clear()
        self._trainer_phase = (phase, now)

    def trainer_streaming(self, begin: float, end: float) -> None:
        """The waiting trainer works on a streamed part from ``begin`` to ``end`` (what is left
        of it when the phase changes belongs to the next phase)."""
        if not self.spec.timeline:
            return
        if self._streaming and self._streaming[-1][1] == begin:  # right after the last one
            begin = self._streaming.pop()[0]
        self._streaming.append((begin, end))

    def add_step(self, row: dict[str, Any], sim: Any) -> None:
        busy = row.get("instance_busy_frac", {})
        n = max(len(sim.engines), 1)
        capacity = row["step_s"] * n * self.best_gen_tokens_per_s
        row["push_s"] = self.spec.push_seconds
        row["rollout_busy_frac"] = row["gen_tokens"] / capacity if capacity > 0 else 0.0
        row["rollout_active_frac"] = sum(busy.values()) / n
        prefill_s, row["preemptions"] = self._engine_work(sim.engines)
        row["prefill_frac"] = prefill_s / (row["step_s"] * n) if row["step_s"] > 0 else 0.0
        row["cycles"] = sim.cycles
        for k, v in row.get("staleness_hist", {}).items():
            self.staleness_hist[int(k)] = self.staleness_hist.get(int(k), 0) + v
        self.steps.append(row)
        self._collect(sim.core)

    def _engine_work(self, engines: dict[str, Any]) -> tuple[float, int]:
        """Prefill seconds and preemptions of the engines since the last step (an engine that
        replaced a lost one counts from zero)."""
        seconds, preempted = 0.0, 0
        for iid, eng in engines.items():
            seen, s0, p0 = self._engine_seen.get(iid, (None, 0.0, 0))
            if seen is not eng:
                s0, p0 = 0.0, 0
            seconds += eng.prefill_seconds - s0
            preempted += eng.preemptions - p0
            self._engine_seen[iid] = (eng, eng.prefill_seconds, eng.preemptions)
        return seconds, preempted

    def _collect(self, core: Any) -> None:
        rows = core.take_timeline()
        if self.spec.timeline:
            for r in rows:
                self.timeline.append(
                    (r["instance"], r["state"], r["start_s"], r["end_s"], r["version"])
                )

    def finish(self, now: float, core: Any) -> None:
        self.end_time = now
        self._collect(core)
        if self.spec.timeline:
            for r in core.report.open_intervals(now):
                self.timeline.append(
                    (r["instance"], r["state"], r["start_s"], r["end_s"], r["version"])
                )
        self.trainer_phase(now, "done")
        self.counters = dict(core.counters)
        self.tokens_wasted = core.report.wasted_total

    def summary(self) -> dict[str, Any]:
        s = self.spec
        w = min(s.warmup_steps, len(self.steps) - 1)
        window = self.steps[w:]
        t0 = self.steps[w - 1]["time_s"] if w > 0 else 0.0
        t1 = self.steps[-1]["time_s"]
        span = max(t1 - t0, 1e-12)
        tokens = sum(r["tokens"] for r in window)
        samples = sum(r["samples"] for r in window)
        # the trainer waited for each batch, less what it worked on streamed-in groups meanwhile
        wait = sum(
            max(r["trainer_wait_s"] - r["trainer"].get("stream_busy_s", 0.0), 0.0) for r in window
        )
        busy = sum(r["rollout_busy_frac"] * r["step_s"] for r in window) / span
        active = sum(r["rollout_active_frac"] * r["step_s"] for r in window) / span
        prefill = sum(r["prefill_frac"] * r["step_s"] for r in window) / span
        c = self.counters
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
            "prefill_frac": prefill,
            "preemptions": sum(r["preemptions"] for r in window),
            "max_staleness": max((r["max_staleness"] for r in self.steps), default=0),
            "mean_staleness": sum(r["mean_staleness"] for r in window) / len(window),
            "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
            "virtual_time_s": self.end_time,
            "syncs": c.get("syncs", 0),
            "migrations": c.get("migrations", 0),
            "bounces": c.get("bounces", 0),
            "interrupts": c.get("interrupts", 0) + c.get("sync_interrupts", 0),
            "aborts": c.get("aborts", 0),
            "stuck_resolved": c.get("stuck_resolved", 0),
            "filtered": c.get("filtered", 0),
            "streamed_groups": c.get("streamed_groups", 0),
            "tokens_wasted": self.tokens_wasted,
            "rollout_instances": len(self.instances),
            "rollout_gpus": s.rollout_gpus_used,
            "train_gpus": s.train_gpus_used,
        }
