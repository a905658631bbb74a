"""What the control shell's write-ahead journal costs, for a large control-core state.

The simulator (:class:`staleflow_trainer.sim.Simulation`, the same
:class:`~staleflow_trainer.control.ControlCore` the Ray deployment runs) drives a run at
B=64, n=16, eta=3 (by default). Every event the core is fed is captured (the simulation's
``on_event`` hook, which changes nothing) and journaled with the Ray shell's
:class:`~staleflow_trainer.actors.write_ahead.WriteAheadLog` the way the shell does: one record
``{"events": [...]}`` per control cycle (the events that arrived since the last cycle, then the
``Cycle``), appended and fsynced. After ``--warm`` steps the journal restarts from the core's
state (what a checkpoint does), so the measured journal covers ``--steps`` steps of a run that
already has a history.

Printed and written to ``bench-results/coordinator_wal.json``:

* per-append seconds (mean, p50, p99, max) and bytes;
* one full snapshot of the same state (``core.to_dict()`` + JSON), what persisting the whole
  state every cycle would pay instead, and its ratio to a mean append;
* compaction (``to_dict`` + a new base + an empty journal), as at every checkpoint;
* recovery: load the journal, ``ControlCore.restore`` the base and ``handle`` every event again;
  the replayed core's ``to_dict()`` must equal the live core's exactly (else exit 1).

The run's wall time is the simulator's plus the journal's. ``--smoke`` (a few seconds) runs
B=8, n=4 for 2 + 3 steps and also checks that the same run without the hook ends in the same
state (the test suite runs it)::

    .venv/bin/python benchmarks/bench_coordinator_wal.py [--warm 20] [--steps 20] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from staleflow_trainer.actors.write_ahead import WAL_DIR, WriteAheadLog
from staleflow_trainer.control import ControlCore, core_config
from staleflow_trainer.control.events import Cycle, Event, event_from_dict, event_to_dict
from staleflow_trainer.sim import Simulation
from staleflow_trainer.sim.testing import sim_config

ROOT = Path(__file__).resolve().parents[1]

#: the large state (the paper's batch) and the smoke one
FULL = {"batch_size": 64, "group_size": 16, "eta": 3, "total_gpus": 16, "rollout_gpus": 8}
SMOKE = {"batch_size": 8, "group_size": 4, "eta": 3, "total_gpus": 4, "rollout_gpus": 2}
#: a short-response workload, so the simulator spends its time on control, not on tokens
WORKLOAD = {
    "prompt_len": 128,
    "prompt_len_max": 512,
    "response_len_median": 256,
    "max_response_len": 1024,
    "kv_capacity_tokens": 200_000,
    "max_running": 256,
}


class Journal:
    """The simulation's ``on_event`` hook: per-cycle batches into a :class:`WriteAheadLog`,
    started from the core's state at the first cycle after ``warm`` steps."""

    def __init__(self, sim_holder: list[Simulation], root: Path, warm: int) -> None:
        self._sim = sim_holder
        self.wal = WriteAheadLog(root)
        self.warm = warm
        self.started = False
        self.batch: list[Event] = []
        self.append_s: list[float] = []
        self.append_bytes: list[int] = []
        self.events = 0
        self.base_s = 0.0

    def __call__(self, ev: Event) -> None:
        if not self.started:
            if not isinstance(ev, Cycle):
                return
            core = self._sim[0].core
            if core.steps_done < self.warm:
                return
            # the state already holds every event before this one: it is the base
            t0 = time.perf_counter()
            self.wal.reset(core.to_dict())
            self.base_s = time.perf_counter() - t0
            self.started = True
        self.batch.append(ev)
        if isinstance(ev, Cycle):
            self.flush()

    def flush(self) -> None:
        if not self.batch:
            return
        before = self.wal.stats["bytes"]
        t0 = time.perf_counter()
        self.wal.append({"events": [event_to_dict(e) for e in self.batch]})
        self.append_s.append(time.perf_counter() - t0)
        self.append_bytes.append(int(self.wal.stats["bytes"] - before))
        self.events += len(self.batch)
        self.batch = []


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))]


