"""``staleflow compare``: every policy on the identical workload and GPU budget, side by side.

Runs ``staleflow``, its ablations (``vanilla-routing``, ``vanilla-sync``, ``vanilla-migration``,
``all-vanilla``), ``coarse-async`` and ``coarse-async-drop`` at each η of :data:`ETAS`, plus ``sync`` (η = 0,
colocated on every GPU) and ``one-step`` (η = 1) once each. Same seed, same length stream,
same cost model; the disaggregated policies split the budget into ``rollout.num_instances`` x
``sim.gpus_per_instance`` rollout GPUs and ``sim.train_gpus``. Runs go to a process pool (one
per core).

Measurement protocol: every (policy, η) runs once per seed (default: ``run.seed`` and the next
one); throughput counts only the steps after ``sim.warmup_steps`` (the pipeline fill), and a
comparison reports the mean and the min–max spread over the seeds of tokens/s and samples/s.
:data:`MIN_MEASURED_STEPS` measured steps and :data:`MIN_SEEDS` seeds make a steady-state
measurement; a comparison below that says so in its table (``protocol.steady_state`` false).
Writes into ``run.run_dir``:

* ``compare.json`` — ``ideal_tokens_per_s`` (the split's roofline limit) and ``bounds`` (the
  latency-aware bound per η and the side that binds; both in
  :mod:`staleflow_trainer.sim.ideal`), ``protocol``, ``summary`` (per policy and η: mean, min
  and max over the seeds of tokens_per_s and samples_per_s, frac_of_ideal, frac_of_bound),
  ``results`` (one row per run: seed, run (its directory), policy, eta, tokens_per_s, mean_step_s,
  trainer_idle_frac, rollout_busy_frac — generated tokens over the instances' best rate —,
  samples_per_s and tokens_per_sample — what was trained, so a policy that drops the long
  tail shows its shorter samples —,
  rollout_active_frac — share of instance-time with any work —, prefill_frac — share of
  instance-time spent prefilling (prompts, and contexts again after an interrupt, a
  preemption or a sync) — and preemptions, max_staleness, ...),
  ``ratios`` (staleflow's mean tokens/s over every
  other policy's, per η), ``ratio_spread`` (min and max of the per-seed ratios), ``split``
  (the train/rollout split and the ideal's two sides);
* ``results/compare.md`` (the table) and ``results/*.png`` (throughput bars, staleness
  histograms, per-instance timelines);
* ``runs/<policy>-eta<η>-seed<s>/`` — each run's metrics, timeline and summary.

A policy that makes another's every decision with the same settings (``coarse-async`` and
``all-vanilla``: :func:`decision_twins`) is not run twice: its rows repeat the other's runs,
with ``same_as`` naming that policy, ``run`` its run directory and ``wall_s`` 0.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import attrs
import structlog

from rollout_coordinator.policies import build_policy
from staleflow_trainer.atomic_files import make_run_dir
from staleflow_trainer.config import FIXED_ETA, POLICIES, AppConfig, dump_config
from staleflow_trainer.errors import ConfigError
from staleflow_trainer.sim.ideal import ideal_throughput, latency_bound
from staleflow_trainer.sim.spec import spec_from_app_config, with_policy

_log = structlog.get_logger("staleflow.compare")

ETAS = (1, 2, 3)
#: A steady-state measurement: at least this many steps after the warm-up ...
MIN_MEASURED_STEPS = 30
#: ... on at least this many seeds.
MIN_SEEDS = 2
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


def decision_twins(runs: list[AppConfig]) -> dict[int, int]:
    """Run index → the index of a run that makes its every decision: a policy's
    ``same_decisions_as`` (``coarse-async``: ``all-vanilla``), planned too with a config that
    differs in the policy's name alone (a baseline runs without batch redundancy and stuck-buffer
    resolution, so a config that sets either keeps both runs). A comparison runs the twin once
    and reports its summary for both."""
    index = {c: i for i, c in enumerate(runs)}
    out: dict[int, int] = {}
    for i, c in enumerate(runs):
        twin = build_policy(c.coordinator.policy).same_decisions_as
        if twin is None:
            continue
        try:
            j = index.get(c.evolve(f"coordinator.policy={twin}"))
        except ConfigError:  # the twin refuses a setting this run keeps: not the same config
            continue
        if j is not None:
            out[i] = j
    return out


def run_name(cfg: AppConfig) -> str:
    return f"{cfg.coordinator.policy}-eta{cfg.protocol.eta}-seed{cfg.run.seed}"


def default_seeds(cfg: AppConfig) -> tuple[int, ...]:
    """The config's seed and the next one (:data:`MIN_SEEDS`)."""
    return tuple(cfg.run.seed + i for i in range(MIN_SEEDS))


