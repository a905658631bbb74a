"""``staleflow plot RUN_DIR``: PNGs from ``metrics.jsonl`` and ``timeline.jsonl`` (matplotlib Agg).

Writes into ``RUN_DIR/plots/``: ``staleness_hist.png`` (per-step staleness histogram as a
heat map, step × staleness), ``timeline.png`` (per-instance busy / syncing / idle intervals),
``throughput.png`` (tokens/s and trainer wait per step), ``reward.png`` (reward mean per step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog

from staleflow_trainer.errors import StaleflowError
from staleflow_trainer.metrics import METRICS_FILE, TIMELINE_FILE, read_jsonl

log = structlog.get_logger(__name__)

_STATE_COLORS = {"busy": "#2a9d8f", "syncing": "#e9c46a", "idle": "#e0e0e0"}


class PlotError(StaleflowError):
    """The run directory has nothing to plot."""


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_staleness(rows: list[dict[str, Any]], out: Path) -> Path:
    import numpy as np

    plt = _plt()
    steps = [int(r["step"]) for r in rows]
    max_s = max([int(r.get("max_staleness", 0)) for r in rows] + [0])
    grid = np.zeros((max_s + 1, len(rows)))
    for j, r in enumerate(rows):
        hist = r.get("staleness_hist") or {}
        total = sum(int(c) for c in hist.values()) or 1
        for s, c in hist.items():
            if int(s) <= max_s:
                grid[int(s), j] = int(c) / total
    fig, ax = plt.subplots(figsize=(8, 3.5))
    im = ax.imshow(
        grid,
        aspect="auto",
        origin="lower",
        cmap="viridis",
        extent=(min(steps) - 0.5, max(steps) + 0.5, -0.5, max_s + 0.5),
        vmin=0.0,
        vmax=1.0,
    )
    ax.plot(steps, [r.get("mean_staleness", 0.0) for r in rows], color="w", lw=1, label="mean")
    ax.set_xlabel("training step")
    ax.set_ylabel("staleness (buffer − V_traj)")
    ax.set_title("staleness of consumed samples (fraction per step)")
    ax.legend(loc="upper left")
    fig.colorbar(im, ax=ax, label="fraction of batch")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_timeline(rows: list[dict[str, Any]], out: Path) -> Path:
    plt = _plt()
    instances = sorted({str(r["instance"]) for r in rows})
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * len(instances)))
    for i, inst in enumerate(instances):
        for state, color in _STATE_COLORS.items():
            spans = [
                (float(r["start_s"]), float(r["end_s"]) - float(r["start_s"]))
                for r in rows
                if str(r["instance"]) == inst and r["state"] == state
            ]
            if spans:
                ax.broken_barh(spans, (i - 0.4, 0.8), facecolors=color)
    ax.set_yticks(range(len(instances)), instances)
    ax.set_xlabel("time (s)")
    ax.set_title("rollout instances: busy / syncing / idle")
    from matplotlib.patches import Patch

    ax.legend(
        handles=[Patch(color=c, label=s) for s, c in _STATE_COLORS.items()],
        loc="upper right",
        fontsize="small",
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_throughput(rows: list[dict[str, Any]], out: Path) -> Path:
    plt = _plt()
    steps = [int(r["step"]) for r in rows]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(steps, [r.get("tokens_per_s", 0.0) for r in rows], marker=".", label="tokens/s")
    ax.set_xlabel("training step")
    ax.set_ylabel("tokens / s")
    ax2 = ax.twinx()
    ax2.plot(
        steps,
        [r.get("trainer_wait_s", 0.0) for r in rows],
        color="tab:red",
        alpha=0.6,
        label="trainer wait (s)",
    )
    ax2.set_ylabel("trainer wait (s)")
    ax.set_title("throughput and trainer wait")
    fig.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_reward(rows: list[dict[str, Any]], out: Path) -> Path:
    plt = _plt()
    steps = [int(r["step"]) for r in rows]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(steps, [r.get("reward_mean", 0.0) for r in rows], marker=".", label="reward mean")
    if any("accuracy" in r for r in rows):
        ax.plot(steps, [r.get("accuracy", 0.0) for r in rows], label="accuracy")
    ax.set_xlabel("training step")
    ax.set_ylabel("reward")
    ax.set_title("reward")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write every plot the run's files allow; returns the PNG paths."""
    run = Path(run_dir)
    rows = read_jsonl(run / METRICS_FILE)
    timeline = read_jsonl(run / TIMELINE_FILE)
    if not rows and not timeline:
        raise PlotError(f"{run}: neither {METRICS_FILE} nor {TIMELINE_FILE} has any records")
    out = run / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if rows:
        rows = sorted(rows, key=lambda r: int(r["step"]))
        written.append(plot_staleness(rows, out / "staleness_hist.png"))
        written.append(plot_throughput(rows, out / "throughput.png"))
        written.append(plot_reward(rows, out / "reward.png"))
    if timeline:
        written.append(plot_timeline(timeline, out / "timeline.png"))
    log.info("plots_written", run_dir=str(run), files=[p.name for p in written])
    return written
