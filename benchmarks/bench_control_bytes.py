"""Bytes that cross the control process per trajectory, against response length.

The control process (the Ray control actor) carries ids, versions and token counts; prompts,
responses, log-probs and rewards' inputs go between the trajectory server, the instances, the
reward workers and the trainer directly. This benchmark checks that on the real deployment
(``staleflow_trainer.wiring.Deployment``: Ray, the trajectory server over TCP, the NIXL
parameter server, the real trainer) with sim engine instances: ``examples/tiny.yaml`` (B x n =
8 x 8, 2 instances; ``--eta``, default 1), one run per response length ``L`` (every response
is ``L`` or ``L - 1`` tokens: ``sim.workload.response_len_median=L``, sigma 0, capped at
``max_new_tokens=L``). The sim engines use a fast custom cost model (0.1 ms per decode step),
so a run's wall time is mostly training and control, not generation.

After each run it reads ``ControlActor.io_stats()`` (the pickled size of every call's
arguments and answer, per peer kind: ``instances``, ``ts``, ``rewards``, ``trainer``), the
ledger's trajectory count (every trajectory submitted) and the core's counters. Printed side
by side per length: how often a trajectory was routed and interrupted (a sync, a migration or
a bounce interrupts it; it is routed again), the instance bytes per route, the bytes per
trajectory per peer kind and in total, and the ratios longest / shortest (target: about 1 —
the bytes do not grow with length).

An instance is polled only when it has something to say (``actors.shell_io``): a command went
to it, or its ``wait_results`` call answered because a result is ready or because the
instance found the control side's view of it off (``SnapshotEncoder.due``, checked every
``actors.rollout.DRIFT_CHECK_S`` while it generates: trajectories started or left, the
waiting count moved, progress drifted past ``SNAPSHOT_TOLERANCE``); between polls the control
side extrapolates its view in time. A poll answer carries the snapshot as a delta
(``engine_adapters.SnapshotEncoder``): a trajectory's entry when it starts running or changes
pace (the samples of one prompt as one group), its end with the outcomes, and of the header
only the fields that changed. What a trajectory costs is therefore its route, at most one
snapshot entry (none if it starts and ends between two polls, as short ones do), its outcome,
its reward and its trainer ids, plus, each time it is interrupted, the interrupt, its outcome,
its route and its entry again, and a share of the corrections while an engine's pace changes.
None of it counts tokens; what still varies between lengths is how often trajectories are
interrupted and re-admitted, which depends on the timing of syncs against generation. Writes
``bench-results/control_bytes.json``.

    .venv/bin/python benchmarks/bench_control_bytes.py [--lengths 16,256,2048] [--steps 4]
    .venv/bin/python benchmarks/bench_control_bytes.py --smoke   # 2 lengths, 2 steps
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
KINDS = ("instances", "ts", "rewards", "trainer")
PROMPT_MAX = 16  # examples/tiny.yaml's data.max_prompt_len


def overrides(run_dir: Path, length: int, steps: int, eta: int = 1) -> list[str]:
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
        "sim.rollout_gpus=2",
        "sim.cost_model=custom",
        "sim.k1=0",
        "sim.k2=0.0001",
        "sim.k3=0",
        "sim.k4=0",
        f"sim.workload.response_len_median={length}",
        "sim.workload.response_len_sigma=0",
        f"rollout.sampling.max_new_tokens={length}",
        f"rollout.max_model_len={length + PROMPT_MAX}",
        f"model.tiny.max_position_embeddings={max(256, length + PROMPT_MAX)}",
    ]


def run_length(run_dir: Path, length: int, steps: int, eta: int = 1) -> dict[str, Any]:
    """One deployment at response length ``length``; its control bytes per trajectory."""
    import ray

    from staleflow_trainer.config import load_config
    from staleflow_trainer.wiring import Deployment

    cfg = load_config(EXAMPLES / "tiny.yaml", overrides(run_dir, length, steps, eta))
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
        "instances_bytes_per_route": io.get("instances", 0) / max(1, routes),
        "bytes": {k: int(io.get(k, 0)) for k in KINDS},
        "bytes_per_trajectory": per,
        "total_bytes_per_trajectory": sum(per.values()),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16,256,2048", help="response lengths, comma list")
    ap.add_argument("--steps", type=int, default=4, help="training steps per run")
    ap.add_argument("--eta", type=int, default=1, help="staleness bound of the runs (>= 0)")
    ap.add_argument("--smoke", action="store_true", help="lengths 16,256 and 2 steps")
    ap.add_argument("--out", default=None, help="default: bench-results/control_bytes.json")
    a = ap.parse_args(argv)
    lengths = [16, 256] if a.smoke else [int(x) for x in a.lengths.split(",") if x]
    steps = 2 if a.smoke else a.steps
    if len(lengths) < 2 or any(x < 2 for x in lengths):
        ap.error(f"--lengths needs at least two lengths >= 2, got {a.lengths!r}")
    if a.eta < 0:
        ap.error(f"--eta must be >= 0, got {a.eta}")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from staleflow_trainer.config import load_config
    from staleflow_trainer.prepare import init_ray

    started = init_ray(load_config(EXAMPLES / "tiny.yaml", []))
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-control-bytes-") as d:
            for length in lengths:
                runs.append(run_length(Path(d) / f"L{length}", length, steps, a.eta))
    finally:
        if started:
            ray.shutdown()
    short, long_ = runs[0], runs[-1]
    ratio = {
        k: (long_["bytes_per_trajectory"][k] / short["bytes_per_trajectory"][k])
        if short["bytes_per_trajectory"][k]
        else None
        for k in KINDS
    }
    ratio["instances_per_route"] = (
        long_["instances_bytes_per_route"] / short["instances_bytes_per_route"]
    )
    res = {
        "smoke": a.smoke,
        "eta": a.eta,
        "runs": runs,
        "ratio_longest_over_shortest": {
            **ratio,
            "total": long_["total_bytes_per_trajectory"] / short["total_bytes_per_trajectory"],
        },
        "length_ratio": long_["response_len"] / short["response_len"],
    }
    out = Path(a.out) if a.out else ROOT / "bench-results" / "control_bytes.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"{'L':>6} {'traj':>5} {'tok/traj':>9} {'wall s':>7} {'cycles':>6} {'routes':>6} "
          f"{'intr':>5} {'inst B/rt':>9} "
          + " ".join(f"{k:>10}" for k in KINDS) + f" {'total':>10}   (per trajectory)")  # fmt: skip
    for r in runs:
        print(f"{r['response_len']:>6} {r['trajectories']:>5} {r['tokens_per_trajectory']:>9.1f} "
              f"{r['run_wall_s']:>7.1f} {r['journal_appends']:>6} "
              f"{r['routes_per_trajectory']:>6.2f} {r['interrupts_per_trajectory']:>5.2f} "
              f"{r['instances_bytes_per_route']:>9.1f} "
              + " ".join(f"{r['bytes_per_trajectory'][k]:>10.1f}" for k in KINDS)
              + f" {r['total_bytes_per_trajectory']:>10.1f}")  # fmt: skip
    rr = res["ratio_longest_over_shortest"]
    print(f"longest/shortest (L x{res['length_ratio']:.0f}): "
          + ", ".join(f"{k} {v:.2f}" if v is not None else f"{k} -" for k, v in rr.items()))  # fmt: skip
    return res


if __name__ == "__main__":
    main()