def _run_one(args: tuple[AppConfig, str]) -> dict[str, Any]:
    """One simulated run, logging warnings and errors only; the process's logging is as it
    was afterwards (runs in this process must not change what its caller logs)."""
    import logging

    from staleflow_trainer.cli import logging_restored
    from staleflow_trainer.simulate import run_and_write

    with logging_restored():
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
        cfg, run_dir = args
        return run_and_write(cfg, Path(run_dir), plots=False)


def run_specs(
    jobs: list[tuple[AppConfig, Path]],
    *,
    workers: int | None = None,
    on_done: Callable[[int, dict[str, Any]], None] | None = None,
    label: Callable[[Path], str] | None = None,
) -> list[dict[str, Any]]:
    """Simulate every ``(config, run_dir)`` (one process per core unless ``workers`` says
    otherwise); returns their summaries in job order. Shared by compare and plan (and the
    sweeps, through :func:`run_comparison`). The finished runs are shown as the first
    job's ``metrics`` section says (:class:`~staleflow_trainer.report.progress.JobProgress`: a bar
    with ``progress_bar`` on a terminal, else a line per run unless ``log_every`` is 0);
    ``on_done(index, summary)`` hears each run as it finishes; ``label(run_dir)`` names a
    finished run (default: its directory's name)."""
    from staleflow_trainer.report.progress import JobProgress

    args = [(s, str(d)) for s, d in jobs]
    n = workers if workers is not None else min(len(args), os.cpu_count() or 1)
    out: list[dict[str, Any] | None] = [None] * len(args)
    m = jobs[0][0].metrics if jobs else None
    show = JobProgress(
        len(args),
        bar=m is not None and m.progress_bar,
        lines=m is not None and m.log_every > 0,
    )
    with show as bar:

        def finished(i: int, summary: dict[str, Any]) -> None:
            out[i] = summary
            run_dir = Path(args[i][1])
            bar.done(label(run_dir) if label is not None else run_dir.name)
            if on_done is not None:
                on_done(i, summary)

        if n <= 1:
            for i, a in enumerate(args):
                finished(i, _run_one(a))
        else:
            with ProcessPoolExecutor(max_workers=n) as pool:
                futures = {pool.submit(_run_one, a): i for i, a in enumerate(args)}
                for f in as_completed(futures):
                    finished(futures[f], f.result())
    return [s for s in out if s is not None]


@attrs.frozen
class ComparisonPlan:
    """The runs of one comparison: every (policy, η, seed) of ``base`` (``runs``), the ones a
    decision twin makes (``twins``: run index → its twin's) and the simulations to run
    (:meth:`jobs`, one per run that is no other's twin)."""

    base: AppConfig
    out_dir: Path
    seeds: tuple[int, ...]
    runs: list[AppConfig]
    twins: dict[int, int]

    @property
    def own(self) -> list[int]:
        return [i for i in range(len(self.runs)) if i not in self.twins]

    def jobs(self) -> list[tuple[AppConfig, Path]]:
        return [(self.runs[i], self.out_dir / "runs" / run_name(self.runs[i])) for i in self.own]


