"""Figures and tables of the convergence study (``convergence_study.py`` calls them).

Two groups of settings: the *base* study (the deployment as configured) and the *slow-trainer*
study (the same deployment with ``trainer.step_delay_s``, so the rollout outruns the trainer).
Each group gets its reward and staleness figures; the final-policy figure and the tables hold
every setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _ok(entries: Sequence[dict[str, Any]], settings: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    ok = [e for e in entries if e["status"] == "ok"]
    present = [s for s in settings if any(e["setting"] == s.name for e in ok)]
    return ok, present


def _smooth(y: Any, k: int) -> Any:
    import numpy as np

    if len(y) < k:
        return y
    pad = np.concatenate([np.full(k - 1, y[0]), y])
    return np.convolve(pad, np.ones(k) / k, mode="valid")


def _mean_curve(runs: Sequence[dict[str, Any]], key: str) -> tuple[Any, Any]:
    import numpy as np

    curves = [np.asarray(e[key], dtype=float) for e in runs]
    n = min(len(c) for c in curves)
    x = np.arange(1, n + 1) * runs[0]["samples_per_step"]
    return x, np.mean([c[:n] for c in curves], axis=0)


def plot_rewards(
    entries: Sequence[dict[str, Any]],
    settings: Sequence[Any],
    path: Path,
    *,
    title: str,
    reference: Sequence[Any] = (),
    grid: tuple[int, int] = (2, 4),
) -> Path:
    """Reward vs consumed samples: one panel per setting (seeds thin, mean bold) and an overlay
    of the smoothed seed means; ``reference`` settings are drawn dashed in the overlay only."""
    import matplotlib.pyplot as plt

    ok, names = _ok(entries, settings)
    colors = dict(zip([s.name for s in names], plt.get_cmap("tab10").colors, strict=False))
    rows, cols = grid
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 4 * rows), sharex=True, sharey=True)
    flat = list(axes.flat)
    overlay = flat[-1]
    for ax, s in zip(flat, names, strict=False):
        runs = [e for e in ok if e["setting"] == s.name]
        for e in runs:
            x = [(i + 1) * e["samples_per_step"] for i in range(len(e["rewards"]))]
            ax.plot(x, e["rewards"], lw=0.8, alpha=0.45, color=colors[s.name],
                    label=f"seed {e['seed']}")  # fmt: skip
        x, mean = _mean_curve(runs, "rewards")
        k = max(3, len(mean) // 12)
        ax.plot(x, _smooth(mean, k), lw=2.2, color=colors[s.name], label=f"mean ({k}-step avg)")
        overlay.plot(x, _smooth(mean, k), lw=2, color=colors[s.name], label=s.label)
        ax.set_title(f"{s.label}  ({len(runs)} seed{'s' if len(runs) > 1 else ''})", fontsize=10)
        ax.tick_params(labelbottom=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    ref_ok, refs = _ok(entries, reference)
    for s, ls in zip(refs, ("--", ":", "-."), strict=False):
        runs = [e for e in ref_ok if e["setting"] == s.name]
        x, mean = _mean_curve(runs, "rewards")
        overlay.plot(x, _smooth(mean, max(3, len(mean) // 12)), lw=1.4, ls=ls, color="grey",
                     label=f"{s.label} (no delay)")  # fmt: skip
    overlay.set_title("all (seed mean, smoothed)", fontsize=10)
    overlay.tick_params(labelleft=True, labelbottom=True)
    overlay.grid(alpha=0.3)
    overlay.legend(fontsize=7, loc="upper left")
    for ax in flat[len(names) : -1]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("consumed samples")
    for ax in axes[:, 0]:
        ax.set_ylabel("reward of consumed batch")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_staleness(
    entries: Sequence[dict[str, Any]], settings: Sequence[Any], path: Path, *, grid: tuple[int, int]
) -> Path:
    """Histogram of consumed staleness per setting (all seeds, fraction of samples)."""
    import matplotlib.pyplot as plt

    ok, names = _ok(entries, settings)
    colors = dict(zip([s.name for s in names], plt.get_cmap("tab10").colors, strict=False))
    fig, axes = plt.subplots(*grid, figsize=(5 * grid[1], 3.5 * grid[0]), squeeze=False)
    for ax, s in zip(axes.flat, names, strict=False):
        hist: dict[int, int] = {}
        for e in ok:
            if e["setting"] == s.name:
                for k, c in e["staleness_hist"].items():
                    hist[int(k)] = hist.get(int(k), 0) + c
        total = sum(hist.values())
        xs = sorted(hist)
        ax.bar(xs, [hist[k] / total for k in xs], color=colors[s.name], width=0.8)
        mean = sum(k * c for k, c in hist.items()) / total
        eta = s.eta
        if isinstance(eta, int):
            ax.axvline(eta + 0.5, color="k", ls="--", lw=1, label=f"bound η={eta}")
            ax.legend(fontsize=8)
        ax.set_title(f"{s.label}: mean {mean:.2f}, max {max(xs)}", fontsize=10)
        top = max([*xs, eta if isinstance(eta, int) else 0])
        # integer ticks even when one staleness is all there is (MaxNLocator(integer=True)
        # falls back to fractions with fewer than two integers in view)
        ax.set_xticks(range(0, top + 1, 1 if top <= 12 else 5))
        ax.set_xlim(-0.7, top + 0.9)
        ax.set_xlabel("staleness of consumed sample (versions)")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3, axis="y")
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_staleness_by_step(
    entries: Sequence[dict[str, Any]], settings: Sequence[Any], path: Path, *, title: str
) -> Path:
    """Mean and max consumed staleness of every step (each seed a line): does it grow?"""
    import matplotlib.pyplot as plt

    ok, names = _ok(entries, settings)
    names = [
        s for s in names if all("staleness_by_step" in e for e in ok if e["setting"] == s.name)
    ]
    colors = dict(zip([s.name for s in names], plt.get_cmap("tab10").colors, strict=False))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for i, s in enumerate(names):
        style = {"color": colors[s.name], "lw": 1.3, "ls": ("-", "--", "-.", ":")[i % 4]}
        for j, e in enumerate(e for e in ok if e["setting"] == s.name):
            steps = range(1, len(e["staleness_by_step"]) + 1)
            label = s.label if j == 0 else None
            axes[0].plot(steps, e["staleness_by_step"], label=label, **style)
            axes[1].plot(steps, e["max_staleness_by_step"], label=label, **style)
    for ax, what in zip(axes, ("mean", "max"), strict=True):
        ax.set_xlabel("training step")
        ax.set_title(f"{what} staleness of the consumed batch (one line per seed)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    axes[0].set_ylabel("staleness (versions)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_policy(entries: Sequence[dict[str, Any]], settings: Sequence[Any], path: Path) -> Path:
    """Final-policy reward (evaluated on every prompt) per setting and seed."""
    import matplotlib.pyplot as plt
    import numpy as np

    ok, names = _ok(entries, settings)
    colors = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(max(9.0, 1.25 * len(names)), 4.8))
    for i, s in enumerate(names):
        runs = [e for e in ok if e["setting"] == s.name and e.get("policy_reward_end") is not None]
        c = colors[i % len(colors)]
        for j, e in enumerate(runs):
            x = i + 0.08 * (j - (len(runs) - 1) / 2)
            ax.scatter(x, e["policy_reward_end"], color=c, zorder=3)
            ax.scatter(x, e["policy_reward_start"], color="grey", marker="x", zorder=3)
        if runs:
            mean = np.mean([e["policy_reward_end"] for e in runs])
            ax.hlines(mean, i - 0.3, i + 0.3, color=c, lw=2)
    for i in range(1, len(names)):  # a line between the base and the slow-trainer settings
        if names[i].study != names[i - 1].study:
            ax.axvline(i - 0.5, color="k", ls=":", lw=1)
    ax.set_xticks(range(len(names)), [s.label.replace(", ", ",\n") for s in names], fontsize=8)
    ax.set_ylabel("expected reward of the policy")
    ax.set_title("Final trained policy (dots; bar = seed mean) vs initial policy (x)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------- tables


def _f(v: Any, p: int = 3) -> str:
    return "—" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))


def run_table(entries: Sequence[dict[str, Any]], settings: Sequence[Any]) -> str:
    """A markdown table of every run (docs/convergence.md pastes it)."""
    label = {s.name: s.label for s in settings}
    lines = [
        "| setting | seed | status | reward start → end | reward AUC | policy reward start → end"
        " | max / mean staleness | tokens/s | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        lines.append(
            f"| {label[e['setting']]} | {e['seed']} | {e['status']} "
            f"| {_f(e['reward_start'])} → {_f(e['reward_end'])} | {_f(e['reward_auc'])} "
            f"| {_f(e.get('policy_reward_start'))} → {_f(e.get('policy_reward_end'))} "
            f"| {_f(e['max_staleness'])} / {_f(e['mean_staleness'], 2)} "
            f"| {_f(e['tokens_per_s'], 0)} | {_f(e['wall_s'], 0)} |"
        )
    return "\n".join(lines)


def _spread(xs: Sequence[float], p: int = 3) -> str:
    """``mean (min–max)`` over seeds; ``mean`` alone for one seed."""
    if not xs:
        return "—"
    m = f"{sum(xs) / len(xs):.{p}f}"
    return m if len(xs) == 1 else f"{m} ({min(xs):.{p}f}–{max(xs):.{p}f})"


def setting_table(entries: Sequence[dict[str, Any]], settings: Sequence[Any]) -> str:
    """Seed means (and the seeds' range) per setting, finished runs only, in settings order."""
    lines = [
        "| setting | seeds | reward start → end | reward AUC | policy reward end"
        " | mean staleness | max staleness | tokens/s | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in settings:
        ok = [e for e in entries if e["setting"] == s.name and e["status"] == "ok"]
        if not any(e["setting"] == s.name for e in entries):
            continue

        def col(k: str, ok: list[dict[str, Any]] = ok) -> list[float]:
            return [float(e[k]) for e in ok if e.get(k) is not None]

        start = _spread(col("reward_start")).split(" ")[0]
        lines.append(
            f"| {s.label} | {len(ok)} | {start} → {_spread(col('reward_end'))} "
            f"| {_spread(col('reward_auc'))} | {_spread(col('policy_reward_end'))} "
            f"| {_spread(col('mean_staleness'), 2)} "
            f"| {max(map(int, col('max_staleness')), default='—')} "
            f"| {_spread(col('tokens_per_s'), 0)} | {_spread(col('wall_s'), 0)} |"
        )
    return "\n".join(lines)


def trained_table(entries: Sequence[dict[str, Any]], settings: Sequence[Any]) -> str:
    """What each run trained on and what it threw away: response length and reward of the
    consumed samples, trajectories dropped (by reason) and generated tokens not trained on."""
    label = {s.name: s.label for s in settings}
    lines = [
        "| setting | seed | trained response tokens / sample | trained reward (AUC) "
        "| mean staleness | trajectories dropped (reason) | generated tokens | not trained |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        if e["status"] != "ok" or e["setting"] not in label:
            continue
        reasons = e.get("dropped_reasons") or {}
        dropped = sum(reasons.values())
        why = ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) or "—"
        gen, trained = e.get("generated_tokens"), e.get("response_tokens")
        lost = "—" if gen is None or trained is None else str(gen - trained)
        lines.append(
            f"| {label[e['setting']]} | {e['seed']} | {_f(e.get('response_tokens_per_sample'), 2)} "
            f"| {_f(e['reward_auc'])} | {_f(e['mean_staleness'], 2)} | {dropped} ({why}) "
            f"| {_f(gen)} | {lost} |"
        )
    return "\n".join(lines)
