"""``staleflow train``: the whole disaggregated system on Ray, wired from one config.

Each component is its own Ray actor (see :mod:`staleflow_trainer.actors`): the trajectory server
(TCP on loopback with a token), the parameter server host (NIXL storage worker processes), N
rollout instances (one engine adapter each: vllm | sglang | sim), reward workers, the trainer,
and the control actor (the Ray shell of the control core, :mod:`staleflow_trainer.control`).
The driver (:mod:`staleflow_trainer.runtime.deployment`) only starts them, streams step records
into the run directory and stops them; :mod:`staleflow_trainer.runtime.prepare` holds what it
is built from.

Run directory (``run.run_dir``)::

    config.yaml            the resolved config
    model/                 the tiny model, when model.path is empty
    metrics.jsonl          one JSON object per training step (see staleflow_trainer.report.metrics)
    timeline.jsonl         per-instance busy / syncing / idle intervals
    tensorboard/           TensorBoard events
    checkpoints/step_<k>/  trainer.pt, trajectory_store.bin, core.json, records.json (+ .sha256)
    checkpoints/latest     name of the newest complete checkpoint
    plots/                 PNGs (staleflow plot RUN_DIR)

Resuming (``run.resume``: ``auto`` = when a checkpoint exists, ``must``, ``never``): model,
optimizer, trajectory store and the control core's state (protocol, coordinator, ledger, prompt
feed) come back exactly; trajectories that were on an instance at checkpoint time return to the queue with what
the store held (their V_traj and protocol reservations are kept).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import attrs
import structlog

from staleflow_trainer.actors.reconcile import latest_checkpoint
from staleflow_trainer.config import AppConfig
from staleflow_trainer.runtime.deployment import Deployment
from staleflow_trainer.runtime.prepare import init_ray, role_options
from staleflow_trainer.runtime.startup import finished_run_message

log = structlog.get_logger(__name__)


@attrs.frozen(kw_only=True)
class RunSummary:
    """What a finished ``train`` run produced."""

    run_dir: str
    steps_done: int
    version: int
    wall_s: float
    metrics_path: str
    checkpoint: str | None
    resumed_from: str | None
    plots: tuple[str, ...] = ()
    counters: dict[str, int] = attrs.field(factory=dict)
    ledger: dict[str, Any] = attrs.field(factory=dict)


def train(cfg: AppConfig, *, command: str = "staleflow train CONFIG") -> RunSummary | None:
    """Run ``staleflow train``: start everything, train ``trainer.steps`` steps, stop, plot.
    A run directory that already holds a finished run is reported and left alone (None)."""

    finished = finished_run_message(cfg, command=command)
    if finished is not None:
        from rich.console import Console

        Console().print(finished, markup=False, highlight=False, soft_wrap=True)
        return None
    t0 = time.monotonic()
    dep = Deployment(cfg)
    try:
        dep.start()
        summary = dep.run()
        ledger = dep.ledger()
    finally:
        dep.close()
    plots: tuple[str, ...] = ()
    try:
        from staleflow_trainer.report.plots import plot_run

        plots = tuple(str(p) for p in plot_run(cfg.run_dir))
    except Exception as e:  # plots are a convenience; the run itself succeeded
        log.warning("plots_failed", error=repr(e))
    ckpt = latest_checkpoint(cfg.run_dir)
    result = RunSummary(
        run_dir=str(cfg.run_dir),
        steps_done=int(summary["steps_done"]),
        version=int(summary["version"]),
        wall_s=time.monotonic() - t0,
        metrics_path=str(cfg.run_dir / "metrics.jsonl"),
        checkpoint=None if ckpt is None else str(ckpt),
        resumed_from=None if dep.resume_dir is None else str(dep.resume_dir),
        plots=plots,
        counters=dict(summary["counters"]),
        ledger=ledger,
    )
    (cfg.run_dir / "summary.json").write_text(json.dumps(attrs.asdict(result), indent=1))
    _report(result)
    return result


def _report(s: RunSummary) -> None:
    from rich.console import Console

    c = Console(soft_wrap=True)  # a path is never broken across lines (copy and paste it)
    c.print(
        f"[bold green]done[/]: {s.steps_done} steps (version {s.version}) in {s.wall_s:.0f} s"
        + (f", resumed from {s.resumed_from}" if s.resumed_from else "")
    )
    c.print(f"run directory: {s.run_dir}")
    c.print(f"metrics:       {s.metrics_path}")
    if s.checkpoint:
        c.print(f"checkpoint:    {s.checkpoint}")
    if s.plots:
        c.print(
            f"plots:         {Path(s.plots[0]).parent}  ({', '.join(Path(p).name for p in s.plots)})"
        )
    tb = Path(s.run_dir) / "tensorboard"
    if tb.is_dir():
        c.print(f"tensorboard:   {tb}  (view it: tensorboard --logdir {tb})")
    if s.ledger.get("problems"):
        c.print(f"[bold red]ledger problems[/]: {s.ledger['problems'][:5]}")


__all__ = ["Deployment", "RunSummary", "init_ray", "role_options", "train"]