def plan_comparison(
    base: AppConfig,
    out_dir: Path,
    *,
    policies: list[str] | None = None,
    etas: tuple[int, ...] = ETAS,
    seeds: tuple[int, ...] | None = None,
) -> ComparisonPlan:
    """The runs :func:`run_comparison` makes (``seeds``: None is :func:`default_seeds`)."""
    seeds = default_seeds(base) if seeds is None else seeds
    if not seeds:
        raise ConfigError("compare needs at least one seed", key="--seeds", allowed="1 or more")
    runs = [c for seed in seeds for c in plan_runs(base.evolve(f"run.seed={seed}"), policies, etas)]
    return ComparisonPlan(base, out_dir, tuple(seeds), runs, decision_twins(runs))


def run_comparison(
    base: AppConfig,
    out_dir: Path,
    *,
    policies: list[str] | None = None,
    etas: tuple[int, ...] = ETAS,
    seeds: tuple[int, ...] | None = None,
    workers: int | None = None,
    plots: bool = True,
) -> dict[str, Any]:
    """Run every (policy, η, seed) of ``base`` and write compare.json, the table and the
    plots (``seeds``: None is :func:`default_seeds`)."""
    plan = plan_comparison(base, out_dir, policies=policies, etas=etas, seeds=seeds)
    return comparison_report(plan, run_specs(plan.jobs(), workers=workers), plots=plots)


def comparison_report(
    plan: ComparisonPlan, ran: list[dict[str, Any]], *, plots: bool = True
) -> dict[str, Any]:
    """Write compare.json, the table and the plots of ``plan`` from the summaries of its
    :meth:`~ComparisonPlan.jobs`, in their order (``ran``); returns the report."""
    base, out_dir, seeds, runs, twins = plan.base, plan.out_dir, plan.seeds, plan.runs, plan.twins
    by_index = dict(zip(plan.own, ran, strict=True))
    summaries = [by_index[twins.get(i, i)] for i in range(len(runs))]
    spec = spec_from_app_config(base)
    disagg = spec if not spec.colocated else attrs.evolve(spec, policy="staleflow")
    ideal = ideal_throughput(disagg)
    bounds = _bounds(base, sorted({e for c in runs if isinstance(e := c.protocol.eta, int)}))
    results = []
    for i, (c, s) in enumerate(zip(runs, summaries, strict=True)):
        row = {"seed": c.run.seed, "run": run_name(c), **{k: s[k] for k in RESULT_KEYS}}
        row.update(
            frac_of_ideal=s["tokens_per_s"] / ideal["ideal_tokens_per_s"],
            mean_staleness=s["mean_staleness"],
            samples_per_s=s["samples_per_s"],
            tokens_per_sample=s["tokens_per_sample"],
            rollout_active_frac=s["rollout_active_frac"],
            prefill_frac=s["prefill_frac"],
            preemptions=s["preemptions"],
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
            measured_steps=s["steps"] - s["warmup_steps"],
            wall_s=round(s["wall_s"], 2),
        )
        if i in twins:  # its decision twin's run
            twin = runs[twins[i]]
            row.update(
                policy=c.coordinator.policy,
                same_as=twin.coordinator.policy,
                run=run_name(twin),
                wall_s=0.0,
            )
        results.append(row)
    measured = min((r["measured_steps"] for r in results), default=0)
    summary = summarize(results, bounds)
    report = {
        "ideal_tokens_per_s": ideal["ideal_tokens_per_s"],
        "bounds": bounds,
        "protocol": {
            "seeds": list(seeds),
            "measured_steps": measured,
            "warmup_steps": spec.warmup_steps,
            "steady_state": measured >= MIN_MEASURED_STEPS and len(seeds) >= MIN_SEEDS,
            "short_of": [
                *(
                    [f"{measured} measured steps < {MIN_MEASURED_STEPS}"]
                    if measured < MIN_MEASURED_STEPS
                    else []
                ),
                *([f"{len(seeds)} seed(s) < {MIN_SEEDS}"] if len(seeds) < MIN_SEEDS else []),
            ],
        },
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
        "summary": summary,
        "results": results,
        "ratios": ratios(summary),
        "ratio_spread": ratio_spread(results),
    }
    write_report(out_dir, "compare", report, markdown_table(report))
    if plots:
        from staleflow_trainer.report.compare_plots import write_plots

        write_plots(report, out_dir)
    return report


