"""The convergence study: does the staleness bound preserve learning?

Runs ``staleflow train`` (the whole system: Ray, 2 vLLM-CPU rollout instances, NIXL parameter
server, StaleFlow coordinator) once per (setting, seed), one deployment at a time, on
``examples/convergence.yaml``. Settings: η ∈ {0, 1, 3, 10} and "unbounded" with truncated
importance sampling (TIS), and η = 3 without TIS. "unbounded" is no staleness control
(``protocol.eta=unbounded``: a FIFO instead of the protocol, greedy global sync with
``coordinator.policy=all-vanilla``); the others run StaleFlow's coordinator. Every run consumes the same number of samples
(``trainer.steps × B × n``) and seed ``s`` means the same initial model and prompt order in
every setting.

Writes ``results/convergence/summary.json`` (one entry per run, see :func:`run_entry`),
``reward_vs_samples.png``, ``staleness_hist.png`` and ``policy_reward.png``; each run's own
directory (``--runs-dir``) keeps its metrics.jsonl, summary.json and log.

    python benchmarks/convergence_study.py                       # the full study (~22-45 min here)
    python benchmarks/convergence_study.py --seeds 0 --settings eta0,eta3 --steps 20
    python benchmarks/convergence_study.py --plots-only          # re-aggregate existing runs

Runs go seed-major (every setting at seed 0, then seed 1, ...) so a study cut short by
``--budget-s`` still covers every setting; runs that were not started are listed in the summary
with ``"status": "not_run"``, failed ones with ``"status": "failed"`` — nothing is skipped
silently. ``--reuse`` keeps a finished run whose run directory already matches the request.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "convergence.yaml"
OUT = ROOT / "results" / "convergence"
RUN_TIMEOUT_S = 15 * 60
EVAL_SAMPLES = 200  # per distinct prompt, for the final-policy evaluation
ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


@attrs.frozen(kw_only=True)
class Setting:
    name: str
    eta: int | str  # an int, or "unbounded"
    tis: bool
    label: str
    policy: str = "staleflow"  # coordinator.policy


SETTINGS = (
    Setting(name="eta0", eta=0, tis=True, label="η=0 (synchronous)"),
    Setting(name="eta1", eta=1, tis=True, label="η=1"),
    Setting(name="eta3", eta=3, tis=True, label="η=3"),
    Setting(name="eta10", eta=10, tis=True, label="η=10"),
    # no staleness control (UnboundedFifo): FIFO consumption, 2 batches in flight, greedy sync
    Setting(name="unbounded", eta="unbounded", tis=True, label="unbounded", policy="all-vanilla"),
    Setting(name="eta3-notis", eta=3, tis=False, label="η=3, no TIS"),
)
BY_NAME = {s.name: s for s in SETTINGS}


# ----------------------------------------------------------------------------- one run


def overrides(setting: Setting, seed: int, steps: int, run_dir: Path) -> list[str]:
    return [
        f"run_dir={run_dir}",
        f"trainer.steps={steps}",
        f"protocol.eta={setting.eta}",
        f"coordinator.policy={setting.policy}",
        f"trainer.use_tis={'true' if setting.tis else 'false'}",
        f"run.seed={seed}",
        "run.resume=never",
    ]


def staleflow_command() -> list[str]:
    """The ``staleflow`` console script of this interpreter's environment."""
    script = Path(sys.executable).with_name("staleflow")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "staleflow_trainer.cli"]


