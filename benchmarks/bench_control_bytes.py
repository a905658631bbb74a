"""Bytes that cross the control process per trajectory, against response length.

The control process (the Ray control actor) carries ids, versions and token counts; prompts,
responses, log-probs and rewards' inputs go between the trajectory server, the instances, the
reward workers and the trainer directly. This benchmark checks that on the real deployment
(``staleflow_trainer.runtime.wiring.Deployment``: Ray, the trajectory server over TCP, the NIXL
parameter server, the real trainer) with sim engine instances: ``examples/tiny.yaml`` (B x n =
8 x 8, 2 instances; ``--eta``, default 1), one run per response length ``L`` (every response
is ``L`` tokens: ``sim.workload.response_len_median=L``, sigma 0, capped at
``max_new_tokens=L``). The sim engines use a fast cost model (``--step-ms``, 1 ms a decode step
by default, whatever they run), so a run's wall time is mostly training and control, not
generation, and the coordinator ranks and migrates by that same model
(``coordinator.cost_model``, a coefficient file; the engines take the coordinator's model by
default), as it would after ``staleflow profile`` on a real engine. A router whose model
differs from its engines' migrates by the difference, and the bytes then measure that: with the
example's model for a 7B model on an H20 (a step of 9 to 31 ms that grows 2.3 times with the KV
from 16 to 8,192 tokens) against engines at a flat 0.1 ms, migration paid on paper from 4,096
tokens on and moved about a quarter of the trajectories. A response that ends before the
control side's first poll after its route (16 tokens take 16 ms at 1 ms a step; the control
cycle here is 0.1 s) never has its start reported, and costs one snapshot entry and a share of
one poll less than any response that outlives that poll: about 4 B a trajectory, the step
between the shortest length and the rest. At 10 ms a step (what a 7B model on one H20 takes)
the runs' schedules differ between lengths (syncs interrupt 0.16 to 0.19 of the trajectories up
to 4,096 tokens, none at 8,192), which is what such a comparison then measures; at 1 ms none is
re-admitted at any length. Each instance's KV holds
``KV_TRAJECTORIES_PER_RUNNING`` (1.25) full-length trajectories for each one it may run
(``rollout.max_running``), at every length (``sim.kv_capacity_tokens``): with
the capacity the 30B model's geometry gives (274 736 tokens), the instances ran out of KV from
4 096 tokens on, and a KV-bound instance preempts and admits its work one trajectory at a time,
which the control side is told of at any length; the headroom keeps that out of the comparison
between lengths.

After each run it reads ``ControlActor.io_stats()`` (per peer kind: ``instances``,
``rewards``, ``trainer``, the pickled size of every Ray call's arguments and answer; ``ts``,
the bytes on the control process's trajectory-server socket, both ways, as its client counts
them, every frame with its length prefix, the connection's handshake left out), the ledger's
trajectory count (every trajectory submitted) and the core's counters. Printed side
by side per length: how often a trajectory was routed and interrupted (a sync, a migration or
a bounce interrupts it; it is routed again), the instance bytes per route, the bytes per
trajectory per peer kind and in total, and the ratios longest / shortest (target: about 1 —
the bytes do not grow with length). The last line is the verdict on that bar, on the raw
curve (re-admissions included): met when the mean total at the longest length exceeds the
one at the shortest by at most 1.96 standard errors of that difference (from the runs'
spread) and the per-1K-token slope of the fit on length alone is at most 1.96 of its
standard errors above zero; no verdict from one run per length. A second verdict, by the same
rule, leaves out the calls that only kept watch on live instances (a ``wait_results`` whose
time ran out and was made again, a quiet poll answered None: ``io_stats()["watch"]``): they
cost per instance and second whatever the trajectories carry, so their share of a trajectory
grows with how long it runs; they are printed per trajectory and per instance-second.

An instance is polled only when it has something to say (``actors.shell_io``): a command went
to it, or its ``wait_results`` call answered because a result is ready or because the
instance found the control side's view of it off (``SnapshotEncoder.due``, checked every
``actors.rollout.DRIFT_CHECK_S`` while it generates: trajectories started or left, the
waiting count moved, progress drifted past ``SNAPSHOT_TOLERANCE``); between polls the control
side extrapolates its view in time. A poll answer carries the snapshot as a delta
(``engine_adapters.SnapshotEncoder``): a trajectory's entry when it starts running or changes
pace (the samples of one prompt as one group), its end with the outcomes, and of the header
only the fields that changed (as numbers, not names). Ids travel packed by prompt (its id
prefix once, then the sample numbers: routes, interrupts, outcomes, ids that left); an
interrupt answers with the partial lengths in the order of the ids it was sent, so an
interrupted trajectory's outcome does not travel again with a poll. What a trajectory costs
is therefore its route, at most one snapshot entry (none if it starts and ends between two
polls, as short ones do), its outcome, its reward and its trainer ids, plus, each time it is
interrupted, the interrupt and its answer, its route and its entry again, and a share of the
polls: each costs a ``wait_results`` answer, a request and an answer with at least a delta's
counter. None of it counts tokens; what still varies between lengths is how often
trajectories are re-admitted (migrations, bounces, sync interruptions), which depends on
scheduling, and how many polls there are per trajectory: results spread over more polls when
trajectories run longer, and the pace corrections (an engine whose pace changes, as the sim
engines' does when the trainer takes the CPU) come per second of generation, not per
trajectory. So the benchmark also prints the bytes per call
(``ControlActor.io_stats()["by_call"]``) and of the parts of the poll answers (the snapshot
deltas, the outcomes: ``io_stats()["parts"]``), the instance polls per trajectory by why each was
sent (``io_stats()["polls"]``, see ``actors.shell_io.POLL_REASONS``: after a command, asked by
the instance's watcher, quiet, ...), the mean and spread over ``--repeats`` runs per
length (the lengths interleaved), and a least-squares fit of bytes per trajectory on length
(per 1K tokens) alone and on length and re-admissions per trajectory, with 95 % error bars
(from four runs on). Writes ``bench-results/control_bytes.json``.

    .venv/bin/python benchmarks/bench_control_bytes.py [--lengths 16,256,2048] [--steps 4] \
        [--repeats 3] [--eta 1] [--step-ms 1]
    .venv/bin/python benchmarks/bench_control_bytes.py --smoke   # 2 lengths, 2 steps
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
KINDS = ("instances", "ts", "rewards", "trainer")
#: KV capacity of each sim instance, in full-length trajectories (prompt + response), per
#: trajectory the instance may run (the example's ``rollout.max_running``): every length gets
#: the same headroom, so that no length runs its instances out of KV
KV_TRAJECTORIES_PER_RUNNING = 1.25


#: The sim engines' decode step by default, whatever they run (ms; ``--step-ms``)
STEP_MS = 1.0


def cost_model_file(directory: Path, step_ms: float) -> Path:
    """The engines' cost model as a coefficient file (a flat ``step_ms`` a decode step: the
    model's floor ``k2``), which the coordinator ranks by too."""
    from engine_adapters.cost_model import CostModel

    path = directory / "engine-cost-model.json"
    flat = {"k1": 0.0, "k2": step_ms / 1000, "k3": 0.0, "k4": 0.0, "name": f"flat-{step_ms}ms"}
    CostModel.from_dict(flat).save(path)
    return path


