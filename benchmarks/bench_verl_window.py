"""verl-async's window against the staleness it trains at, beside staleflow's bound.

verl's fully-async recipe limits how far generation runs ahead of training (a window of
``(1 + s)·B`` samples per weight sync, ``s`` its ``staleness_threshold``) but not how stale one
response can be: with partial rollout a long response keeps the version it started at while
the trainer moves on, and nothing is dropped. At ``s = η`` it therefore trains some responses
more than η versions after they started. This bench measures how far, and what verl's window
has to be to keep every trajectory within η, side by side with staleflow, which keeps η for
every trajectory by construction::

    .venv/bin/python benchmarks/bench_verl_window.py            # the three presets (~8 min)
    .venv/bin/python benchmarks/bench_verl_window.py --smoke    # seconds: tiny overrides

For each preset it runs, on the same seeds (default 0 and 1) and the presets' steady state
(``sim.warmup_steps`` excluded), staleflow at every η of ``--etas`` and verl-async at every
window of ``--windows`` (``coordinator.verl_staleness_threshold``; its ``protocol.eta`` does
not matter then). Printed per preset and η:

* staleflow's tokens/s (mean over seeds; its max staleness is ≤ η);
* verl-async at ``s = η`` (what the preset matrix runs; verl's own default is 0.1): tokens/s,
  the largest staleness it trained at over the seeds, and staleflow ÷ it;
* verl-async at the widest window of ``--windows`` whose trained staleness stayed ≤ η on
  every seed ("kept"): that window, its tokens/s and staleflow ÷ it (none if even the
  narrowest window exceeded η).

Every run is ``staleflow simulate``'s (the compare machinery:
:func:`staleflow_trainer.report.compare.run_specs`). Writes ``<out-dir>/verl_window.json`` and
``.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import structlog

from staleflow_trainer.config import AppConfig, load_config
from staleflow_trainer.report.compare import plan_runs, run_specs

# its sibling benchmark, also when this file is loaded by path (not run as a script)
if (_HERE := str(Path(__file__).resolve().parent)) not in sys.path:
    sys.path.insert(0, _HERE)
from bench_sim_matrix import ETAS, PRESETS, SMOKE, SMOKE_ETAS  # the matrix's presets and smoke

WINDOWS = (0.0, 0.5, 1.0, 2.0, 3.0, 5.0)
SMOKE_WINDOWS = (0.0, 1.0, 3.0)


def jobs(
    base: AppConfig, etas: tuple[int, ...], windows: tuple[float, ...], seeds: tuple[int, ...]
) -> list[tuple[str, float, int, AppConfig]]:
    """``(policy, η or window, seed, config)`` for every run of one preset."""
    out: list[tuple[str, float, int, AppConfig]] = []
    for seed in seeds:
        at = base.evolve(f"run.seed={seed}")
        for cfg in plan_runs(at, ["staleflow"], etas):
            out.append(("staleflow", float(cfg.protocol.eta), seed, cfg))
        for s in windows:
            (cfg,) = plan_runs(at, ["verl-async"], (max(1, int(s)),))
            cfg = cfg.evolve(f"coordinator.verl_staleness_threshold={s}")
            out.append(("verl-async", s, seed, cfg))
    return out


def summarize(
    runs: list[tuple[str, float, int, dict[str, Any]]], etas: tuple[int, ...]
) -> list[dict[str, Any]]:
    """Per η: staleflow, verl-async at ``s = η`` and at the widest window that kept η."""

    def by(policy: str, x: float) -> list[dict[str, Any]]:
        return [s for p, v, _, s in runs if p == policy and v == x]

    def mean(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.fmean(float(r[key]) for r in rows)

    windows = sorted({v for p, v, _, _ in runs if p == "verl-async"})
    out = []
    for eta in etas:
        flow = by("staleflow", float(eta))
        tps = mean(flow, "tokens_per_s")
        row: dict[str, Any] = {
            "eta": eta,
            "staleflow_tokens_per_s": tps,
            "staleflow_samples_per_s": mean(flow, "samples_per_s"),
            "staleflow_max_staleness": max(int(r["max_staleness"]) for r in flow),
        }
        same = by("verl-async", float(eta))
        if same:
            row["verl_at_eta"] = {
                "tokens_per_s": mean(same, "tokens_per_s"),
                "samples_per_s": mean(same, "samples_per_s"),
                "max_staleness": max(int(r["max_staleness"]) for r in same),
                "mean_staleness": mean(same, "mean_staleness"),
                "staleflow_ratio": tps / mean(same, "tokens_per_s"),
            }
        kept = [s for s in windows if all(r["max_staleness"] <= eta for r in by("verl-async", s))]
        if kept:
            rows = by("verl-async", kept[-1])
            row["verl_kept"] = {
                "window": kept[-1],
                "tokens_per_s": mean(rows, "tokens_per_s"),
                "samples_per_s": mean(rows, "samples_per_s"),
                "max_staleness": max(int(r["max_staleness"]) for r in rows),
                "staleflow_ratio": tps / mean(rows, "tokens_per_s"),
            }
        else:
            row["verl_kept"] = None
        out.append(row)
    return out


def markdown(name: str, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"### {name}",
        "",
        "| η | staleflow tokens/s (samples/s) | verl-async, s = η: tokens/s (samples/s) | "
        "its max staleness | staleflow ÷ it | widest s that kept η | its tokens/s (samples/s) | "
        "staleflow ÷ it |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def rate(x: dict[str, Any], pre: str = "") -> str:
        return f"{x[pre + 'tokens_per_s']:.0f} ({x[pre + 'samples_per_s']:.2f})"

    for r in rows:
        at, kept = r.get("verl_at_eta"), r["verl_kept"]
        a = "— | — | —"
        if at:
            a = f"{rate(at)} | {at['max_staleness']} | {at['staleflow_ratio']:.2f}×"
        k = "none | — | —"
        if kept:
            k = f"{kept['window']:g} | {rate(kept)} | {kept['staleflow_ratio']:.2f}×"
        lines.append(f"| {r['eta']} | {rate(r, 'staleflow_')} | {a} | {k} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every preset")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--etas", default=",".join(str(e) for e in ETAS))
    ap.add_argument("--windows", default=",".join(f"{w:g}" for w in WINDOWS))
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--out-dir", default="bench-results/verl_window")
    ap.add_argument("--smoke", action="store_true", help="tiny overrides: seconds, not numbers")
    a = ap.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    etas = tuple(int(e) for e in a.etas.split(",") if e)
    windows = tuple(float(w) for w in a.windows.split(",") if w)
    if a.smoke:
        etas = SMOKE_ETAS if a.etas == ap.get_default("etas") else etas
        windows = SMOKE_WINDOWS if a.windows == ap.get_default("windows") else windows
    seeds = tuple(int(s) for s in a.seeds.split(",") if s)
    over = [*(SMOKE if a.smoke else []), "metrics.timeline=false", "metrics.progress_bar=false",
            "metrics.log_every=0", *a.overrides]  # fmt: skip
    root = Path(a.out_dir)
    t0 = time.monotonic()
    res: dict[str, Any] = {"smoke": a.smoke, "etas": list(etas), "windows": list(windows),
                           "seeds": list(seeds), "overrides": over, "presets": {}}  # fmt: skip
    md = []
    for preset in (p for p in a.presets.split(",") if p):
        name = Path(preset).stem
        base = load_config(preset, over)
        todo = jobs(base, etas, windows, seeds)
        dirs = [root / name / f"{p}-{v:g}-seed{s}" for p, v, s, _ in todo]
        summaries = run_specs([(c, d) for (*_, c), d in zip(todo, dirs, strict=True)],
                              workers=a.workers)  # fmt: skip
        runs = [(p, v, s, summ) for (p, v, s, _), summ in zip(todo, summaries, strict=True)]
        rows = summarize(runs, etas)
        res["presets"][name] = {
            "rows": rows,
            "runs": [
                {
                    "policy": p,
                    "eta_or_window": v,
                    "seed": s,
                    **{
                        k: summ[k]
                        for k in (
                            "tokens_per_s",
                            "samples_per_s",
                            "max_staleness",
                            "mean_staleness",
                        )
                    },
                }
                for p, v, s, summ in runs
            ],
        }
        md.append(markdown(name, rows))
        print(md[-1], flush=True)
    res["wall_s"] = round(time.monotonic() - t0, 1)
    root.mkdir(parents=True, exist_ok=True)
    (root / "verl_window.json").write_text(json.dumps(res, indent=2) + "\n")
    (root / "verl_window.md").write_text("\n".join(md))
    print(f"{res['wall_s']:.0f} s; written: {root / 'verl_window.json'}, {root / 'verl_window.md'}")
    return res


if __name__ == "__main__":
    main()