def run_train(
    setting: Setting, seed: int, steps: int, run_dir: Path, config: Path, timeout_s: float
) -> tuple[int, float, str]:
    """``staleflow train`` in a subprocess; (exit code, wall seconds, log path)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "train.log"
    for stale in ("metrics.jsonl", "summary.json"):
        (run_dir / stale).unlink(missing_ok=True)
    cmd = [*staleflow_command(), "train", str(config), *overrides(setting, seed, steps, run_dir)]
    t0 = time.monotonic()
    with log_path.open("w") as log:
        try:
            rc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                env={**os.environ, **ENV}, check=False,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.monotonic() - t0, str(log_path)


# ------------------------------------------------------------------------------ metrics


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def window(steps: int) -> int:
    """Steps averaged for reward_start / reward_end: the first / last tenth (at least 3)."""
    return max(3, steps // 10)


def staleness_hist(rows: Sequence[dict[str, Any]]) -> dict[int, int]:
    hist: dict[int, int] = {}
    for r in rows:
        for s, c in r["staleness_hist"].items():
            hist[int(s)] = hist.get(int(s), 0) + int(c)
    return dict(sorted(hist.items()))


def run_stats(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Reward and staleness numbers of one run's metrics.jsonl (rows in step order).

    ``reward_*`` are the mean reward of the *consumed* batches (what the trainer learned from,
    generated by possibly stale policies); ``reward_auc`` is the mean over all steps, i.e. the
    area under reward-vs-consumed-samples divided by the samples consumed."""
    rewards = [float(r["reward_mean"]) for r in rows]
    w = window(len(rows))
    hist = staleness_hist(rows)
    n = sum(hist.values())
    tokens = sum(int(r.get("tokens", 0)) for r in rows)
    loop_s = float(rows[-1]["time_s"]) if rows else 0.0
    return {
        "steps": len(rows),
        "reward_start": sum(rewards[:w]) / w,
        "reward_end": sum(rewards[-w:]) / w,
        "reward_auc": sum(rewards) / len(rewards),
        "max_staleness": max(hist),
        "mean_staleness": sum(s * c for s, c in hist.items()) / n,
        "tokens_per_s": tokens / loop_s if loop_s > 0 else 0.0,
        "staleness_hist": {str(k): v for k, v in hist.items()},
        "rewards": rewards,
        "samples_per_step": n // len(rows),
    }


def eval_prompts(task: str, tok: Any, max_prompt_len: int) -> tuple[list[Any], list[Any]]:
    """Every distinct prompt of a toy task, in prompt order: (records, encoded prompts) — the
    set both the study's and the recipe check's policy evaluations score."""
    from staleflow_trainer.data import encode_prompts, toy_records

    distinct = {r.prompt: r for r in toy_records(task, size=1000, seed=0)}
    records = [distinct[p] for p in sorted(distinct)]
    return records, encode_prompts(records, tok, max_prompt_len=max_prompt_len)