def overrides(
    run_dir: Path, length: int, steps: int, eta: int = 1, *, cost_model: Path
) -> list[str]:
    from staleflow_trainer.config import load_config

    example = load_config(EXAMPLES / "tiny.yaml", [])
    context = length + example.data.max_prompt_len  # the longest prompt and a full response
    kv = KV_TRAJECTORIES_PER_RUNNING * example.rollout.max_running * context
    return [
        f"protocol.eta={eta}",
        f"run_dir={run_dir}",
        "run.resume=never",
        f"trainer.steps={steps}",
        "trainer.micro_batch_size=8",  # 64 samples of up to 2K tokens per forward is too much
        "metrics.tensorboard=false",
        "metrics.progress_bar=false",
        "coordinator.snapshot_interval_s=0.1",
        "rollout.backend=sim",
        "sim.total_gpus=3",
        f"coordinator.cost_model={cost_model}",  # the engines' too (sim.cost_model: coordinator)
        f"sim.workload.response_len_median={length}",
        "sim.workload.response_len_sigma=0",
        f"rollout.sampling.max_new_tokens={length}",
        f"rollout.max_model_len={context}",
        f"sim.kv_capacity_tokens={round(kv)}",
        f"model.tiny.max_position_embeddings={max(256, context)}",
    ]


