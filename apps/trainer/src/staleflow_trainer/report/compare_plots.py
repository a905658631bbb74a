"""PNGs for ``staleflow compare`` (in ``RUN_DIR/results/``):

* ``throughput.png`` — trained tokens/s after the warm-up steps of every (policy, η), grouped
  by η, with the split's ideal (the title says when the run is too short for a steady state);
* ``staleness.png`` — per run, the share of consumed samples at each staleness, η marked;
* ``timelines.png`` — the instances' busy / syncing / idle intervals of the main policies at
  the largest η, on one shared time axis, with the training steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollout_coordinator.policies import build_policy
from staleflow_trainer.report.metrics import METRICS_FILE, TIMELINE_FILE, read_jsonl
from staleflow_trainer.report.plots import ETA_COLOR, STATE_COLORS, plt_agg

STALEFLOW_COLOR = "#264653"
BASELINE_COLOR = "#8ab17d"
TIMELINE_POLICIES = (
    "staleflow",
    "all-vanilla",
    "coarse-async",
    "coarse-async-drop",
    "verl-async",
    "one-step",
    "sync",
)


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    res = out_dir / "results"
    res.mkdir(parents=True, exist_ok=True)
    return [
        _throughput(report, res / "throughput.png"),
        _staleness(report, res / "staleness.png"),
        _timelines(report, out_dir, res / "timelines.png"),
    ]


def _save(fig: Any, out: Path, dpi: int = 100) -> Path:
    fig.savefig(out, dpi=dpi, bbox_inches="tight")
    plt_agg().close(fig)
    return out


def _first_seed(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs of the comparison's first seed (the plots show one seed's runs)."""
    seed = report["results"][0].get("seed") if report["results"] else None
    return [r for r in report["results"] if r.get("seed") == seed]


def _order(report: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(_first_seed(report), key=lambda r: (r["eta"], r["policy"]))


def _measured(report: dict[str, Any]) -> str:
    """What the throughput numbers average over, from the report's ``protocol`` section."""
    proto = report.get("protocol") or {}
    if "measured_steps" not in proto:
        return "after the warm-up steps"
    return f"mean of {proto['measured_steps']} steps after {proto.get('warmup_steps', 0)} warm-up"


def _throughput(report: dict[str, Any], out: Path) -> Path:
    plt = plt_agg()
    from matplotlib.patches import Patch

    rows = _order(report)
    labels = [r["policy"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(rows)), 4.6))
    colors = [STALEFLOW_COLOR if r["policy"] == "staleflow" else BASELINE_COLOR for r in rows]
    ax.bar(range(len(rows)), [r["tokens_per_s"] for r in rows], color=colors)
    ideal = ax.axhline(
        report["ideal_tokens_per_s"], color=ETA_COLOR, ls="--", label="ideal of the split"
    )
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
    # group labels: one per η, between dotted separators
    etas = [r["eta"] for r in rows]
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or etas[i] != etas[start]:
            ax.text(
                (start + i - 1) / 2,
                1.01,
                f"η = {etas[start]}",
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="bottom",
                fontsize=9,
            )
            if i < len(rows):
                ax.axvline(i - 0.5, color="#999999", ls=":", lw=1)
            start = i
    ax.set_ylabel(f"trained tokens / virtual s\n({_measured(report)})")
    ax.set_xlabel("policy (grouped by the staleness bound η)")
    pr = report.get("protocol") or {}
    short = pr.get("steady_state") is False
    why = "; ".join(pr.get("short_of") or []) or "too short"
    ax.set_title(
        "throughput by policy and staleness bound"
        + (f" (not a steady-state measurement: {why})" if short else ""),
        pad=18,
    )
    ax.legend(
        handles=[
            Patch(color=STALEFLOW_COLOR, label="staleflow"),
            Patch(color=BASELINE_COLOR, label="baselines and ablations"),
            ideal,
        ],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize="small",
    )
    return _save(fig, out)


