"""``staleflow plan``: capacity planning — which rollout / training split of the GPU budget and
which staleness bound η give the most throughput for a workload.

    staleflow plan examples/sim-paper-30b-a3b.yaml run_dir=runs/plan trainer.steps=8
    staleflow plan CONFIG --fractions 0.25,0.5,0.75 --etas 1,2,3 --policy staleflow

The search is a grid: every rollout fraction of ``sim.total_gpus`` (rounded to whole rollout
instances of ``sim.gpus_per_instance`` GPUs; the rest train) × every η, each simulated with the
same code path as ``staleflow compare`` (:func:`staleflow_trainer.report.compare.run_specs`, one
process per core) on the identical workload. For every point it reports tokens/s, the split's
own ideal (:mod:`staleflow_trainer.sim.ideal`) and the budget's ideal (the best ideal of any
whole-instance split), trainer idle, rollout utilisation and the consumed staleness.

Selection (:func:`select`): ``fastest`` is the point with the most tokens/s among those whose
max consumed staleness stayed ≤ η; ``recommended`` is the smallest η whose best point is
within ``tolerance`` (default 5 %, about the noise of a short run) of the fastest — staleness
costs convergence, so it is only worth buying when it buys throughput.

Writes into ``run.run_dir``: ``plan.json`` (``grid``, ``budget_ideal``, ``results``,
``fastest``, ``recommended``), ``results/plan.md`` (the table), ``results/plan.png``
(tokens/s vs rollout GPUs, one line per η) and ``runs/<policy>-r<R>-t<T>-eta<η>/`` per point.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import attrs
import structlog

from staleflow_trainer.atomic_files import make_run_dir
from staleflow_trainer.config import FIXED_ETA, POLICIES, AppConfig, dump_config
from staleflow_trainer.config_sim import colocated
from staleflow_trainer.errors import ConfigError
from staleflow_trainer.report.compare import run_specs, write_report
from staleflow_trainer.sim.ideal import ideal_throughput, workload_moments
from staleflow_trainer.sim.spec import SimSpec, spec_from_app_config, with_policy

_log = structlog.get_logger("staleflow.plan")

DEFAULT_FRACTIONS = (0.25, 0.375, 0.5, 0.625, 0.75)
DEFAULT_ETAS = (1, 2, 3)
DEFAULT_TOLERANCE = 0.05
#: Policies a split search makes sense for (``sync`` is colocated: it has no split).
PLANNABLE = tuple(p for p in POLICIES if not colocated(p))


@attrs.frozen(kw_only=True)
class PlanGrid:
    """What ``staleflow plan`` searches. Build it with :func:`parse_grid` (validated)."""

    policy: str
    fractions: tuple[float, ...]
    etas: tuple[int, ...]
    tolerance: float


@attrs.frozen(kw_only=True)
class Split:
    """One rollout / training split of the budget (``fractions``: the requested fractions
    that round to it)."""

    rollout_gpus: int
    train_gpus: int
    fractions: tuple[float, ...]


def _numbers(text: str, key: str, allowed: str, kind: type) -> list[Any]:
    out: list[Any] = []
    for part in text.split(","):
        part = part.strip()
        try:
            v = kind(part)
        except ValueError:
            raise ConfigError(
                f"{key}: {part!r} is not {'an integer' if kind is int else 'a number'}",
                key=key,
                allowed=allowed,
            ) from None
        out.append(v)
    if len(set(out)) != len(out):
        raise ConfigError(f"{key}: duplicate values in {text!r}", key=key, allowed=allowed)
    return out


def parse_grid(
    *,
    policy: str,
    fractions: str | None = None,
    etas: str | None = None,
    tolerance: str | float = DEFAULT_TOLERANCE,
) -> PlanGrid:
    """Validate the CLI's grid options (comma-separated strings; None = the default, and a
    given one that names nothing is refused).

    Raises :class:`ConfigError` naming the option (``--policy``, ``--fractions``, ``--etas``,
    ``--tolerance``) and its allowed values.
    """
    pol = policy
    if pol not in PLANNABLE:
        if colocated(pol):
            msg = (
                f"--policy: {pol!r} is colocated on every GPU, so it has no split to plan; "
                "pass --policy with a disaggregated policy"
            )
        else:
            msg = f"--policy: unknown policy {policy!r}"
        raise ConfigError(msg, key="--policy", allowed=", ".join(PLANNABLE))
    f_allowed = "comma-separated numbers in (0, 1), e.g. 0.25,0.5,0.75"
    fr = (
        _numbers(fractions, "--fractions", f_allowed, float)
        if fractions is not None
        else list(DEFAULT_FRACTIONS)
    )
    for f in fr:
        if not (math.isfinite(f) and 0 < f < 1):
            raise ConfigError(
                f"--fractions: rollout fraction {f!r} is outside (0, 1)",
                key="--fractions",
                allowed=f_allowed,
            )
    e_allowed = "comma-separated integers >= 0, e.g. 1,2,3"
    if pol in FIXED_ETA:
        fixed = FIXED_ETA[pol]
        e_allowed = f"{fixed} (policy {pol!r} models a fixed staleness)"
    if etas is not None:
        et = _numbers(etas, "--etas", e_allowed, int)
    else:
        et = [FIXED_ETA[pol]] if pol in FIXED_ETA else list(DEFAULT_ETAS)
    for e in et:
        if e < 0 or (pol in FIXED_ETA and e != FIXED_ETA[pol]):
            raise ConfigError(f"--etas: η {e} is not allowed", key="--etas", allowed=e_allowed)
    try:
        tol = float(tolerance)
    except ValueError:
        tol = math.nan
    if not (math.isfinite(tol) and 0 <= tol < 1):
        raise ConfigError(
            f"--tolerance: {tolerance!r} is not a number in [0, 1)",
            key="--tolerance",
            allowed="a number in [0, 1), e.g. 0.05",
        )
    return PlanGrid(policy=pol, fractions=tuple(sorted(fr)), etas=tuple(sorted(et)), tolerance=tol)


def splits_for(base: SimSpec, fractions: tuple[float, ...]) -> list[Split]:
    """Round each fraction of ``base.total_gpus`` to whole rollout instances; the rest train.

    Fractions that round to the same split share it (listed in ``Split.fractions``). A
    fraction that leaves no rollout instance or no training GPU is a :class:`ConfigError`.
    """
    total, per = base.total_gpus, base.gpus_per_instance
    max_inst = (total - 1) // per
    if max_inst < 1:
        raise ConfigError(
            f"sim.total_gpus={total} cannot hold one rollout instance of "
            f"{per} GPUs plus one training GPU",
            key="sim.total_gpus",
            allowed=f">= {per + 1}",
        )
    by_rollout: dict[int, list[float]] = {}
    for f in fractions:
        inst = round(f * total / per)
        if not 1 <= inst <= max_inst:
            lo, hi = per / total, max_inst * per / total
            raise ConfigError(
                f"--fractions: {f} of {total} GPUs gives {inst} rollout instances of {per} GPUs; "
                f"a split needs 1..{max_inst} instances and >= 1 training GPU",
                key="--fractions",
                allowed=f"fractions that round to {lo:.3g}..{hi:.3g}",
            )
        by_rollout.setdefault(inst * per, []).append(f)
    return [
        Split(rollout_gpus=r, train_gpus=total - r, fractions=tuple(fs))
        for r, fs in sorted(by_rollout.items())
    ]


def plan_configs(cfg: AppConfig, grid: PlanGrid) -> list[AppConfig]:
    """Every (split, η) point of the grid as a config for ``grid.policy``."""
    base = spec_from_app_config(cfg)
    out: list[AppConfig] = []
    for sp in splits_for(base, grid.fractions):
        at = cfg.evolve(
            f"sim.train_gpus={sp.train_gpus}",
            f"rollout.num_instances={sp.rollout_gpus // base.gpus_per_instance}",
        )
        out.extend(with_policy(at, grid.policy, eta) for eta in grid.etas)
    return out


def budget_ideal(base: SimSpec, moments: dict[str, float] | None = None) -> dict[str, Any]:
    """The best ``ideal_tokens_per_s`` of any whole-instance split of ``base.total_gpus``."""
    m = moments if moments is not None else workload_moments(base)
    best: dict[str, Any] | None = None
    per, total = base.gpus_per_instance, base.total_gpus
    for r in range(per, total, per):
        spec = attrs.evolve(base, policy="staleflow", rollout_gpus=r, train_gpus=total - r)
        ideal = ideal_throughput(spec, m)
        if best is None or ideal["ideal_tokens_per_s"] > best["ideal_tokens_per_s"]:
            best = {
                "ideal_tokens_per_s": ideal["ideal_tokens_per_s"],
                "rollout_gpus": r,
                "train_gpus": total - r,
                "rollout_side_tokens_per_s": ideal["rollout_side_tokens_per_s"],
                "train_side_tokens_per_s": ideal["train_side_tokens_per_s"],
            }
    if best is None:  # pragma: no cover - splits_for rejects such budgets first
        raise ConfigError("no split", key="sim.total_gpus", allowed=f">= {per + 1}")
    return best


def select(
    rows: list[dict[str, Any]], tolerance: float
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``(fastest, recommended)`` among rows whose ``max_staleness <= eta``.

    ``fastest``: the most ``tokens_per_s`` (ties: smaller η, then fewer rollout GPUs).
    ``recommended``: among rows within ``tolerance`` of the fastest's tokens/s, the smallest η,
    then the most tokens/s. Both ``None`` when no row is valid.
    """
    valid = [r for r in rows if r["max_staleness"] <= r["eta"]]
    if not valid:
        return None, None
    fastest = max(valid, key=lambda r: (r["tokens_per_s"], -r["eta"], -r["rollout_gpus"]))
    floor = (1.0 - tolerance) * fastest["tokens_per_s"]
    near = [r for r in valid if r["tokens_per_s"] >= floor]
    recommended = min(near, key=lambda r: (r["eta"], -r["tokens_per_s"], r["rollout_gpus"]))
    return fastest, recommended