def run_length(
    run_dir: Path, length: int, steps: int, eta: int = 1, step_ms: float = STEP_MS
) -> dict[str, Any]:
    """One deployment at response length ``length``; its control bytes per trajectory."""
    import ray

    from staleflow_trainer.config import load_config
    from staleflow_trainer.runtime.wiring import Deployment

    run_dir.mkdir(parents=True, exist_ok=True)
    model = cost_model_file(run_dir, step_ms)
    cfg = load_config(
        EXAMPLES / "tiny.yaml", overrides(run_dir, length, steps, eta, cost_model=model)
    )
    dep = Deployment(cfg).start()
    try:
        t0 = time.perf_counter()
        summary = dep.run()
        wall_s = time.perf_counter() - t0
        io = dict(ray.get(dep.coordinator.io_stats.remote()))
        ledger = dep.ledger()
        wal = dict(ray.get(dep.coordinator.wal_stats.remote()))
    finally:
        dep.close()
    if ledger["problems"]:
        raise RuntimeError(f"the ledger does not balance at L={length}: {ledger['problems']}")
    n = int(ledger["trajectories"])
    tokens = int(summary["tokens_total"])
    per = {k: io.get(k, 0) / n for k in KINDS}
    total, watch = sum(per.values()), int(io.get("watch", 0))
    counters = summary["counters"]
    routes = int(counters["routes"])  # trajectory segments: each ran on one instance once
    return {
        "response_len": length,
        "steps": int(summary["steps_done"]),
        "trajectories": n,
        "consumed": int(ledger["consumed"]),
        "tokens_generated": tokens,
        "tokens_per_trajectory": tokens / n,
        "run_wall_s": wall_s,
        "journal_appends": int(wal["appends"]),  # about one per control cycle
        "instances_bytes_per_cycle": io.get("instances", 0) / max(1, int(wal["appends"])),
        # how often a trajectory was routed (its first route, and again after an interruption
        # by a sync, a migration or a bounce) and interrupted
        "routes_per_trajectory": routes / n,
        "interrupts_per_trajectory": int(counters["interrupts"]) / n,
        # of which migrations and bounces (the rest: protocol aborts); and the trajectories a
        # sync interrupted (they go back to the queue too)
        "migrations_per_trajectory": int(counters["migrations"]) / n,
        "bounces_per_trajectory": int(counters["bounces"]) / n,
        "sync_interrupts_per_trajectory": int(counters["sync_interrupts"]) / n,
        "syncs": int(counters["syncs"]),
        # every way back to the queue and onto an instance again (each costs an interrupt or a
        # sync's outcome, a route and an entry)
        "readmissions_per_trajectory": (
            int(counters["interrupts"]) + int(counters["sync_interrupts"])
        )
        / n,
        "instances_bytes_per_route": io.get("instances", 0) / max(1, routes),
        "bytes": {k: int(io.get(k, 0)) for k in KINDS},
        "bytes_per_trajectory": per,
        # per call: route, interrupt, sync, poll (request), poll_answer, wait_results, ...
        "bytes_per_trajectory_by_call": {
            k: v / n for k, v in sorted(dict(io.get("by_call", {})).items())
        },
        "total_bytes_per_trajectory": total,
        # of which the calls that only kept watch on a live instance (a wait_results whose time
        # ran out, a quiet poll answered None): a cost per instance and second, not per
        # trajectory, so its share grows with how long trajectories run, whatever they carry
        "watch_bytes_per_trajectory": watch / n,
        "watch_bytes_per_instance_s": watch / (cfg.rollout.num_instances * max(wall_s, 1e-9)),
        "total_without_watch_per_trajectory": total - watch / n,
        # instance polls per trajectory, by why each was sent (shell_io.POLL_REASONS); each
        # costs a request and an answer, and an "asked" one a wait_results answer too
        "polls_per_trajectory": {k: v / n for k, v in sorted(dict(io.get("polls", {})).items())},
        # what the instances' poll answers carry: the snapshot deltas (the starts reported, pace
        # corrections, header changes), the outcomes (ids, lengths, finish reasons), ...
        "bytes_per_trajectory_parts": {
            k: v / n for k, v in sorted(dict(io.get("parts", {})).items())
        },
    }


