"""``staleflow simulate`` and ``staleflow compare``: the app's wiring in virtual time.

    staleflow simulate examples/sim-tiny.yaml run_dir=runs/x trainer.steps=10
    staleflow compare examples/sim-paper-30b-a3b.yaml run_dir=runs/cmp

:func:`simulate` runs the policy the config names and writes, into ``run.run_dir``:
``config.yaml`` (resolved), ``metrics.jsonl`` (one record per training step, the app's
metrics contract), ``timeline.jsonl`` (per-instance busy / syncing / idle intervals, the
format :mod:`staleflow_trainer.report.plots` reads), ``trainer_timeline.jsonl`` (training /
pushing / waiting / streaming), ``summary.json`` and ``plots/``. It ends with a ledger check: every admitted
trajectory is consumed, in flight, or dropped/aborted with a reason, and agrees with the
protocol's own ledger.

:func:`compare` lives in :mod:`staleflow_trainer.report.compare` and is re-exported here
because the CLI imports both commands from this module.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from rollout_coordinator.policies import build_policy
from staleflow_trainer.atomic_files import make_run_dir
from staleflow_trainer.config import AppConfig, dump_config
from staleflow_trainer.config_coordinator import verl_window
from staleflow_trainer.control.checks import ledger_problems
from staleflow_trainer.errors import StaleflowError
from staleflow_trainer.report.metrics import TIMELINE_FILE, MetricsWriter
from staleflow_trainer.sim.ideal import ideal_throughput
from staleflow_trainer.sim.metrics import RunRecorder
from staleflow_trainer.sim.shell import Simulation
from staleflow_trainer.sim.spec import spec_from_app_config

_log = structlog.get_logger("staleflow.simulate")

__all__ = ["compare", "run_and_write", "simulate"]


class _LiveRecorder(RunRecorder):
    """A recorder that also hands each step record to ``on_record`` as it is made."""

    def __init__(self, cfg: AppConfig, on_record: Callable[[dict[str, Any]], None]) -> None:
        super().__init__(spec_from_app_config(cfg), [])
        self._on_record = on_record

    def add_step(self, row: dict[str, Any], sim: Any) -> None:
        super().add_step(row, sim)
        self._on_record(row)


def run_and_write(
    cfg: AppConfig,
    run_dir: Path,
    *,
    tensorboard: bool = False,
    plots: bool = True,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    trackers: Sequence[Any] = (),
) -> dict[str, Any]:
    """Run one simulation of ``cfg`` and write its files into ``run_dir``; returns the summary
    (with the ledger counts and the ideal throughput of the split). ``on_record`` sees each
    step record as the simulation makes it; ``trackers`` receive the metrics (W&B)."""
    sim = Simulation(cfg, recorder=None if on_record is None else _LiveRecorder(cfg, on_record))
    spec = sim.spec
    sim.run()
    problems = ledger_problems(sim.core)
    if problems:
        raise StaleflowError(f"simulation ledger check failed: {problems[:5]}")
    ledger = sim.core.ledger.counts()
    run_dir.mkdir(parents=True, exist_ok=True)
    rec = sim.rec
    with MetricsWriter(run_dir, tensorboard=tensorboard, trackers=trackers) as writer:
        for row in rec.steps:
            writer.log_step(row)
    if spec.timeline:
        with (run_dir / TIMELINE_FILE).open("w") as f:
            for lane, state, start, end, version in rec.timeline:
                if lane == "trainer":
                    continue
                f.write(
                    json.dumps(
                        {
                            "instance": lane,
                            "state": state,
                            "start_s": start,
                            "end_s": end,
                            "version": version,
                        }
                    )
                    + "\n"
                )
        with (run_dir / "trainer_timeline.jsonl").open("w") as f:
            for lane, state, start, end, _v in rec.timeline:
                if lane == "trainer":
                    f.write(json.dumps({"state": state, "start_s": start, "end_s": end}) + "\n")
    summary = rec.summary()
    summary.update(
        ledger=ledger,
        wall_s=sim.wall_s,
        cycles=sim.cycles,
        counters=dict(sim.core.counters),
        ideal=ideal_throughput(spec),
    )
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if plots:
        from staleflow_trainer.report.plots import plot_run

        plot_run(run_dir, simulated=True)
    _log.info(
        "simulate_done",
        run_dir=str(run_dir),
        policy=spec.policy,
        eta=spec.eta,
        steps=len(rec.steps),
        tokens_per_s=round(summary["tokens_per_s"], 1),
        max_staleness=summary["max_staleness"],
        virtual_s=round(rec.end_time, 1),
        wall_s=round(sim.wall_s, 2),
    )
    return summary


def simulate(cfg: AppConfig) -> int:
    """``staleflow simulate``: one run of the configured policy; prints where the files are."""
    from staleflow_trainer.report.progress import ProgressBar
    from staleflow_trainer.report.trackers import trackers_from_config

    spec = spec_from_app_config(cfg)
    run_dir = make_run_dir(cfg.run.run_dir)
    dump_config(cfg, run_dir / "config.yaml")
    m = cfg.metrics
    with ProgressBar(cfg.trainer.steps, enabled=m.progress_bar, log_every=m.log_every) as bar:
        summary = run_and_write(
            cfg,
            run_dir,
            tensorboard=m.tensorboard,
            on_record=lambda rec: bar.update(int(rec["step"]), rec),
            trackers=trackers_from_config(cfg),
        )
    ideal = summary["ideal"]
    eta: object = spec.eta
    if not build_policy(spec.policy).keeps_eta and spec.eta != "unbounded":
        s = verl_window(spec.eta, cfg.coordinator.verl_staleness_threshold)
        eta = f"{spec.eta}, not kept: window s = {s:g}"
    print(
        f"simulated {summary['steps']} steps of {spec.policy} (eta={eta}) on "
        f"{spec.rollout_gpus_used} rollout + {spec.train_gpus_used} training GPUs: "
        f"{summary['tokens_per_s']:.0f} trained tokens/s "
        f"({summary['tokens_per_s'] / ideal['ideal_tokens_per_s']:.0%} of the "
        f"{ideal['bound']}-bound ideal {ideal['ideal_tokens_per_s']:.0f}), "
        f"max staleness {summary['max_staleness']}, "
        f"{summary['virtual_time_s']:.0f} s virtual in {summary['wall_s']:.1f} s"
    )
    print(f"run directory: {run_dir}  (metrics.jsonl, timeline.jsonl, summary.json, plots/)")
    if m.tensorboard:
        tb = run_dir / "tensorboard"
        print(f"tensorboard:   {tb}  (view it: tensorboard --logdir {tb})")
    return 0


def compare(
    cfg: AppConfig, policies: list[str] | None = None, seeds: tuple[int, ...] | None = None
) -> int:
    """``staleflow compare`` (see :mod:`staleflow_trainer.report.compare`)."""
    from staleflow_trainer.report.compare import compare_main

    return compare_main(cfg, policies=policies, seeds=seeds)
