"""The step record and instance timeline the control core emits (the metrics contract).

One record per training step, the same keys from the Ray deployment and the simulator. Times
are the shell's clock (wall seconds since the run started, or virtual seconds).

=========================  ===========================================================================
key                        meaning
=========================  ===========================================================================
``step``, ``version``      steps done; the version the step published
``time_s``, ``step_s``     when the step finished; seconds since the previous step finished
``tokens``                 trained tokens of the step's batch (prompt + response)
``response_tokens``        trained response tokens; ``samples`` trained trajectories
``response_lengths``       the batch's response lengths, one list per group (a group trace:
                           ``sim.workload.kind: group_trace`` replays a run's workload)
``tokens_per_s``           trained tokens per second: ``tokens / step_s`` (never 0 for a trained batch)
``gen_tokens``             tokens the instances generated since the previous step (kept or later
                           discarded)
``gen_tokens_per_s``       generated tokens per second over the last ``window`` steps
``max_staleness`` …        ``max_staleness``, ``mean_staleness``, ``staleness_hist`` of the batch
``reward_mean``            mean reward of the batch; ``accuracy``: share with reward >= 1
``trainer_wait_s``         how long the trainer waited for the batch (idle before ``Train``)
``train_s``                from ``Train`` to ``Trained`` (training and publishing)
``routes`` … ``aborts``    counts since the previous step (routes, syncs, migrations, bounces,
                           interrupts, aborts, filtered, reward_dropped, stuck_resolved,
                           instances_lost)
``queue_depth``            queued trajectories per V_traj level, ``new`` for never-routed prompts
``in_flight``              trajectories admitted by the protocol and not yet finished
``instance_busy_frac``     per instance: share of the step's time it had work
``instance_versions``      how many instances serve each version
``trainer``                the trainer's own numbers (loss, grad norm, push time, ...)
=========================  ===========================================================================

Timeline rows: ``{"instance", "state" (busy | syncing | idle), "start_s", "end_s", "version"}``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_coordinator import InstanceSnapshot
from staleflow_trainer.control import effects as fx

STEP_COUNTERS = (
    "routes",
    "syncs",
    "migrations",
    "bounces",
    "interrupts",
    "aborts",
    "filtered",
    "reward_dropped",
    "stuck_resolved",
    "instances_lost",
)


def staleness_summary(stalenesses: Sequence[int]) -> dict[str, Any]:
    """``max_staleness``, ``mean_staleness`` and ``staleness_hist`` of a consumed batch."""
    if not stalenesses:
        return {"max_staleness": 0, "mean_staleness": 0.0, "staleness_hist": {}}
    hist = Counter(int(s) for s in stalenesses)
    return {
        "max_staleness": max(hist),
        "mean_staleness": sum(stalenesses) / len(stalenesses),
        "staleness_hist": {str(k): hist[k] for k in sorted(hist)},
    }


class StepReport:
    """Accumulates between steps; :meth:`step` builds the record."""

    def __init__(self, *, window: int = 5) -> None:
        self.window = window
        self.last_step_at = 0.0
        self.consumed_at = 0.0
        self.wait_s = 0.0
        self.gen = 0
        self.gen_total = 0
        self.wasted_total = 0
        self.recent: list[tuple[float, int]] = []  # (step_s, gen_tokens) of the last steps
        self.counters_at_step: dict[str, int] = {}
        # instance -> [state, since, version]; busy seconds since the last step
        self.state: dict[str, list[Any]] = {}
        self.busy: dict[str, float] = {}
        self._timeline: list[dict[str, Any]] = []

    # ---- tokens --------------------------------------------------------------------------

    def generated(self, n: int) -> None:
        self.gen += n
        self.gen_total += n

    def wasted(self, n: int) -> None:
        self.wasted_total += n
        self.gen_total += n
        self.gen += n

    # ---- instances -----------------------------------------------------------------------

    def _move(self, iid: str, at: float, state: str, version: int | None = None) -> None:
        cur = self.state.get(iid)
        if cur is None:
            self.state[iid] = [state, at, 0 if version is None else version]
            self.busy.setdefault(iid, 0.0)
            return
        v = cur[2] if version is None else version
        if cur[0] == state and cur[2] == v:
            return
        self._close(iid, cur, at)
        self.state[iid] = [state, at, v]

    def _close(self, iid: str, cur: list[Any], at: float) -> None:
        if at > cur[1]:
            if cur[0] == "busy":
                self.busy[iid] = self.busy.get(iid, 0.0) + at - max(cur[1], self.last_step_at)
            self._timeline.append(
                {
                    "instance": iid,
                    "state": cur[0],
                    "start_s": cur[1],
                    "end_s": at,
                    "version": cur[2],
                }
            )

    def instance_joined(self, iid: str, at: float, version: int) -> None:
        self._move(iid, at, "idle", version)

    def instance_load(self, iid: str, at: float, snap: InstanceSnapshot) -> None:
        cur = self.state.get(iid)
        if cur is not None and cur[0] == "syncing":
            return
        self._move(iid, at, "busy" if snap.running or snap.waiting else "idle", snap.version)

    def instance_syncing(self, iid: str, at: float, version: int) -> None:
        self._move(iid, at, "syncing")

    def instance_synced(self, iid: str, at: float, version: int | None) -> None:
        self._move(iid, at, "idle", version)

    def instance_gone(self, iid: str, at: float) -> None:
        cur = self.state.pop(iid, None)
        if cur is not None:
            self._close(iid, cur, at)
        self.busy.pop(iid, None)

    def take_timeline(self) -> list[dict[str, Any]]:
        rows, self._timeline = self._timeline, []
        return rows

    def open_intervals(self, at: float) -> list[dict[str, Any]]:
        """The intervals still open, as if they ended at ``at`` (the run is over; the state
        is left as it is)."""
        return [
            {"instance": iid, "state": cur[0], "start_s": cur[1], "end_s": at, "version": cur[2]}
            for iid, cur in self.state.items()
            if at > cur[1]
        ]

    # ---- steps ---------------------------------------------------------------------------

    def consumed(self, at: float, wait_s: float) -> None:
        self.consumed_at = at
        self.wait_s = wait_s

    def step(
        self,
        *,
        step: int,
        version: int,
        at: float,
        batch: fx.Train,
        counters: Mapping[str, int],
        queue_depth: Mapping[str, int],
        in_flight: int,
        trainer: Mapping[str, Any],
    ) -> dict[str, Any]:
        step_s = max(at - self.last_step_at, 1e-9)
        busy: dict[str, float] = {}
        versions: Counter[str] = Counter()
        for iid, cur in self.state.items():
            extra = at - max(cur[1], self.last_step_at) if cur[0] == "busy" else 0.0
            busy[iid] = round((self.busy.get(iid, 0.0) + max(extra, 0.0)) / step_s, 4)
            self.busy[iid] = 0.0
            versions[str(cur[2])] += 1
        self.recent.append((step_s, self.gen))
        self.recent = self.recent[-self.window :]
        span = sum(s for s, _ in self.recent)
        stale = [s for st in batch.staleness for s in st]
        rewards = [r for rs in batch.rewards for r in rs]
        row: dict[str, Any] = {
            "step": step,
            "version": version,
            "time_s": at,
            "step_s": step_s,
            "tokens": batch.tokens,
            "response_tokens": batch.response_tokens,
            "response_lengths": [list(g) for g in batch.response_lengths],
            "samples": len(rewards),
            "tokens_per_s": batch.tokens / step_s,
            "gen_tokens": self.gen,
            "gen_tokens_per_s": sum(g for _, g in self.recent) / span if span > 0 else 0.0,
            **staleness_summary(stale),
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else 0.0,
            "trainer_wait_s": self.wait_s,
            "train_s": at - self.consumed_at,
            **{k: counters.get(k, 0) - self.counters_at_step.get(k, 0) for k in STEP_COUNTERS},
            "queue_depth": dict(queue_depth),
            "in_flight": in_flight,
            "instance_busy_frac": dict(sorted(busy.items())),
            "instance_versions": dict(sorted(versions.items())),
            "trainer": dict(trainer),
        }
        self.counters_at_step = {k: counters.get(k, 0) for k in STEP_COUNTERS}
        self.gen = 0
        self.last_step_at = at
        return row

    # ---- state ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "last_step_at": self.last_step_at,
            "consumed_at": self.consumed_at,
            "wait_s": self.wait_s,
            "gen": self.gen,
            "gen_total": self.gen_total,
            "wasted_total": self.wasted_total,
            "recent": [list(x) for x in self.recent],
            "counters_at_step": dict(self.counters_at_step),
            "state": {k: list(v) for k, v in self.state.items()},
            "busy": dict(self.busy),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepReport:
        r = cls(window=int(d["window"]))
        r.last_step_at = float(d["last_step_at"])
        r.consumed_at = float(d["consumed_at"])
        r.wait_s = float(d["wait_s"])
        r.gen = int(d["gen"])
        r.gen_total = int(d["gen_total"])
        r.wasted_total = int(d["wasted_total"])
        r.recent = [(float(s), int(g)) for s, g in d["recent"]]
        r.counters_at_step = {str(k): int(v) for k, v in d["counters_at_step"].items()}
        r.state = {str(k): [str(v[0]), float(v[1]), int(v[2])] for k, v in d["state"].items()}
        r.busy = {str(k): float(v) for k, v in d["busy"].items()}
        return r