def _fit(runs: list[dict[str, Any]], get: Callable[[dict[str, Any]], float]) -> dict[str, Any]:
    """Least squares of ``get(run)`` (bytes per trajectory) over every run on response length
    (per 1K tokens) alone, and on length and re-admissions per trajectory: intercept, slopes and
    their standard errors; a model is None without runs enough to estimate its errors."""
    import numpy as np

    y = np.array([get(r) for r in runs], dtype=float)
    kx = np.array([r["response_len"] / 1000 for r in runs], dtype=float)
    ix = np.array([r["readmissions_per_trajectory"] for r in runs], dtype=float)

    def solve(names: list[str], x: Any) -> dict[str, float] | None:
        dof = len(y) - x.shape[1]
        if dof <= 0 or np.linalg.matrix_rank(x) < x.shape[1]:
            return None
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        resid = y - x @ coef
        se = np.sqrt(np.diag(float(resid @ resid) / dof * np.linalg.inv(x.T @ x)))
        out = {n: float(c) for n, c in zip(names, coef, strict=True)}
        return out | {f"{n}_se": float(e) for n, e in zip(names, se, strict=True)}

    ones = np.ones_like(y)
    return {
        "length_only": solve(["intercept", "per_1k_tokens"], np.column_stack([ones, kx])),
        "with_readmissions": solve(
            ["intercept", "per_1k_tokens", "per_readmission"], np.column_stack([ones, kx, ix])
        ),
    }