def _bounds(base: AppConfig, etas: list[int]) -> dict[str, dict[str, Any]]:
    """The latency-aware bound per η: η = 0 on every GPU colocated (``sync``), the others on
    the disaggregated split."""
    out: dict[str, dict[str, Any]] = {}
    for eta in etas:
        cfg = with_policy(base, "sync") if eta == 0 else with_policy(base, "staleflow", eta)
        out[f"eta={eta}"] = latency_bound(spec_from_app_config(cfg), eta)
    return out


def _stats(xs: list[float]) -> dict[str, float]:
    return {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs)}


def summarize(
    results: list[dict[str, Any]], bounds: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """One row per (policy, η): mean and spread over the seeds (tokens/s, samples/s) and the
    means of the other columns."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["policy"], r["eta"]), []).append(r)
    out = []
    for (policy, eta), rows in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        tps = _stats([r["tokens_per_s"] for r in rows])
        bound = bounds.get(f"eta={eta}", {}).get("latency_bound_tokens_per_s", 0.0)
        row: dict[str, Any] = {
            "policy": policy,
            "eta": eta,
            "seeds": len(rows),
            "tokens_per_s": tps,
            "samples_per_s": _stats([r["samples_per_s"] for r in rows]),
            "frac_of_bound": tps["mean"] / bound if bound > 0 else None,
        }
        for k in _MEAN_KEYS:
            row[k] = sum(float(r[k]) for r in rows) / len(rows)
        row["max_staleness"] = max(r["max_staleness"] for r in rows)
        out.append(row)
    return out


_MEAN_KEYS = (
    "frac_of_ideal",
    "mean_step_s",
    "trainer_idle_frac",
    "rollout_busy_frac",
    "rollout_active_frac",
    "prefill_frac",
    "tokens_wasted",
    "tokens_per_sample",
)


def write_report(out_dir: Path, name: str, report: dict[str, Any], table: str) -> Path:
    """``out_dir/<name>.json`` and ``out_dir/results/<name>.md``; returns the results dir
    (where the plots go). Shared by compare and plan."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    res_dir = out_dir / "results"
    res_dir.mkdir(exist_ok=True)
    (res_dir / f"{name}.md").write_text(table)
    return res_dir


def ratios(summary: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """staleflow's mean tokens/s over every other policy's, per η (sync/one-step: their one
    η)."""
    return {
        f"eta={sf['eta']}": {
            r["policy"]: sf["tokens_per_s"]["mean"] / r["tokens_per_s"]["mean"]
            for r in _rivals(summary, sf["eta"])
            if r["tokens_per_s"]["mean"] > 0
        }
        for sf in summary
        if sf["policy"] == "staleflow"
    }


def _rivals(rows: list[dict[str, Any]], eta: int) -> list[dict[str, Any]]:
    return [
        r
        for r in rows
        if r["policy"] != "staleflow" and (r["policy"] in FIXED_ETA or r["eta"] == eta)
    ]


def ratio_spread(results: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Min and max over the seeds of staleflow's per-seed ratio to every other policy."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for sf in (r for r in results if r["policy"] == "staleflow"):
        same_seed = [r for r in results if r["seed"] == sf["seed"]]
        row = out.setdefault(f"eta={sf['eta']}", {})
        for r in _rivals(same_seed, sf["eta"]):
            if r["tokens_per_s"] <= 0:
                continue
            x = sf["tokens_per_s"] / r["tokens_per_s"]
            old = row.get(r["policy"])
            row[r["policy"]] = (
                {"min": x, "max": x}
                if old is None
                else {"min": min(old["min"], x), "max": max(old["max"], x)}
            )
    return out


def markdown_table(report: dict[str, Any]) -> str:
    sp, pr = report["split"], report["protocol"]
    bound_s = "; ".join(
        f"η={k.split('=')[1]}: {b['latency_bound_tokens_per_s']:.0f} ({b['latency_bound_side']})"
        for k, b in report["bounds"].items()
    )
    lines = [
        f"Split: {sp['rollout_gpus']} rollout + {sp['train_gpus']} training GPUs of "
        f"{sp['total_gpus']} (sync: all {sp['total_gpus']} colocated). Roofline ideal "
        f"{report['ideal_tokens_per_s']:.0f} tokens/s ({sp['bound']}-bound: rollout side "
        f"{sp['rollout_side_tokens_per_s']:.0f}, training side {sp['train_side_tokens_per_s']:.0f}; "
        f"train step {sp['train_step_s']:.1f} s + push {sp['push_s']:.1f} s).",
        f"Latency-aware bound, tokens/s (the side that binds): {bound_s}.",
        f"Seeds {', '.join(str(x) for x in pr['seeds'])}; {pr['measured_steps']} measured steps "
        f"after {pr['warmup_steps']} warm-up; mean (min–max) over the seeds."
        + (
            ""
            if pr["steady_state"]
            else f" NOT a steady-state measurement (needs >= {MIN_MEASURED_STEPS} measured "
            f"steps and >= {MIN_SEEDS} seeds)."
        ),
        "",
        "| policy | η | tokens/s | samples/s | % of ideal | % of bound | mean step (s) "
        "| trainer idle | rollout util | prefill | wasted tokens | tokens/sample | max staleness "
        "| staleflow ÷ this |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rat, spread = report["ratios"], report["ratio_spread"]

    def ratio_cell(eta: int, policy: str) -> str:
        x = rat.get(f"eta={eta}", {}).get(policy)
        if x is None:
            return "—"
        sp_ = spread.get(f"eta={eta}", {}).get(policy)
        rng = f" ({sp_['min']:.2f}–{sp_['max']:.2f})" if sp_ and sp_["min"] != sp_["max"] else ""
        return f"{x:.2f}×{rng}"

    for r in report["summary"]:
        if r["policy"] in FIXED_ETA:
            ratio_s = ", ".join(
                f"η={k.split('=')[1]}: {ratio_cell(int(k.split('=')[1]), r['policy'])}"
                for k, v in rat.items()
                if r["policy"] in v
            )
        else:
            ratio_s = ratio_cell(r["eta"], r["policy"])
        t, sps = r["tokens_per_s"], r["samples_per_s"]
        fb = "—" if r["frac_of_bound"] is None else f"{100 * r['frac_of_bound']:.0f}%"
        lines.append(
            f"| {r['policy']} | {r['eta']} | {t['mean']:.0f} ({t['min']:.0f}–{t['max']:.0f}) | "
            f"{sps['mean']:.2f} ({sps['min']:.2f}–{sps['max']:.2f}) | "
            f"{100 * r['frac_of_ideal']:.0f}% | {fb} | {r['mean_step_s']:.1f} | "
            f"{100 * r['trainer_idle_frac']:.0f}% | {100 * r['rollout_busy_frac']:.0f}% | "
            f"{100 * r['prefill_frac']:.1f}% | {r['tokens_wasted'] / 1e6:.1f}M | "
            f"{r['tokens_per_sample']:.0f} | "
            f"{r['max_staleness']} | {ratio_s} |"
        )
    twins = sorted({(r["policy"], r["same_as"]) for r in report["results"] if "same_as" in r})
    for policy, twin in twins:
        lines += [
            "",
            f"{policy}: {twin}'s runs, reported for it. With these settings it makes every "
            f'decision {twin} makes (docs/throughput.md, "Policies that decide alike"), so '
            "it is not run twice.",
        ]
    if any((r["frac_of_bound"] or 0.0) > 1.0 for r in report["summary"]):
        lines += [
            "",
            "Above 100 % of the bound: the latency-aware bound assumes every step takes the "
            "same time; a run whose steps vary (the rare long responses given longer steps) "
            "can exceed it.",
        ]
    return "\n".join(lines) + "\n"


def compare_main(
    cfg: AppConfig, policies: list[str] | None = None, seeds: tuple[int, ...] | None = None
) -> int:
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
    report = run_comparison(cfg, out, policies=policies, seeds=seeds)
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
