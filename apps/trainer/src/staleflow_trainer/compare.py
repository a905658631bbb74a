"""``staleflow compare``: every policy on the identical workload and GPU budget, side by side.

Runs ``staleflow``, its ablations (``vanilla-routing``, ``vanilla-sync``, ``vanilla-migration``,
``all-vanilla``), ``coarse-async`` and ``coarse-async-drop`` at each η of :data:`ETAS`, plus ``sync`` (η = 0,
colocated on every GPU) and ``one-step`` (η = 1) once each. Same seed, same length stream,
same cost model; the disaggregated policies split the budget per ``sim.rollout_gpus`` /
``sim.train_gpus``. Runs go to a process pool (one per core). Writes into ``run.run_dir``:

* ``compare.json`` — ``ideal_tokens_per_s`` (the split's physical limit, see
  :mod:`staleflow_trainer.sim.ideal`), ``results`` (policy, eta, tokens_per_s, mean_step_s,
  trainer_idle_frac, rollout_busy_frac — generated tokens over the instances' best rate —,
  samples_per_s and tokens_per_sample — what was trained, so a policy that drops the long
  tail shows its shorter samples —,
  rollout_active_frac — share of instance-time with any work —, max_staleness, ...),
  ``ratios`` (staleflow over every
  other policy, per η), ``split`` (the train/rollout split and the ideal's two sides);
* ``results/compare.md`` (the table) and ``results/*.png`` (throughput bars, staleness
  histograms, per-instance timelines);
* ``runs/<policy>-eta<η>/`` — each run's metrics, timeline and summary.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import structlog

from staleflow_trainer.atomic_files import make_run_dir
from staleflow_trainer.config import FIXED_ETA, POLICIES, AppConfig, dump_config
from staleflow_trainer.errors import ConfigError
from staleflow_trainer.sim.ideal import ideal_throughput
from staleflow_trainer.sim.spec import spec_from_app_config, with_policy

_log = structlog.get_logger("staleflow.compare")

ETAS = (1, 2, 3)
RESULT_KEYS = (
    "policy",
    "eta",
    "tokens_per_s",
    "mean_step_s",
    "trainer_idle_frac",
    "rollout_busy_frac",
    "max_staleness",
)


def plan_runs(
    base: AppConfig, policies: list[str] | None, etas: tuple[int, ...]
) -> list[AppConfig]:
    chosen = policies if policies else list(POLICIES)
    unknown = [p for p in chosen if p not in POLICIES]
    if unknown:
        raise ConfigError(
            f"unknown policy {unknown[0]!r} for compare",
            key="--policies",
            allowed=", ".join(POLICIES),
        )
    out: list[AppConfig] = []
    for p in chosen:
        if p in FIXED_ETA:
            out.append(with_policy(base, p))
        else:
            out.extend(with_policy(base, p, eta) for eta in etas)
    return out


def run_name(cfg: AppConfig) -> str:
    return f"{cfg.coordinator.policy}-eta{cfg.protocol.eta}"


def _run_one(args: tuple[AppConfig, str]) -> dict[str, Any]:
    import logging

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from staleflow_trainer.simulate import run_and_write

    cfg, run_dir = args
    return run_and_write(cfg, Path(run_dir), plots=False)


def run_specs(
    jobs: list[tuple[AppConfig, Path]], *, workers: int | None = None
) -> list[dict[str, Any]]:
    """Simulate every ``(config, run_dir)`` (one process per core unless ``workers`` says
    otherwise); returns their summaries in job order. Shared by compare and plan."""
    args = [(s, str(d)) for s, d in jobs]
    n = workers if workers is not None else min(len(args), os.cpu_count() or 1)
    if n <= 1:
        return [_run_one(a) for a in args]
    with ProcessPoolExecutor(max_workers=n) as pool:
        return list(pool.map(_run_one, args))


def run_comparison(
    base: AppConfig,
    out_dir: Path,
    *,
    policies: list[str] | None = None,
    etas: tuple[int, ...] = ETAS,
    workers: int | None = None,
    plots: bool = True,
) -> dict[str, Any]:
    """Run every (policy, η) of ``base`` and write compare.json, the table and the plots."""
    runs = plan_runs(base, policies, etas)
    summaries = run_specs([(c, out_dir / "runs" / run_name(c)) for c in runs], workers=workers)
    spec = spec_from_app_config(base)
    disagg = spec if spec.policy != "sync" else attrs.evolve(spec, policy="staleflow")
    ideal = ideal_throughput(disagg)
    results = []
    for s in summaries:
        row = {k: s[k] for k in RESULT_KEYS}
        row.update(
            frac_of_ideal=s["tokens_per_s"] / ideal["ideal_tokens_per_s"],
            mean_staleness=s["mean_staleness"],
            samples_per_s=s["samples_per_s"],
            tokens_per_sample=s["tokens_per_sample"],
            rollout_active_frac=s["rollout_active_frac"],
            stuck_resolved=s["stuck_resolved"],
            staleness_hist=s["staleness_hist"],
            syncs=s["syncs"],
            migrations=s["migrations"],
            interrupts=s["interrupts"],
            aborts=s["aborts"],
            tokens_wasted=s["tokens_wasted"],
            rollout_gpus=s["rollout_gpus"],
            train_gpus=s["train_gpus"],
            steps=s["steps"],
            wall_s=round(s["wall_s"], 2),
        )
        results.append(row)
    report = {
        "ideal_tokens_per_s": ideal["ideal_tokens_per_s"],
        "split": {
            "total_gpus": spec.total_gpus,
            "rollout_gpus": spec.rollout_gpus,
            "train_gpus": spec.train_gpus,
            "rollout_side_tokens_per_s": ideal["rollout_side_tokens_per_s"],
            "train_side_tokens_per_s": ideal["train_side_tokens_per_s"],
            "bound": ideal["bound"],
            "train_step_s": ideal["train_step_s"],
            "push_s": ideal["push_s"],
            "batch_tokens": ideal["batch_tokens"],
            "frac_at_cap": ideal["frac_at_cap"],
        },
        "results": results,
        "ratios": ratios(results),
    }
    write_report(out_dir, "compare", report, markdown_table(report))
    if plots:
        from staleflow_trainer.compare_plots import write_plots

        write_plots(report, out_dir)
    return report


def write_report(out_dir: Path, name: str, report: dict[str, Any], table: str) -> Path:
    """``out_dir/<name>.json`` and ``out_dir/results/<name>.md``; returns the results dir
    (where the plots go). Shared by compare and plan."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    res_dir = out_dir / "results"
    res_dir.mkdir(exist_ok=True)
    (res_dir / f"{name}.md").write_text(table)
    return res_dir