def _verdict(
    by_len: dict[int, list[dict[str, Any]]],
    fit: dict[str, Any] | None,
    key: str = "total_bytes_per_trajectory",
) -> dict[str, Any]:
    """Whether the bytes per trajectory (``key`` of each run: the total, or the total without
    the calls that only kept watch) grow with response length, on the raw curve
    (re-admissions included). "Does not grow" means both:

    * ``ratio``: the mean at the longest length exceeds the mean at the shortest by no more
      than the spread of the runs allows: the difference is at most 1.96 standard errors of
      the difference (from the runs' standard deviations; a one-sided 97.5 % band);
    * ``slope``: the per-1K-token slope of the least-squares fit on length alone is at most
      1.96 of its standard errors above zero (its 95 % interval reaches zero or below).

    ``met`` is None where the runs cannot tell (one run per length: no spread)."""
    lengths = sorted(by_len)
    lo = [float(r[key]) for r in by_len[lengths[0]]]
    hi = [float(r[key]) for r in by_len[lengths[-1]]]
    (m_lo, sd_lo), (m_hi, sd_hi) = _mean_sd(lo), _mean_sd(hi)
    out: dict[str, Any] = {"ratio": m_hi / m_lo, "difference": m_hi - m_lo}
    if len(lo) < 2 or len(hi) < 2 or fit is None:
        return out | {"met": None, "why": "needs --repeats >= 2 (a spread to compare with)"}
    se_d = (sd_lo**2 / len(lo) + sd_hi**2 / len(hi)) ** 0.5
    slope, se = float(fit["per_1k_tokens"]), float(fit["per_1k_tokens_se"])
    out |= {
        "difference_bound": 1.96 * se_d,
        "ratio_bound": 1 + 1.96 * se_d / m_lo,
        "ratio_ok": m_hi - m_lo <= 1.96 * se_d,
        "slope_per_1k_tokens": slope,
        "slope_95": [slope - 1.96 * se, slope + 1.96 * se],
        "slope_ok": slope <= 1.96 * se,
    }
    out["met"] = bool(out["ratio_ok"] and out["slope_ok"])
    return out


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
    return m, sd


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16,256,2048", help="response lengths, comma list")
    ap.add_argument("--steps", type=int, default=4, help="training steps per run")
    ap.add_argument("--eta", type=int, default=1, help="staleness bound of the runs (>= 0)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per length (>= 1)")
    ap.add_argument("--step-ms", type=float, default=STEP_MS, help="the engines' decode step")
    ap.add_argument("--smoke", action="store_true", help="lengths 16,256 and 2 steps")
    ap.add_argument("--out", default=None, help="default: bench-results/control_bytes.json")
    a = ap.parse_args(argv)
    lengths = [16, 256] if a.smoke else [int(x) for x in a.lengths.split(",") if x]
    steps = 2 if a.smoke else a.steps
    repeats = 1 if a.smoke else a.repeats
    if len(lengths) < 2 or any(x < 2 for x in lengths):
        ap.error(f"--lengths needs at least two lengths >= 2, got {a.lengths!r}")
    if a.eta < 0:
        ap.error(f"--eta must be >= 0, got {a.eta}")
    if repeats < 1:
        ap.error(f"--repeats must be >= 1, got {a.repeats}")
    if not 0 < a.step_ms <= 1000:
        ap.error(f"--step-ms must be in (0, 1000], got {a.step_ms}")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from staleflow_trainer.config import load_config
    from staleflow_trainer.runtime.prepare import init_ray

    started = init_ray(load_config(EXAMPLES / "tiny.yaml", []))
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-control-bytes-") as d:
            for rep in range(repeats):  # lengths interleaved: a slow spell hits every length
                for length in lengths:
                    r = run_length(Path(d) / f"L{length}-{rep}", length, steps, a.eta, a.step_ms)
                    runs.append({**r, "repeat": rep})
    finally:
        if started:
            ray.shutdown()
    by_len = {L: [r for r in runs if r["response_len"] == L] for L in lengths}

    def mean(L: int, get: Any) -> float:
        return _mean_sd([float(get(r)) for r in by_len[L]])[0]

    short, long_ = lengths[0], lengths[-1]
    ratio: dict[str, float | None] = {}
    for k in KINDS:
        lo = mean(short, lambda r, k=k: r["bytes_per_trajectory"][k])
        hi = mean(long_, lambda r, k=k: r["bytes_per_trajectory"][k])
        ratio[k] = hi / lo if lo else None
    ratio["instances_per_route"] = mean(long_, lambda r: r["instances_bytes_per_route"]) / mean(
        short, lambda r: r["instances_bytes_per_route"]
    )
    ratio["total"] = mean(long_, lambda r: r["total_bytes_per_trajectory"]) / mean(
        short, lambda r: r["total_bytes_per_trajectory"]
    )
    res = {
        "smoke": a.smoke,
        "eta": a.eta,
        "step_ms": a.step_ms,
        "repeats": repeats,
        "runs": runs,
        "ratio_longest_over_shortest": ratio,  # of the means over the repeats
        "length_ratio": long_ / short,
        "fit_total": _fit(runs, lambda r: r["total_bytes_per_trajectory"]),
        "verdict": None,  # filled in below, from the fit on length alone
        "fit_instances": _fit(runs, lambda r: r["bytes_per_trajectory"]["instances"]),
        "fit_without_watch": _fit(runs, lambda r: r["total_without_watch_per_trajectory"]),
        "verdict_without_watch": None,
    }
    res["verdict"] = _verdict(by_len, res["fit_total"]["length_only"])
    res["verdict_without_watch"] = _verdict(
        by_len, res["fit_without_watch"]["length_only"], "total_without_watch_per_trajectory"
    )
    out = Path(a.out) if a.out else ROOT / "bench-results" / "control_bytes.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    _print(res, lengths, by_len)
    return res


def _print_means(
    lengths: list[int], by_len: dict[int, list[Any]], field: str, digits: int, what: str
) -> None:
    """A table of the runs' per-key dict ``field``: one column per key, one row per length,
    each cell the mean over that length's runs (0 where a run lacks the key)."""
    keys = sorted({k for rs in by_len.values() for r in rs for k in r[field]})
    w = {k: max(8, len(k)) for k in keys}
    print(f"{'L':>6} " + " ".join(f"{k:>{w[k]}}" for k in keys) + f"   ({what})")
    for L in lengths:
        means = {k: _mean_sd([r[field].get(k, 0.0) for r in by_len[L]])[0] for k in keys}
        print(f"{L:>6} " + " ".join(f"{means[k]:>{w[k]}.{digits}f}" for k in keys))


