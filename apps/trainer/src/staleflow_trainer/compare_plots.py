"""PNGs for ``staleflow compare``: throughput bars, staleness histograms, instance timelines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from staleflow_trainer.metrics import TIMELINE_FILE, read_jsonl

_COLORS = {"busy": "#2a9d8f", "syncing": "#e9c46a", "idle": "#e0e0e0"}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    res = out_dir / "results"
    res.mkdir(parents=True, exist_ok=True)
    return [
        _throughput(report, res / "throughput.png"),
        _staleness(report, res / "staleness.png"),
        _timelines(report, out_dir, res / "timelines.png"),
    ]


def _first_seed(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs of the comparison's first seed (the plots show one seed's runs)."""
    seed = report["results"][0].get("seed") if report["results"] else None
    return [r for r in report["results"] if r.get("seed") == seed]


def _throughput(report: dict[str, Any], out: Path) -> Path:
    plt = _plt()
    rows = sorted(_first_seed(report), key=lambda r: (r["eta"], r["policy"]))
    labels = [f"{r['policy']}\nη={r['eta']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(rows)), 4))
    colors = ["#264653" if r["policy"] == "staleflow" else "#8ab17d" for r in rows]
    ax.bar(range(len(rows)), [r["tokens_per_s"] for r in rows], color=colors)
    ax.axhline(report["ideal_tokens_per_s"], color="#e76f51", ls="--", label="ideal (split)")
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
    ax.set_ylabel("tokens/s (steady state)")
    ax.set_title("throughput by policy and staleness bound")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _staleness(report: dict[str, Any], out: Path) -> Path:
    plt = _plt()
    rows = sorted(_first_seed(report), key=lambda r: (r["eta"], r["policy"]))
    cols = 4
    nrows = (len(rows) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(12, 2.2 * nrows), squeeze=False)
    for ax, r in zip(axes.flat, rows, strict=False):
        hist = {int(k): v for k, v in r["staleness_hist"].items()}
        total = sum(hist.values()) or 1
        xs = list(range(max(hist, default=0) + 1))
        ax.bar(xs, [hist.get(x, 0) / total for x in xs], color="#264653")
        ax.set_title(f"{r['policy']} η={r['eta']}", fontsize=8)
        ax.set_xticks(xs)
        ax.set_ylim(0, 1)
    for ax in list(axes.flat)[len(rows) :]:
        ax.axis("off")
    fig.suptitle("staleness of consumed samples (fraction)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _timelines(report: dict[str, Any], out_dir: Path, out: Path) -> Path:
    plt = _plt()
    first = _first_seed(report)
    eta = max(r["eta"] for r in first)
    wanted = ["staleflow", "all-vanilla", "coarse-async", "coarse-async-drop", "one-step", "sync"]
    runs = []
    for p in wanted:
        for r in first:
            if r["policy"] == p and (r["eta"] == eta or p in ("sync", "one-step")):
                runs.append(r)
                break
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.0 * len(runs)), squeeze=False)
    for ax, r in zip(axes.flat, runs, strict=False):
        rows = read_jsonl(out_dir / "runs" / r["run"] / TIMELINE_FILE)
        insts = sorted({row["instance"] for row in rows})
        for i, inst in enumerate(insts):
            for state, color in _COLORS.items():
                spans = [
                    (row["start_s"], row["end_s"] - row["start_s"])
                    for row in rows
                    if row["instance"] == inst and row["state"] == state
                ]
                if spans:
                    ax.broken_barh(spans, (i - 0.45, 0.9), facecolors=color)
        ax.set_title(f"{r['policy']} η={r['eta']}: instances busy / syncing / idle", fontsize=9)
        ax.set_yticks([])
        ax.set_ylabel(f"{len(insts)} inst.")
    axes.flat[-1].set_xlabel("virtual time (s)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