def _staleness(report: dict[str, Any], out: Path) -> Path:
    plt = plt_agg()
    from matplotlib.lines import Line2D

    rows = _order(report)
    cols = 4
    nrows = (len(rows) + cols - 1) // cols
    # one staleness axis for every panel, so the bars line up from panel to panel
    top = max([r["eta"] for r in rows] + [int(k) for r in rows for k in r["staleness_hist"]])
    xs = list(range(top + 1))
    fig, axes = plt.subplots(nrows, cols, figsize=(12, 2.5 * nrows), squeeze=False)
    for ax, r in zip(axes.flat, rows, strict=False):
        hist = {int(k): v for k, v in r["staleness_hist"].items()}
        total = sum(hist.values()) or 1
        color = STALEFLOW_COLOR if r["policy"] == "staleflow" else BASELINE_COLOR
        ax.bar(xs, [hist.get(x, 0) / total for x in xs], color=color)
        keeps = build_policy(r["policy"]).keeps_eta
        if keeps:
            ax.axvline(r["eta"] + 0.5, color=ETA_COLOR, ls="--", lw=1.2)
        ax.set_title(f"{r['policy']} η={r['eta']}" + ("" if keeps else " (window, no bound)"),
                     fontsize=8)  # fmt: skip
        ax.set_xticks(xs)
        ax.set_xlim(-0.6, max(xs) + 0.9)
        ax.set_ylim(0, 1)
        ax.set_xlabel("staleness (versions)", fontsize=8)
        ax.set_ylabel("share", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(rows) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.legend(
        handles=[Line2D([], [], color=ETA_COLOR, ls="--", label="bound η (no sample beyond)")],
        title="staleness of the consumed samples (share of all trained samples)",
        title_fontsize="large",
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        fontsize="small",
        frameon=False,
    )
    return _save(fig, out)


def _timelines(report: dict[str, Any], out_dir: Path, out: Path) -> Path:
    plt = plt_agg()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    first = _first_seed(report)
    eta = max(r["eta"] for r in first)
    runs = []
    for p in TIMELINE_POLICIES:
        for r in first:
            if r["policy"] == p and (r["eta"] == eta or p in ("sync", "one-step")):
                runs.append(r)
                break
    data = []
    for r in runs:
        run = out_dir / "runs" / r["run"]
        data.append((r, read_jsonl(run / TIMELINE_FILE), read_jsonl(run / METRICS_FILE)))
    end = max(
        [float(row["end_s"]) for _, rows, _ in data for row in rows]
        + [float(m.get("time_s", 0.0)) for _, _, ms in data for m in ms]
        + [1.0]
    )
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(12, 1.2 + 1.8 * len(runs)), squeeze=False, sharex=True
    )
    for ax, (r, rows, steps) in zip(axes.flat, data, strict=False):
        insts = sorted({row["instance"] for row in rows})
        for i, inst in enumerate(insts):
            for state, color in STATE_COLORS.items():
                spans = [
                    (row["start_s"], row["end_s"] - row["start_s"])
                    for row in rows
                    if row["instance"] == inst and row["state"] == state
                ]
                if spans:
                    ax.broken_barh(spans, (i - 0.45, 0.9), facecolors=color)
        for m in steps:
            if m.get("time_s") is not None:
                ax.axvline(float(m["time_s"]), color="#111111", lw=0.8, ls="--", zorder=3)
        ax.set_title(
            f"{r['policy']} η={r['eta']}: {r['tokens_per_s']:,.0f} trained tokens/s, "
            f"{len(steps)} steps"
            + (f" ({r['same_as']}'s run: the same decisions)" if "same_as" in r else ""),
            fontsize=9,
        )
        ax.set_yticks([])
        ax.set_ylabel(f"{len(insts)} instances", fontsize=8)
        ax.set_xlim(0, end * 1.01)
        ax.set_xlabel("virtual time (s)", fontsize=8)
        ax.tick_params(labelbottom=True, labelsize=8)
    fig.tight_layout()
    fig.legend(
        handles=[
            *(Patch(color=c, label=s) for s, c in STATE_COLORS.items()),
            Line2D([], [], color="#111111", lw=0.9, ls="--", label="step done"),
        ],
        title=f"rollout instances over time (η = {eta}; sync and one-step at their own η)",
        title_fontsize="large",
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncol=4,
        fontsize="small",
        frameon=False,
    )
    return _save(fig, out)