def _print(res: dict[str, Any], lengths: list[int], by_len: dict[int, list[Any]]) -> None:
    runs = res["runs"]
    print(f"{'L':>6} {'rep':>3} {'traj':>5} {'tok/traj':>9} {'wall s':>7} {'cycles':>6} "
          f"{'routes':>6} {'intr':>5} {'inst B/rt':>9} "
          + " ".join(f"{k:>10}" for k in KINDS) + f" {'total':>10}   (per trajectory)")  # fmt: skip
    for r in runs:
        print(f"{r['response_len']:>6} {r['repeat']:>3} {r['trajectories']:>5} "
              f"{r['tokens_per_trajectory']:>9.1f} {r['run_wall_s']:>7.1f} "
              f"{r['journal_appends']:>6} {r['routes_per_trajectory']:>6.2f} "
              f"{r['interrupts_per_trajectory']:>5.2f} {r['instances_bytes_per_route']:>9.1f} "
              + " ".join(f"{r['bytes_per_trajectory'][k]:>10.1f}" for k in KINDS)
              + f" {r['total_bytes_per_trajectory']:>10.1f}")  # fmt: skip
    _print_means(lengths, by_len, "bytes_per_trajectory_by_call", 1, "mean B per trajectory")
    _print_means(lengths, by_len, "bytes_per_trajectory_parts", 1,
                 "mean B per trajectory, of the parts of the poll answers")  # fmt: skip
    _print_means(lengths, by_len, "polls_per_trajectory", 3,
                 "mean instance polls per trajectory, by why each was sent")  # fmt: skip
    print(f"{'L':>6} {'total B/traj mean ± sd':>24} {'instances mean ± sd':>22} "
          f"{'re-admissions/traj':>18} {'watch B/traj':>12} {'watch B/inst/s':>14} "
          f"{'total w/o watch':>15}")  # fmt: skip
    for L in lengths:
        rs = by_len[L]
        t = _mean_sd([r["total_bytes_per_trajectory"] for r in rs])
        i = _mean_sd([r["bytes_per_trajectory"]["instances"] for r in rs])
        n = _mean_sd([r["readmissions_per_trajectory"] for r in rs])
        w = _mean_sd([r["watch_bytes_per_trajectory"] for r in rs])
        ws = _mean_sd([r["watch_bytes_per_instance_s"] for r in rs])
        b = _mean_sd([r["total_without_watch_per_trajectory"] for r in rs])
        print(f"{L:>6} {t[0]:>15.1f} ± {t[1]:>5.1f} {i[0]:>13.1f} ± {i[1]:>5.1f} {n[0]:>18.2f} "
              f"{w[0]:>12.2f} {ws[0]:>14.2f} {b[0]:>9.1f} ± {b[1]:>3.1f}")  # fmt: skip
    rr = res["ratio_longest_over_shortest"]
    print(f"longest/shortest, of the means (L x{res['length_ratio']:.0f}): "
          + ", ".join(f"{k} {v:.2f}" if v is not None else f"{k} -" for k, v in rr.items()))  # fmt: skip
    for name in ("fit_total", "fit_instances", "fit_without_watch"):
        for model, f in res[name].items():
            if f is None:
                print(f"{name} {model}: not enough runs to estimate")
                continue
            terms = [k for k in f if k != "intercept" and not k.endswith("_se")]
            print(f"{name} {model}: B/traj = {f['intercept']:.1f} "
                  + " ".join(f"{f[k]:+.2f} ± {1.96 * f[k + '_se']:.2f} {k}" for k in terms)
                  + "  (± 95 %)")  # fmt: skip
    _print_verdict("bar (bytes per trajectory do not grow with length)", res["verdict"])
    _print_verdict("the same without the calls that only kept watch on live instances",
                   res["verdict_without_watch"])  # fmt: skip


def _print_verdict(what: str, v: dict[str, Any]) -> None:
    if v["met"] is None:
        print(f"{what}: no verdict, {v['why']}; longest/shortest {v['ratio']:.2f}")
        return
    lo, hi = v["slope_95"]
    print(f"{what}: "
          f"{'MET' if v['met'] else 'MISSED'} -- longest/shortest {v['ratio']:.2f} "
          f"({v['difference']:+.1f} B; the spread allows up to {v['ratio_bound']:.2f}, "
          f"+{v['difference_bound']:.1f} B: {'ok' if v['ratio_ok'] else 'over'}), "
          f"slope {v['slope_per_1k_tokens']:+.2f} B per 1K tokens, 95 % [{lo:+.2f}, {hi:+.2f}] "
          f"({'reaches zero' if v['slope_ok'] else 'above zero'})")  # fmt: skip


if __name__ == "__main__":
    main()