def measure(flat: dict[str, Any], warm: int, steps: int) -> dict[str, Any]:
    cfg = sim_config(steps=warm + steps, **flat)
    holder: list[Simulation] = []
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / WAL_DIR
        journal = Journal(holder, root, warm)
        sim = Simulation(cfg, on_event=journal)
        holder.append(sim)
        t0 = time.perf_counter()
        sim.run()
        run_s = time.perf_counter() - t0
        journal.flush()  # events after the last cycle (the run's last step)
        if not journal.started:
            raise SystemExit(f"the run ended before the journal started (warm={warm})")
        core = sim.core
        t0 = time.perf_counter()
        final = core.to_dict()
        snap = json.dumps(final).encode()
        snapshot_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        base, records = WriteAheadLog(root).load()
        load_s = time.perf_counter() - t0
        stream = sim.stream
        t0 = time.perf_counter()
        replayed = ControlCore.restore(
            base, core_config(cfg, rows=None), prompt_len=lambda row: stream.group(row).prompt_len
        )
        n = 0
        for rec in records:
            for ev in rec["events"]:
                replayed.handle(event_from_dict(ev))
                n += 1
        replay_s = time.perf_counter() - t0
        identical = replayed.to_dict() == final

        t0 = time.perf_counter()
        journal.wal.compact(core.to_dict())
        compact_s = time.perf_counter() - t0
        journal.wal.close()
    a, b = journal.append_s, journal.append_bytes
    mean_s = statistics.fmean(a)
    return {
        "config": {**flat, "warm_steps": warm, "steps": steps},
        "steps_done": core.steps_done,
        "run_wall_s": run_s,
        "protocol_trajectories": len(final["protocol"]["trajectories"]),
        "ledger_entries": len(final["ledger"].get("entries", ())),
        "appends": len(a),
        "events_journaled": journal.events,
        "events_per_append_mean": journal.events / len(a),
        "append_s_mean": mean_s,
        "append_s_p50": _pct(a, 0.5),
        "append_s_p99": _pct(a, 0.99),
        "append_s_max": max(a),
        "append_s_total": sum(a),
        "append_bytes_mean": statistics.fmean(b),
        "append_bytes_max": max(b),
        "journal_bytes_total": sum(b),
        "full_snapshot_s": snapshot_s,
        "full_snapshot_bytes": len(snap),
        "snapshot_over_append_s": snapshot_s / mean_s,
        "snapshot_over_append_bytes": len(snap) / statistics.fmean(b),
        "base_write_s": journal.base_s,
        "compact_s": compact_s,
        "load_s": load_s,
        "replay_s": replay_s,
        "replayed_records": len(records),
        "replayed_events": n,
        "replay_identical": identical,
        "_final": final,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm", type=int, default=20, help="steps before the journal starts")
    ap.add_argument("--steps", type=int, default=20, help="steps journaled after the warm-up")
    ap.add_argument("--smoke", action="store_true", help="B=8, n=4, 2 + 3 steps (seconds)")
    ap.add_argument("--out", default=None, help="default: bench-results/coordinator_wal.json")
    a = ap.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if a.smoke:
        res = measure({**SMOKE, **WORKLOAD}, warm=2, steps=3)
        # the hook only watches: the same run without it ends in the same state
        plain = Simulation(sim_config(steps=5, **SMOKE, **WORKLOAD))
        plain.run()
        res["hook_changes_nothing"] = plain.core.to_dict() == res["_final"]
    else:
        res = measure({**FULL, **WORKLOAD}, warm=a.warm, steps=a.steps)
    del res["_final"]
    res["smoke"] = a.smoke
    out = Path(a.out) if a.out else ROOT / "bench-results" / "coordinator_wal.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    for k, v in res.items():
        print(f"{k:28s} {v:.6g}" if isinstance(v, float) else f"{k:28s} {v}")
    if not res["replay_identical"]:
        print("REPLAY DIVERGED: the replayed core's state differs from the live core's")
        return 1
    if res.get("hook_changes_nothing") is False:
        print("THE HOOK CHANGED THE RUN: the run without it ends in another state")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