def policy_reward(run_dir: Path, *, final: bool, seed: int = 1234) -> float | None:
    """Expected toy reward of the initial (``final=False``) or the final trained policy,
    sampled at the rollout temperature with the plain-HF sampler: every distinct prompt of the
    run's toy task, ``EVAL_SAMPLES`` samples each. The consumed-batch reward cannot show this
    for stale settings (their batches come from old policies)."""
    import torch
    from transformers import AutoModelForCausalLM

    from staleflow_trainer.config import load_config
    from staleflow_trainer.data import toy_score
    from staleflow_trainer.tiny_model import EOS_ID, make_char_tokenizer
    from staleflow_trainer.trainer.checkpoint import load_torch
    from staleflow_trainer.trainer.local_rollout import sample_responses

    cfg = load_config(run_dir / "config.yaml", [])
    model = AutoModelForCausalLM.from_pretrained(str(run_dir / "model"), dtype=torch.float32)
    if final:
        latest = run_dir / "checkpoints" / "latest"
        if not latest.is_file():
            return None
        payload = load_torch(latest.parent / latest.read_text().strip() / "trainer.pt")
        model.load_state_dict(payload["model"], strict=False)
        model.tie_weights()
    tok = make_char_tokenizer()
    records, prompts = eval_prompts(cfg.data.toy_task, tok, cfg.data.max_prompt_len)
    gen = torch.Generator().manual_seed(seed)
    out = sample_responses(
        model,
        prompts,
        n=EVAL_SAMPLES,
        max_new_tokens=cfg.rollout.sampling.max_new_tokens,
        eos_id=EOS_ID,
        temperature=cfg.rollout.sampling.temperature,
        generator=gen,
    )
    scores = [
        toy_score(
            tok.decode(list(r.response_ids), skip_special_tokens=True),
            records[i // EVAL_SAMPLES].ground_truth,
        )
        for i, r in enumerate(out)
    ]
    return sum(scores) / len(scores)


def run_entry(
    setting: Setting, seed: int, run_dir: Path, *, wall_s: float | None, status: str, note: str = ""
) -> dict[str, Any]:
    """One summary.json entry. The fields the issue asks for come first; ``status`` is ok |
    failed | not_run; failed and not-run runs carry nulls."""
    entry: dict[str, Any] = {
        "setting": setting.name,
        "eta": setting.eta,
        "tis": setting.tis,
        "seed": seed,
        "reward_start": None,
        "reward_end": None,
        "reward_auc": None,
        "max_staleness": None,
        "mean_staleness": None,
        "tokens_per_s": None,
        "wall_s": None if wall_s is None else round(wall_s, 1),
        "status": status,
        "run_dir": str(run_dir),
    }
    if note:
        entry["note"] = note
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if status == "ok" and rows:
        stats = run_stats(rows)
        entry.update(stats)
        entry["policy_reward_start"] = policy_reward(run_dir, final=False)
        entry["policy_reward_end"] = policy_reward(run_dir, final=True)
        summary = run_dir / "summary.json"
        if summary.is_file():
            s = json.loads(summary.read_text())
            entry["counters"] = {
                k: s["counters"].get(k, 0) for k in ("syncs", "migrations", "interrupts", "aborts")
            }
            entry["ledger_problems"] = len(s.get("ledger", {}).get("problems", []))
    return entry


def finished_run_matches(run_dir: Path, setting: Setting, seed: int, steps: int) -> bool:
    """True when ``run_dir`` holds a finished run of exactly this request (for ``--reuse``)."""
    cfg_path, summary = run_dir / "config.yaml", run_dir / "summary.json"
    if not (cfg_path.is_file() and summary.is_file()):
        return False
    import yaml

    cfg = yaml.safe_load(cfg_path.read_text())
    done = json.loads(summary.read_text()).get("steps_done")
    return (
        done == steps
        and str(cfg["protocol"]["eta"]) == str(setting.eta)
        and bool(cfg["trainer"]["use_tis"]) == setting.tis
        and cfg["coordinator"]["policy"] == setting.policy
        and int(cfg["run"]["seed"]) == seed
    )


# -------------------------------------------------------------------------------- plots


def plot(entries: Sequence[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [e for e in entries if e["status"] == "ok"]
    names = [s.name for s in SETTINGS if any(e["setting"] == s.name for e in ok)]
    colors = dict(zip(names, plt.get_cmap("tab10").colors, strict=False))
    paths: list[Path] = []

    def smooth(y: np.ndarray, k: int) -> np.ndarray:
        if len(y) < k:
            return y
        pad = np.concatenate([np.full(k - 1, y[0]), y])
        return np.convolve(pad, np.ones(k) / k, mode="valid")

    # reward vs consumed samples: one panel per setting (seeds thin, mean bold) + overlay
    fig, axes = plt.subplots(2, 4, figsize=(18, 8), sharex=True, sharey=True)
    flat = list(axes.flat)
    overlay = flat[-1]
    for ax, name in zip(flat, names, strict=False):
        runs = [e for e in ok if e["setting"] == name]
        curves = []
        for e in runs:
            y = np.asarray(e["rewards"])
            x = np.arange(1, len(y) + 1) * e["samples_per_step"]
            ax.plot(x, y, lw=0.8, alpha=0.45, color=colors[name], label=f"seed {e['seed']}")
            curves.append(y)
        k = max(3, len(curves[0]) // 12)
        n = min(len(c) for c in curves)
        mean = np.mean([c[:n] for c in curves], axis=0)
        x = np.arange(1, n + 1) * runs[0]["samples_per_step"]
        ax.plot(x, smooth(mean, k), lw=2.2, color=colors[name], label=f"mean ({k}-step avg)")
        overlay.plot(x, smooth(mean, k), lw=2, color=colors[name], label=BY_NAME[name].label)
        ax.set_title(f"{BY_NAME[name].label}  ({len(runs)} seeds)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    overlay.set_title("all settings (seed mean, smoothed)")
    overlay.tick_params(labelleft=True)
    overlay.grid(alpha=0.3)
    overlay.legend(fontsize=7, loc="upper left")
    for ax in flat[len(names) : -1]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("consumed samples")
    for ax in axes[:, 0]:
        ax.set_ylabel("reward of consumed batch")
    fig.suptitle(
        "Reward vs consumed samples (staleflow train, 2 vLLM-CPU instances, toy copy task)"
    )
    fig.tight_layout()
    p = out / "reward_vs_samples.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    paths.append(p)

    # staleness histograms (all seeds of a setting together, fraction of consumed samples)
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    for ax, name in zip(axes.flat, names, strict=False):
        hist: dict[int, int] = {}
        for e in ok:
            if e["setting"] == name:
                for s, c in e["staleness_hist"].items():
                    hist[int(s)] = hist.get(int(s), 0) + c
        total = sum(hist.values())
        xs = sorted(hist)
        ax.bar(xs, [hist[s] / total for s in xs], color=colors[name], width=0.8)
        mean = sum(s * c for s, c in hist.items()) / total
        eta = BY_NAME[name].eta
        if isinstance(eta, int):
            ax.axvline(eta + 0.5, color="k", ls="--", lw=1, label=f"bound η={eta}")
            ax.legend(fontsize=8)
        ax.set_title(f"{BY_NAME[name].label}: mean {mean:.2f}, max {max(xs)}")
        top = max([*xs, eta if isinstance(eta, int) else 0])
        # integer ticks even when one staleness is all there is (MaxNLocator(integer=True)
        # falls back to fractions with fewer than two integers in view)
        ax.set_xticks(range(top + 1))
        ax.set_xlim(-0.7, top + 0.9)
        ax.set_xlabel("staleness of consumed sample (versions)")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3, axis="y")
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.tight_layout()
    p = out / "staleness_hist.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    paths.append(p)

    # final-policy reward (evaluated on every prompt) per setting and seed
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, name in enumerate(names):
        runs = [e for e in ok if e["setting"] == name and e.get("policy_reward_end") is not None]
        for j, e in enumerate(runs):
            ax.scatter(
                i + 0.08 * (j - (len(runs) - 1) / 2),
                e["policy_reward_end"],
                color=colors[name],
                zorder=3,
            )
            ax.scatter(
                i + 0.08 * (j - (len(runs) - 1) / 2),
                e["policy_reward_start"],
                color="grey",
                marker="x",
                zorder=3,
            )
        if runs:
            ax.hlines(
                np.mean([e["policy_reward_end"] for e in runs]),
                i - 0.3,
                i + 0.3,
                color=colors[name],
                lw=2,
            )
    ax.set_xticks(range(len(names)), [BY_NAME[n].label for n in names], fontsize=8)
    ax.set_ylabel("expected reward of the policy")
    ax.set_title("Final trained policy (dots; bar = seed mean) vs initial policy (x)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    p = out / "policy_reward.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    paths.append(p)
    return paths


def table(entries: Sequence[dict[str, Any]]) -> str:
    """A markdown table of every run (docs/convergence.md pastes it)."""

    def f(v: Any, p: int = 3) -> str:
        return "—" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))

    lines = [
        "| setting | seed | status | reward start → end | reward AUC | policy reward start → end"
        " | max / mean staleness | tokens/s | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        lines.append(
            f"| {BY_NAME[e['setting']].label} | {e['seed']} | {e['status']} "
            f"| {f(e['reward_start'])} → {f(e['reward_end'])} | {f(e['reward_auc'])} "
            f"| {f(e.get('policy_reward_start'))} → {f(e.get('policy_reward_end'))} "
            f"| {f(e['max_staleness'])} / {f(e['mean_staleness'], 2)} "
            f"| {f(e['tokens_per_s'], 0)} | {f(e['wall_s'], 0)} |"
        )
    return "\n".join(lines)


def setting_table(entries: Sequence[dict[str, Any]]) -> str:
    """Seed means per setting (finished runs only), in SETTINGS order."""

    def mean(xs: list[float], p: int = 3) -> str:
        return f"{sum(xs) / len(xs):.{p}f}" if xs else "—"

    lines = [
        "| setting | seeds | reward start → end | reward AUC | policy reward end"
        " | mean staleness | max staleness | tokens/s | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        ok = [e for e in entries if e["setting"] == s.name and e["status"] == "ok"]
        if not any(e["setting"] == s.name for e in entries):
            continue

        def col(k: str, ok: list[dict[str, Any]] = ok) -> list[float]:
            return [float(e[k]) for e in ok if e.get(k) is not None]

        lines.append(
            f"| {s.label} | {len(ok)} | {mean(col('reward_start'))} → {mean(col('reward_end'))} "
            f"| {mean(col('reward_auc'))} | {mean(col('policy_reward_end'))} "
            f"| {mean(col('mean_staleness'), 2)} | {max(map(int, col('max_staleness')), default='—')} "
            f"| {mean(col('tokens_per_s'), 0)} | {mean(col('wall_s'), 0)} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default=",".join(s.name for s in SETTINGS))
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "convergence")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--budget-s", type=float, default=60 * 60, help="start no run after this")
    ap.add_argument("--run-timeout-s", type=float, default=RUN_TIMEOUT_S)
    ap.add_argument("--reuse", action="store_true", help="keep finished matching runs")
    ap.add_argument("--plots-only", action="store_true", help="re-aggregate existing runs")
    args = ap.parse_args(argv)

    unknown = [n for n in args.settings.split(",") if n not in BY_NAME]
    if unknown:
        ap.error(f"--settings: unknown {unknown}; choose from {list(BY_NAME)}")
    settings = [BY_NAME[n] for n in args.settings.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    entries: list[dict[str, Any]] = []
    for seed in seeds:
        for setting in settings:
            run_dir = args.runs_dir / f"{setting.name}-seed{seed}"
            tag = f"{setting.name} seed {seed}"
            if args.plots_only or (
                args.reuse and finished_run_matches(run_dir, setting, seed, args.steps)
            ):
                done = finished_run_matches(run_dir, setting, seed, args.steps)
                wall = None
                if done:
                    wall = json.loads((run_dir / "summary.json").read_text()).get("study_wall_s")
                entries.append(
                    run_entry(
                        setting, seed, run_dir, wall_s=wall, status="ok" if done else "not_run"
                    )
                )
                print(f"[reuse] {tag}: {entries[-1]['status']}", flush=True)
                continue
            if time.monotonic() - t0 > args.budget_s:
                entries.append(
                    run_entry(
                        setting,
                        seed,
                        run_dir,
                        wall_s=None,
                        status="not_run",
                        note=f"study budget of {args.budget_s:.0f} s spent",
                    )
                )
                print(f"[skip ] {tag}: budget spent", flush=True)
                continue
            print(f"[run  ] {tag} ...", flush=True)
            rc, wall, log = run_train(
                setting, seed, args.steps, run_dir, args.config, args.run_timeout_s
            )
            ok = rc == 0 and (run_dir / "summary.json").is_file()
            if ok:  # remember the subprocess wall time beside the run's own summary
                s = json.loads((run_dir / "summary.json").read_text())
                s["study_wall_s"] = wall
                (run_dir / "summary.json").write_text(json.dumps(s, indent=1))
            note = "" if ok else f"staleflow train exited {rc}; see {log}"
            entries.append(
                run_entry(
                    setting, seed, run_dir, wall_s=wall, status="ok" if ok else "failed", note=note
                )
            )
            e = entries[-1]
            print(
                f"[done ] {tag}: status={e['status']} wall={wall:.0f}s "
                f"reward {e['reward_start']} -> {e['reward_end']} "
                f"policy {e.get('policy_reward_start')} -> {e.get('policy_reward_end')} "
                f"staleness max={e['max_staleness']} mean={e['mean_staleness']}",
                flush=True,
            )
            write(entries, args.out)  # after every run: a cut-short study keeps what ran
    write(entries, args.out)
    print(setting_table(entries))
    print(table(entries))
    print(f"study wall time: {time.monotonic() - t0:.0f} s")
    return 0 if all(e["status"] == "ok" for e in entries) else 1


def write(entries: Sequence[dict[str, Any]], out: Path) -> None:
    slim = [{k: v for k, v in e.items() if k != "rewards"} for e in entries]
    curves = {f"{e['setting']}-seed{e['seed']}": e["rewards"] for e in entries if "rewards" in e}
    (out / "summary.json").write_text(json.dumps(slim, indent=1) + "\n")
    (out / "reward_curves.json").write_text(json.dumps(curves) + "\n")
    if any(e["status"] == "ok" for e in entries):
        plot(entries, out)
    (out / "table.md").write_text(setting_table(entries) + "\n\n" + table(entries) + "\n")


if __name__ == "__main__":
    sys.exit(main())