def _row_name(spec: SimSpec) -> str:
    return f"{spec.policy}-r{spec.rollout_gpus}-t{spec.train_gpus}-eta{spec.eta}"


def run_plan(
    cfg: AppConfig,
    out_dir: Path,
    grid: PlanGrid,
    *,
    workers: int | None = None,
    plots: bool = True,
) -> dict[str, Any]:
    """Simulate every grid point, select, write plan.json / results/plan.md / plan.png."""
    t0 = time.monotonic()
    base = spec_from_app_config(cfg)
    splits = splits_for(base, grid.fractions)
    configs = plan_configs(cfg, grid)
    specs = [spec_from_app_config(c) for c in configs]
    _log.info("plan_start", points=len(specs), splits=len(splits), etas=list(grid.etas))
    summaries = run_specs(
        [(c, out_dir / "runs" / _row_name(s)) for c, s in zip(configs, specs, strict=True)],
        workers=workers,
    )
    moments = workload_moments(base)
    budget = budget_ideal(base, moments)
    results = []
    for spec, s in zip(specs, summaries, strict=True):
        ideal = ideal_throughput(spec, moments)
        results.append(
            {
                "policy": spec.policy,
                "eta": spec.eta,
                "rollout_gpus": spec.rollout_gpus,
                "train_gpus": spec.train_gpus,
                "rollout_instances": spec.num_instances,
                "rollout_fraction": spec.rollout_gpus / spec.total_gpus,
                "tokens_per_s": s["tokens_per_s"],
                "ideal_tokens_per_s": ideal["ideal_tokens_per_s"],
                "bound": ideal["bound"],
                "frac_of_ideal": s["tokens_per_s"] / ideal["ideal_tokens_per_s"],
                "frac_of_budget_ideal": s["tokens_per_s"] / budget["ideal_tokens_per_s"],
                "mean_step_s": s["mean_step_s"],
                "trainer_idle_frac": s["trainer_idle_frac"],
                "rollout_busy_frac": s["rollout_busy_frac"],
                "max_staleness": s["max_staleness"],
                "mean_staleness": s["mean_staleness"],
                "tokens_wasted": s["tokens_wasted"],
                "steps": s["steps"],
                "warmup_steps": s["warmup_steps"],
                "wall_s": round(s["wall_s"], 2),
            }
        )
    fastest, recommended = select(results, grid.tolerance)
    notes = []
    if base.trainer_model == "linear":
        notes.append(
            "sim.trainer_model=linear: the training step does not depend on the number of "
            "training GPUs, so only the rollout side varies with the split (use "
            "sim.trainer_model=flops to plan a split)"
        )
        _log.warning("plan_linear_trainer_model", note=notes[-1])
    report = {
        "grid": {
            "policy": grid.policy,
            "fractions": list(grid.fractions),
            "etas": list(grid.etas),
            "tolerance": grid.tolerance,
            "total_gpus": base.total_gpus,
            "gpus_per_instance": base.gpus_per_instance,
            "splits": [attrs.asdict(sp) for sp in splits],
            "steps": base.steps,
            "warmup_steps": base.warmup_steps,
        },
        "budget_ideal": budget,
        "results": results,
        "fastest": fastest,
        "recommended": recommended,
        "notes": notes,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    res = write_report(out_dir, "plan", report, markdown_table(report))
    if plots:
        _plot(report, res / "plan.png")
    _log.info("plan_done", out=str(out_dir), wall_s=report["wall_s"])
    return report


def _pick(r: dict[str, Any] | None) -> str:
    if r is None:
        return "none (every point exceeded its staleness bound)"
    return (
        f"{r['rollout_gpus']} rollout + {r['train_gpus']} training GPUs, η = {r['eta']}: "
        f"{r['tokens_per_s']:.0f} tokens/s ({100 * r['frac_of_ideal']:.0f}% of the split's "
        f"ideal, {100 * r['frac_of_budget_ideal']:.0f}% of the budget's), "
        f"max staleness {r['max_staleness']}"
    )


def _key(r: dict[str, Any]) -> tuple[int, int]:
    return (int(r["rollout_gpus"]), int(r["eta"]))


def _marks(labels: list[str] | None) -> str:
    return f" **{', '.join(labels)}**" if labels else ""


def markdown_table(report: dict[str, Any]) -> str:
    g, b = report["grid"], report["budget_ideal"]
    lines = [
        f"Plan for {g['policy']} on {g['total_gpus']} GPUs ({g['steps']} steps, "
        f"{g['warmup_steps']} warm-up). Budget ideal {b['ideal_tokens_per_s']:.0f} tokens/s "
        f"at {b['rollout_gpus']} rollout + {b['train_gpus']} training GPUs.",
        "",
        "| rollout + train GPUs | η | tokens/s | % of split ideal (bound) | % of budget ideal "
        "| trainer idle | rollout util | max staleness | mean staleness |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    marks: dict[tuple[int, int], list[str]] = {}
    for label in ("fastest", "recommended"):
        if report[label] is not None:
            marks.setdefault(_key(report[label]), []).append(label)
    for r in sorted(report["results"], key=lambda r: (r["rollout_gpus"], r["eta"])):
        lines.append(
            f"| {r['rollout_gpus']} + {r['train_gpus']} | {r['eta']} | "
            f"{r['tokens_per_s']:.0f}{_marks(marks.get(_key(r)))} | "
            f"{100 * r['frac_of_ideal']:.0f}% ({r['bound']}) | "
            f"{100 * r['frac_of_budget_ideal']:.0f}% | {100 * r['trainer_idle_frac']:.0f}% | "
            f"{100 * r['rollout_busy_frac']:.0f}% | {r['max_staleness']} | "
            f"{r['mean_staleness']:.2f} |"
        )
    lines += [
        "",
        f"Fastest: {_pick(report['fastest'])}.",
        f"Recommended (smallest η within {100 * g['tolerance']:.0f}% of the fastest): "
        f"{_pick(report['recommended'])}.",
        *(f"Note: {n}." for n in report.get("notes", [])),
    ]
    return "\n".join(lines) + "\n"


def _plot(report: dict[str, Any], out: Path) -> None:
    from matplotlib.ticker import MaxNLocator

    from staleflow_trainer.report import plots

    plt = plots.plt_agg()
    fig, ax = plt.subplots(figsize=(7, 4))
    for eta in report["grid"]["etas"]:
        rows = sorted(
            (r for r in report["results"] if r["eta"] == eta), key=lambda r: r["rollout_gpus"]
        )
        ax.plot(
            [r["rollout_gpus"] for r in rows],
            [r["tokens_per_s"] for r in rows],
            marker="o",
            label=f"bound η = {eta}",
        )
    rows = sorted(
        {r["rollout_gpus"]: r for r in report["results"]}.values(),
        key=lambda r: r["rollout_gpus"],
    )
    ax.plot(
        [r["rollout_gpus"] for r in rows],
        [r["ideal_tokens_per_s"] for r in rows],
        ls="--",
        color="grey",
        label="ideal of the split",
    )
    for key, marker, size in (("fastest", "o", 15), ("recommended", "*", 17)):
        pick = report.get(key)
        if pick:
            ax.plot(
                [pick["rollout_gpus"]],
                [pick["tokens_per_s"]],
                ls="none",
                marker=marker,
                ms=size,
                mfc="none",
                mec="black",
                mew=1.4,
                label=f"{key} (η = {pick['eta']})",
            )
    g = report["grid"]
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=0)
    ax.set_xlabel(f"rollout GPUs (of {g['total_gpus']}; the rest train)")
    warmup = g.get("warmup_steps")
    measured = "" if warmup is None else f"\n(mean after {warmup} warm-up steps)"
    ax.set_ylabel(f"trained tokens / virtual s{measured}")
    ax.set_title(f"plan: {g['policy']} on {g['total_gpus']} GPUs, {g['steps']} simulated steps")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    plots._save(fig, out)


def plan_main(
    cfg: AppConfig,
    *,
    policy: str = "",
    fractions: str | None = None,
    etas: str | None = None,
    tolerance: str | float = DEFAULT_TOLERANCE,
    workers: int | None = None,
) -> int:
    """The CLI command: config → grid → simulations → plan.json; prints the table and picks.

    ``policy=""`` plans the config's ``coordinator.policy``.
    """
    grid = parse_grid(
        policy=policy or cfg.coordinator.policy,
        fractions=fractions,
        etas=etas,
        tolerance=tolerance,
    )
    base = spec_from_app_config(cfg)
    splits_for(base, grid.fractions)  # validate before writing anything
    out = make_run_dir(cfg.run.run_dir)
    dump_config(cfg, out / "config.yaml")
    report = run_plan(cfg, out, grid, workers=workers)
    print(markdown_table(report), end="")
    print(f"written: {out / 'plan.json'}, {out / 'results'} ({report['wall_s']:.0f} s wall)")
    return 0
