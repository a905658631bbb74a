"""Scalability sweeps on the simulator (setup 2): how staleflow's lead over the
baselines moves with the GPU budget, the maximum response length and the batch size.

One command per sweep; every point is a ``staleflow compare`` of the paper preset (same code
path: :func:`staleflow_trainer.report.compare.run_comparison`) with one knob changed::

    .venv/bin/python benchmarks/bench_sim_sweep.py gpus       # total GPUs 32, 64, 128, 256
    .venv/bin/python benchmarks/bench_sim_sweep.py response   # max response 8K, 20K, 40K
    .venv/bin/python benchmarks/bench_sim_sweep.py batch      # batch 32, 64, 128 prompts
    .venv/bin/python benchmarks/bench_sim_sweep.py gpus --values 32,64 --steps 8 --seeds 0

* ``gpus``: ``sim.total_gpus=G``, half rollout (``rollout.num_instances`` TP1 instances), half
  training; ``sync`` is colocated on all ``G``.
* ``response``: ``rollout.sampling.max_new_tokens=L`` and ``rollout.max_model_len=L + 2048``;
  the length distribution (lognormal, median 3000) is unchanged, so the cap moves the tail.
* ``batch``: ``protocol.batch_size=B`` prompts (× 16 samples).

Writes ``bench-results/sim_sweep_<sweep>.json`` (in general ``<out-dir>_<sweep>.json``: per
point and seed every policy's tokens/s, % of the split's ideal, max staleness and staleflow's
ratio to each baseline), ``.md`` (the table) and ``.png`` (ratio vs the swept value, mean over
seeds with the min–max band), plus each point's ``compare.json`` under
``bench-results/sim_sweep/<sweep>/<value>-seed<s>/``. A point an earlier sweep already ran
with the identical spec (the preset's own point is in all three) is reused unless
``--no-reuse``. ``--smoke`` runs one sweep on ``examples/sim-tiny.yaml`` with two small values,
4 steps, seed 0 and two policies (seconds; the test suite runs it)::

    .venv/bin/python benchmarks/bench_sim_sweep.py batch --smoke --out-dir /tmp/sweep
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import subprocess
import time
from pathlib import Path
from typing import Any

import structlog

from staleflow_trainer.config import AppConfig, load_config
from staleflow_trainer.report.compare import run_comparison
from staleflow_trainer.sim.spec import SimSpec, spec_from_app_config

ROOT = Path(__file__).resolve().parents[1]

SWEEPS: dict[str, dict[str, Any]] = {
    "gpus": {"values": [32, 64, 128, 256], "label": "total GPUs (half rollout, half training)"},
    "response": {"values": [8192, 20480, 40960], "label": "max response length (tokens)"},
    "batch": {"values": [32, 64, 128], "label": "batch size (prompts × 16)"},
}
#: ``--smoke``: two small points per sweep on examples/sim-tiny.yaml, 4 steps, one seed
SMOKE_CONFIG = "examples/sim-tiny.yaml"
SMOKE_VALUES = {"gpus": [4, 8], "response": [512, 1024], "batch": [8, 12]}
SMOKE_POLICIES = "staleflow,sync"


def point_overrides(sweep: str, value: int, probe: AppConfig) -> list[str]:
    """The config overrides that set one sweep point (``probe``: the config before them)."""
    if sweep == "gpus":
        return [
            f"rollout.num_instances={value // 2 // probe.sim.gpus_per_instance}",
            f"sim.total_gpus={value}",
            f"sim.train_gpus={value - value // 2}",
        ]
    if sweep == "response":
        return [
            f"rollout.sampling.max_new_tokens={value}",
            f"rollout.max_model_len={value + probe.data.max_prompt_len}",
        ]
    if sweep == "batch":
        return [f"protocol.batch_size={value}"]
    raise ValueError(f"unknown sweep {sweep!r}; allowed: {', '.join(SWEEPS)}")


def _stats(xs: list[float]) -> dict[str, float]:
    return {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs)}


def _git_head() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def spec_key(base: SimSpec, policies: list[str], eta: int) -> str:
    """Identifies a sweep point's comparison: the resolved spec, the policies and η."""
    blob = json.dumps([base.to_dict(), sorted(policies), eta], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _cached(root: Path, key: str) -> dict[str, Any] | None:
    """A comparison of the identical point run by an earlier sweep (the sweeps share the
    preset's own point), or None."""
    for kf in root.glob("*/*/spec_key.txt"):
        if kf.read_text().strip() == key and (kf.parent / "compare.json").is_file():
            rep: dict[str, Any] = json.loads((kf.parent / "compare.json").read_text())
            rep["_dir"] = str(kf.parent)
            return rep
    return None


def run_sweep(a: argparse.Namespace) -> dict[str, Any]:
    values = [int(v) for v in a.values.split(",")] if a.values else SWEEPS[a.sweep]["values"]
    seeds = [int(s) for s in a.seeds.split(",")]
    policies = a.policies.split(",")
    base_over = [f"trainer.steps={a.steps}", "metrics.timeline=false", *a.overrides]
    root = Path(a.out_dir)
    t_all = time.monotonic()
    points = []
    for v in values:
        by_seed = []
        t0 = time.monotonic()
        for seed in seeds:
            probe = load_config(a.config, base_over)
            over = [*base_over, f"run.seed={seed}"]
            over += point_overrides(a.sweep, v, probe)
            cfg = load_config(a.config, over)
            base = spec_from_app_config(cfg)
            out = root / a.sweep / f"{v}-seed{seed}"
            key = spec_key(base, policies, a.eta)
            rep = _cached(root, key) if a.reuse else None
            if rep is None:
                rep = run_comparison(
                    cfg,
                    out,
                    policies=policies,
                    etas=(a.eta,),
                    seeds=(seed,),
                    workers=a.workers,
                    plots=False,
                )
                (out / "spec_key.txt").write_text(key + "\n")
            else:
                print(f"{a.sweep}={v} seed {seed}: reusing {rep['_dir']}", flush=True)
            rows = {r["policy"]: r for r in rep["results"]}
            by_seed.append(
                {
                    "seed": seed,
                    "overrides": over,
                    "compare_dir": rep.get("_dir", str(out)),
                    "reused": "_dir" in rep,
                    "runs_wall_s": round(sum(r["wall_s"] for r in rep["results"]), 1),
                    "ideal_tokens_per_s": rep["ideal_tokens_per_s"],
                    "split": rep["split"],
                    "tokens_per_s": {p: r["tokens_per_s"] for p, r in rows.items()},
                    "frac_of_ideal": {p: r["frac_of_ideal"] for p, r in rows.items()},
                    "max_staleness": {p: r["max_staleness"] for p, r in rows.items()},
                    "eta": {p: r["eta"] for p, r in rows.items()},
                    "ratios": rep["ratios"].get(f"eta={a.eta}", {}),
                }
            )
        wall = time.monotonic() - t0
        pols = list(by_seed[0]["tokens_per_s"])
        point = {
            "value": v,
            "wall_s": round(wall, 1),
            "ideal_tokens_per_s": by_seed[0]["ideal_tokens_per_s"],
            "bound": by_seed[0]["split"]["bound"],
            "train_step_s": by_seed[0]["split"]["train_step_s"],
            "tokens_per_s": {p: _stats([s["tokens_per_s"][p] for s in by_seed]) for p in pols},
            "frac_of_ideal": {p: _stats([s["frac_of_ideal"][p] for s in by_seed]) for p in pols},
            "max_staleness": {p: max(s["max_staleness"][p] for s in by_seed) for p in pols},
            "ratios": {
                p: _stats([s["ratios"][p] for s in by_seed])
                for p in by_seed[0]["ratios"]
                if all(p in s["ratios"] for s in by_seed)
            },
            "by_seed": by_seed,
        }
        points.append(point)
        sf = point["tokens_per_s"].get("staleflow", {}).get("mean", float("nan"))
        print(
            f"{a.sweep}={v}: staleflow {sf:.0f} tokens/s, ratios "
            + ", ".join(f"/{p} {r['mean']:.2f}×" for p, r in point["ratios"].items())
            + f"  ({wall:.0f} s wall)",
            flush=True,
        )
    return {
        "sweep": a.sweep,
        "label": SWEEPS[a.sweep]["label"],
        "config": a.config,
        "extra_overrides": a.overrides,
        "steps": a.steps,
        "eta": a.eta,
        "seeds": seeds,
        "policies": policies,
        "commit": _git_head(),
        "points": points,
        "wall_s": round(time.monotonic() - t_all, 1),
    }


def markdown(res: dict[str, Any]) -> str:
    pols = [p for p in res["policies"] if p != "staleflow"]
    head = (
        ["value", "ideal tok/s", "staleflow tok/s (% ideal)"]
        + [f"{p} tok/s" for p in pols]
        + [f"staleflow / {p}" for p in pols]
        + ["max staleness", "wall (Σ runs)"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    multi = len(res["seeds"]) > 1
    for pt in res["points"]:
        tp, fr = pt["tokens_per_s"], pt["frac_of_ideal"]
        cells = [
            f"{pt['value']}",
            f"{pt['ideal_tokens_per_s']:.0f} ({pt['bound']})",
            f"{tp['staleflow']['mean']:.0f} ({100 * fr['staleflow']['mean']:.0f}%)",
        ]
        cells += [f"{tp[p]['mean']:.0f}" for p in pols]
        for p in pols:
            r = pt["ratios"].get(p)
            if r is None:
                cells.append("—")
            elif multi:
                cells.append(f"{r['mean']:.2f}× ({r['min']:.2f}–{r['max']:.2f})")
            else:
                cells.append(f"{r['mean']:.2f}×")
        stale = max(pt["max_staleness"].values())
        runs = sum(b.get("runs_wall_s", 0.0) for b in pt["by_seed"])
        reused = all(b.get("reused") for b in pt["by_seed"])
        wall = "reused" if reused else f"{pt['wall_s']:.0f} s"
        cells += [f"≤ {stale}", f"{wall} ({runs:.0f} s)"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [pt["value"] for pt in res["points"]]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    # a marker and a dash pattern per series: two baselines with the same ratios (the
    # staleflow ablations often match) stay visible on top of each other
    styles = [("o", "-", 9), ("s", "--", 7.5), ("^", "-.", 6.5), ("D", ":", 5.5), ("v", "-", 5)]
    shown = [
        p
        for p in res["policies"]
        if p != "staleflow" and all(p in pt["ratios"] for pt in res["points"])
    ]
    for i, p in enumerate(shown):
        rs = [pt["ratios"][p] for pt in res["points"]]
        marker, ls, ms = styles[i % len(styles)]
        (line,) = ax.plot(
            xs,
            [r["mean"] for r in rs],
            marker=marker,
            ls=ls,
            ms=ms,
            mfc="none" if i % 2 else None,
            label=f"staleflow / {p}",
        )
        if len(res["seeds"]) > 1:
            ax.fill_between(
                xs,
                [r["min"] for r in rs],
                [r["max"] for r in rs],
                color=line.get_color(),
                alpha=0.2,
            )
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel(res["label"])
    seeds = ", ".join(str(s) for s in res["seeds"])
    ax.set_ylabel(f"trained tokens/s ratio, staleflow ÷ baseline (η = {res['eta']})")
    ax.set_title(f"staleflow's lead vs {res['label']}\n({res['steps']} steps, seeds {seeds})")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("sweep", choices=list(SWEEPS))
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every point")
    ap.add_argument("--config", default="examples/sim-paper-30b-a3b.yaml")
    ap.add_argument("--values", default="", help="comma-separated values (default: the sweep's)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eta", type=int, default=3)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument(
        "--policies", default="staleflow,coarse-async,coarse-async-drop,one-step,sync,all-vanilla"
    )
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--out-dir", default="bench-results/sim_sweep")
    ap.add_argument(
        "--no-reuse",
        dest="reuse",
        action="store_false",
        help="rerun points an earlier sweep already ran with the identical spec",
    )
    ap.add_argument(
        "--render", action="store_true", help="rewrite the .md/.png from the sweep's .json only"
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help=f"{SMOKE_CONFIG}, two small values, 4 steps, seed 0, {SMOKE_POLICIES}, no reuse",
    )
    a = ap.parse_intermixed_args(argv)
    if a.smoke:
        a.config, a.steps, a.seeds, a.reuse = str(ROOT / SMOKE_CONFIG), 4, "0", False
        a.values = ",".join(str(v) for v in SMOKE_VALUES[a.sweep])
        a.policies, a.workers = SMOKE_POLICIES, 1
    if "staleflow" not in a.policies.split(","):
        ap.error("--policies must include staleflow (the ratios are staleflow's)")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    root = Path(a.out_dir)
    stem = root.parent / f"{root.name}_{a.sweep}"
    if a.render:
        res = json.loads(stem.with_suffix(".json").read_text())
        for pt in res["points"]:
            for b in pt["by_seed"]:
                if "runs_wall_s" not in b:
                    rep = json.loads((Path(b["compare_dir"]) / "compare.json").read_text())
                    b["runs_wall_s"] = round(sum(r["wall_s"] for r in rep["results"]), 1)
                    b["reused"] = pt["wall_s"] < 1.0  # a reused point costs no wall time
    else:
        res = run_sweep(a)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    table = markdown(res)
    stem.with_suffix(".md").write_text(table)
    plot(res, stem.with_suffix(".png"))
    print(table, end="")
    print(f"total {res['wall_s']:.0f} s wall; written {stem}.json/.md/.png")
    return res


if __name__ == "__main__":
    main()
