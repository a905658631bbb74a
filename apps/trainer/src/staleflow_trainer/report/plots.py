"""``staleflow plot RUN_DIR``: PNGs from ``metrics.jsonl`` and ``timeline.jsonl`` (matplotlib Agg).

Writes into ``RUN_DIR/plots/``:

* ``staleness_hist.png`` — the staleness of each step's consumed batch (share of the batch per
  staleness, step × staleness) with its mean, and the bound η drawn above the highest allowed
  staleness (no sample lies beyond it);
* ``throughput.png`` — trained tokens/s of each step and over a window of steps, generated
  tokens/s over the same window, and the trainer's wait per step;
* ``reward.png`` — mean reward (and accuracy) per step; titled *synthetic* when the rewards
  come from the simulator (``staleflow simulate`` or ``rollout.backend=sim``);
* ``timeline.png`` — per-instance busy / syncing / idle intervals, with the training steps.

η, the policy and the backend are read from ``RUN_DIR/config.yaml`` when it is there. The
metric definitions are in :mod:`staleflow_trainer.control.report`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import structlog

from staleflow_trainer.errors import StaleflowError
from staleflow_trainer.report.metrics import METRICS_FILE, TIMELINE_FILE, read_jsonl
from staleflow_trainer.report.progress import throughput

log = structlog.get_logger(__name__)

STATE_COLORS = {"busy": "#2a9d8f", "syncing": "#e9c46a", "idle": "#e0e0e0"}
ETA_COLOR = "#e76f51"


class PlotError(StaleflowError):
    """The run directory does not exist or has nothing to plot."""


@attrs.frozen(kw_only=True)
class RunInfo:
    """What the plots say about a run besides its metrics (from ``config.yaml``)."""

    eta: int | None = None  # None: unbounded or unknown
    unbounded: bool = False  # protocol.eta is "unbounded": no staleness bound to draw
    keeps_eta: bool = True  # False: the policy keeps no per-trajectory bound (verl-async)
    window: float | None = None  # verl-async: coordinator.verl_staleness_threshold (None: η)
    policy: str = ""
    simulated: bool = False  # virtual time and synthetic rewards (not a learning curve)


def _keeps_eta(policy: str) -> bool:
    from rollout_coordinator.policies import POLICIES, build_policy

    return policy not in POLICIES or build_policy(policy).keeps_eta


def run_info(run_dir: Path, *, simulated: bool = False) -> RunInfo:
    """η, policy and whether the run was simulated, from ``RUN_DIR/config.yaml``."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return RunInfo(simulated=simulated)
    import yaml

    try:
        cfg = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        return RunInfo(simulated=simulated)
    eta = (cfg.get("protocol") or {}).get("eta")
    coord = cfg.get("coordinator") or {}
    policy = str(coord.get("policy", ""))
    window = coord.get("verl_staleness_threshold")
    return RunInfo(
        eta=eta if isinstance(eta, int) and not isinstance(eta, bool) else None,
        unbounded=eta == "unbounded",
        keeps_eta=_keeps_eta(policy),
        window=float(window) if isinstance(window, int | float) else None,
        policy=policy,
        simulated=simulated or (cfg.get("rollout") or {}).get("backend") == "sim",
    )


def plt_agg() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, out: Path, dpi: int = 110) -> Path:
    fig.savefig(out, dpi=dpi, bbox_inches="tight")
    plt_agg().close(fig)
    return out