def ratios(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """staleflow's tokens/s over every other policy, per η (sync/one-step: their single run)."""
    fixed = {r["policy"]: r for r in results if r["policy"] in FIXED_ETA}
    out: dict[str, dict[str, float]] = {}
    for sf in (r for r in results if r["policy"] == "staleflow"):
        eta = sf["eta"]
        row: dict[str, float] = {}
        for r in results:
            if r["policy"] == "staleflow" or (r["policy"] not in FIXED_ETA and r["eta"] != eta):
                continue
            if r["policy"] in FIXED_ETA and fixed[r["policy"]] is not r:
                continue
            if r["tokens_per_s"] > 0:
                row[r["policy"]] = sf["tokens_per_s"] / r["tokens_per_s"]
        out[f"eta={eta}"] = row
    return out


def markdown_table(report: dict[str, Any]) -> str:
    sp = report["split"]
    lines = [
        f"Split: {sp['rollout_gpus']} rollout + {sp['train_gpus']} training GPUs of "
        f"{sp['total_gpus']} (sync: all {sp['total_gpus']} colocated). Ideal "
        f"{report['ideal_tokens_per_s']:.0f} tokens/s ({sp['bound']}-bound: rollout side "
        f"{sp['rollout_side_tokens_per_s']:.0f}, training side {sp['train_side_tokens_per_s']:.0f}; "
        f"train step {sp['train_step_s']:.1f} s + push {sp['push_s']:.1f} s).",
        "",
        "| policy | η | tokens/s | % of ideal | mean step (s) | trainer idle | rollout util "
        "| rollout active | wasted tokens | tokens/sample | max staleness | staleflow ÷ this |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rat = report["ratios"]
    for r in sorted(report["results"], key=lambda r: (r["eta"], r["policy"])):
        ratio = rat.get(f"eta={r['eta']}", {}).get(r["policy"])
        if r["policy"] in FIXED_ETA:
            ratio_s = ", ".join(
                f"η={k.split('=')[1]}: {v[r['policy']]:.2f}×"
                for k, v in rat.items()
                if r["policy"] in v
            )
        else:
            ratio_s = "—" if ratio is None else f"{ratio:.2f}×"
        lines.append(
            f"| {r['policy']} | {r['eta']} | {r['tokens_per_s']:.0f} | "
            f"{100 * r['frac_of_ideal']:.0f}% | {r['mean_step_s']:.1f} | "
            f"{100 * r['trainer_idle_frac']:.0f}% | {100 * r['rollout_busy_frac']:.0f}% | "
            f"{100 * r['rollout_active_frac']:.0f}% | {r['tokens_wasted'] / 1e6:.1f}M | "
            f"{r['tokens_per_sample']:.0f} | {r['max_staleness']} | {ratio_s} |"
        )
    return "\n".join(lines) + "\n"


def compare_main(cfg: AppConfig, policies: list[str] | None = None) -> int:
    """The CLI command: config → base spec → comparison; prints the split and the table."""
    base = spec_from_app_config(cfg)
    if policies:
        unknown = [p for p in policies if p not in POLICIES]
        if unknown:  # before anything is written
            raise ConfigError(
                f"unknown policy {unknown[0]!r} for compare",
                key="--policies",
                allowed=", ".join(POLICIES),
            )
    out = make_run_dir(cfg.run.run_dir)
    dump_config(cfg, out / "config.yaml")
    report = run_comparison(cfg, out, policies=policies)
    sp = report["split"]
    print(
        f"train/rollout split: {sp['rollout_gpus']} rollout GPUs "
        f"({base.rollout_gpus // base.gpus_per_instance} instances) + {sp['train_gpus']} "
        f"training GPUs; sync colocated on {base.total_gpus}. Train step "
        f"{sp['train_step_s']:.1f} s + push {sp['push_s']:.1f} s per "
        f"{sp['batch_tokens']:.0f}-token batch"
    )
    print(markdown_table(report), end="")
    print(f"written: {out / 'compare.json'}, {out / 'results'}")
    return 0