def _integer_axis(axis: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def plot_staleness(rows: list[dict[str, Any]], out: Path, info: RunInfo | None = None) -> Path:
    import numpy as np

    info = info or RunInfo()
    plt = plt_agg()
    steps = [int(r["step"]) for r in rows]
    max_s = max([int(r.get("max_staleness", 0)) for r in rows] + [0])
    top = max(max_s, info.eta or 0)
    grid = np.zeros((top + 1, len(rows)))
    for j, r in enumerate(rows):
        hist = r.get("staleness_hist") or {}
        total = sum(int(c) for c in hist.values()) or 1
        for s, c in hist.items():
            grid[int(s), j] = int(c) / total
    fig, ax = plt.subplots(figsize=(9, 3.8))
    im = ax.imshow(
        grid,
        aspect="auto",
        origin="lower",
        cmap="viridis",
        extent=(min(steps) - 0.5, max(steps) + 0.5, -0.5, top + 0.5),
        vmin=0.0,
        vmax=1.0,
        interpolation="nearest",
    )
    import matplotlib.patheffects as pe

    ax.plot(
        steps,
        [r.get("mean_staleness", 0.0) for r in rows],
        color="w",
        lw=1.4,
        label="mean staleness",
        path_effects=[pe.Stroke(linewidth=2.6, foreground="#333333"), pe.Normal()],
    )
    if info.eta is not None and not info.keeps_eta:
        from staleflow_trainer.config_coordinator import verl_window

        w = verl_window(info.eta, info.window)
        ax.plot([], [], ls="none", label=f"no staleness bound ({info.policy}: window s = {w:g})")
    elif info.eta is not None:  # between the highest allowed staleness and the first forbidden
        ax.axhline(
            info.eta + 0.5,
            color=ETA_COLOR,
            ls="--",
            lw=2.0,
            label=f"bound η = {info.eta} (no sample above)",
        )
    elif info.unbounded:
        ax.plot([], [], ls="none", label="no staleness bound (η unbounded)")
    ax.set_ylim(-0.5, top + 1.0)  # half a row of room above: the bound line stays visible
    ax.set_yticks(range(top + 1))
    _integer_axis(ax.xaxis)
    ax.set_xlabel("training step")
    ax.set_ylabel("staleness (versions)")
    ax.set_title("staleness of the consumed samples: share of each step's batch")
    ax.legend(loc="upper left", bbox_to_anchor=(0.0, -0.18), ncol=2, fontsize="small")
    fig.colorbar(im, ax=ax, label="share of the batch")
    return _save(fig, out)


def plot_timeline(
    rows: list[dict[str, Any]],
    out: Path,
    steps: list[dict[str, Any]] | None = None,
    info: RunInfo | None = None,
) -> Path:
    plt = plt_agg()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    instances = sorted({str(r["instance"]) for r in rows})
    fig, ax = plt.subplots(figsize=(12, 1.4 + 0.4 * len(instances)))
    for i, inst in enumerate(instances):
        for state, color in STATE_COLORS.items():
            spans = [
                (float(r["start_s"]), float(r["end_s"]) - float(r["start_s"]))
                for r in rows
                if str(r["instance"]) == inst and r["state"] == state
            ]
            if spans:
                ax.broken_barh(spans, (i - 0.4, 0.8), facecolors=color)
    handles: list[Any] = [Patch(color=c, label=s) for s, c in STATE_COLORS.items()]
    times = [float(r["time_s"]) for r in steps or [] if r.get("time_s") is not None]
    for t in times:
        ax.axvline(t, color="#111111", lw=0.9, ls="--", zorder=3)
    if times:
        handles.append(Line2D([], [], color="#111111", lw=0.9, ls="--", label="step done"))
    ax.set_yticks(range(len(instances)), instances)
    ax.set_ylim(-0.6, len(instances) - 0.4)
    ax.set_xlim(0, max([float(r["end_s"]) for r in rows] + times + [0.0]) * 1.01)
    virtual = info is not None and info.simulated
    ax.set_xlabel(f"{'virtual ' if virtual else ''}time since the run started (s)")
    ax.set_ylabel("rollout instance")
    ax.set_title("rollout instances: busy (generating) / syncing (loading weights) / idle", pad=26)
    ax.legend(
        handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=4, fontsize="small"
    )
    return _save(fig, out)


def _rate_window() -> int:
    """The number of steps the control core averages the generated rate over."""
    from staleflow_trainer.control.config import CoreConfig

    default = attrs.fields(CoreConfig).rate_window_steps.default
    assert isinstance(default, int)
    return default


def plot_throughput(rows: list[dict[str, Any]], out: Path, info: RunInfo | None = None) -> Path:
    info = info or RunInfo()
    plt = plt_agg()
    steps = [int(r["step"]) for r in rows]
    rates = [throughput(r) for r in rows]
    trained = [t for t, _ in rates]
    generated = [g for _, g in rates]
    fig, (ax, ax2) = plt.subplots(
        2, 1, figsize=(9, 5.2), sharex=True, gridspec_kw={"height_ratios": [3, 1.2]}
    )
    if any(t is not None for t in trained):
        ax.plot(
            steps,
            [float("nan") if t is None else t for t in trained],
            ls="none",
            marker="o",
            ms=4,
            color="#264653",
            alpha=0.55,
            label="trained tokens/s of each step\n(its batch's prompt + response tokens / its "
            "step time)",
        )
        window = _rate_window()
        if all(r.get("tokens") is not None and r.get("step_s") is not None for r in rows):
            toks = [float(r["tokens"]) for r in rows]
            spans = [float(r["step_s"]) for r in rows]
            rolling = []
            for i in range(len(rows)):
                lo = max(0, i + 1 - window)
                d = sum(spans[lo : i + 1])
                rolling.append(sum(toks[lo : i + 1]) / d if d > 0 else float("nan"))
            ax.plot(
                steps,
                rolling,
                color="#264653",
                lw=1.8,
                label=f"trained tokens/s over the last {window} steps",
            )
    if any(g is not None for g in generated):
        over = (
            f"over the last {_rate_window()} steps"
            if "gen_tokens_per_s" in rows[0]
            else "since the previous step"
        )
        ax.plot(
            steps,
            [float("nan") if g is None else g for g in generated],
            color=ETA_COLOR,
            lw=1.8,
            label=f"generated (response) tokens/s {over}",
        )
    ax.set_ylabel("tokens / virtual s" if info.simulated else "tokens / s")
    ax.set_ylim(bottom=0)
    ax.set_title("throughput: trained vs generated tokens per second")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax2.bar(steps, [float(r.get("trainer_wait_s", 0.0)) for r in rows], color="#8ab17d")
    ax2.set_ylabel("trainer wait (virtual s)" if info.simulated else "trainer wait (s)")
    ax2.set_xlabel("training step")
    _integer_axis(ax2.xaxis)
    return _save(fig, out)


def plot_reward(rows: list[dict[str, Any]], out: Path, info: RunInfo | None = None) -> Path:
    info = info or RunInfo()
    plt = plt_agg()
    steps = [int(r["step"]) for r in rows]
    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.plot(steps, [r.get("reward_mean", 0.0) for r in rows], marker=".", label="reward mean")
    acc = [r.get("accuracy") for r in rows]
    if any(a is not None and a != r.get("reward_mean") for a, r in zip(acc, rows, strict=True)):
        ax.plot(
            steps,
            [float("nan") if a is None else a for a in acc],
            ls="--",
            label="accuracy (share with reward ≥ 1)",
        )
    ax.set_xlabel("training step")
    ax.set_ylabel("mean reward of the step's batch")
    _integer_axis(ax.xaxis)
    if info.simulated:
        ax.set_title("synthetic reward (simulated rollouts): not a learning curve")
    else:
        ax.set_title("reward of the consumed batches")
    ax.legend(fontsize="small")
    return _save(fig, out)


def plot_run(run_dir: str | Path, *, simulated: bool = False) -> list[Path]:
    """Write every plot the run's files allow; returns the PNG paths. ``simulated``: the
    rewards are synthetic (also detected from ``rollout.backend=sim`` in config.yaml)."""
    run = Path(run_dir)
    if not run.is_dir():
        raise PlotError(f"{run}: no such directory")
    rows = read_jsonl(run / METRICS_FILE)
    timeline = read_jsonl(run / TIMELINE_FILE)
    if not rows and not timeline:
        raise PlotError(f"{run}: neither {METRICS_FILE} nor {TIMELINE_FILE} has any records")
    info = run_info(run, simulated=simulated)
    out = run / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if rows:
        rows = sorted(rows, key=lambda r: int(r["step"]))
        written.append(plot_staleness(rows, out / "staleness_hist.png", info))
        written.append(plot_throughput(rows, out / "throughput.png", info))
        written.append(plot_reward(rows, out / "reward.png", info))
    if timeline:
        written.append(plot_timeline(timeline, out / "timeline.png", rows, info))
    log.debug("plots_written", run_dir=str(run), files=[p.name for p in written])
    return written
