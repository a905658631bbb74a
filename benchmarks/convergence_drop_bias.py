"""What dropping-based strict async trains on when responses have a long tail (simulator).

The convergence study's task has one-token answers, so ``coarse-async-drop`` (one FIFO, a group
older than ``current − η`` dropped) cannot drop by length there. This runs the same two
policies the study compares at η = 3 — StaleFlow and ``coarse-async-drop`` — in the simulator
(the same control core, simulated engines, virtual time) on a long-tailed length workload
(log-normal, median 300 tokens, σ = 1, cap 4,096), and reports per policy and seed: the mean
response length of the *trained* samples, trajectories dropped and why, tokens generated and
trained, and the virtual time of the run. Writes ``results/convergence/drop_bias_sim.json``.

    python benchmarks/convergence_drop_bias.py            # seeds 0,1; ~1 min
    python benchmarks/convergence_drop_bias.py --seeds 0-4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "convergence" / "drop_bias_sim.json"
POLICIES = ("staleflow", "coarse-async-drop")
WORKLOAD = {
    "steps": 30, "batch_size": 8, "group_size": 4, "total_gpus": 4, "rollout_gpus": 2,
    "train_gpus": 2, "max_running": 64, "kv_capacity_tokens": 200_000, "prompt_len": 64,
    "prompt_len_max": 128, "response_len_median": 300, "response_len_sigma": 1.0,
    "max_response_len": 4096, "trainer_time_a_s": 1.0, "trainer_time_b_s_per_token": 2e-5,
    "cycle_period_s": 0.1, "warmup_steps": 2,
}  # fmt: skip


def run(policy: str, seed: int, eta: int) -> dict[str, Any]:
    from staleflow_trainer.sim import Simulation, with_policy
    from staleflow_trainer.sim.testing import sim_config

    sim = Simulation(with_policy(sim_config(**WORKLOAD, seed=seed), policy, eta))
    sim.run()
    steps = sim.rec.steps
    samples = sum(int(r["samples"]) for r in steps)
    trained = sum(int(r["response_tokens"]) for r in steps)
    return {
        "policy": policy,
        "eta": eta,
        "seed": seed,
        "trained_samples": samples,
        "trained_response_tokens_per_sample": trained / samples,
        "trained_response_tokens": trained,
        "generated_tokens": sim.core.report.gen_total,
        "dropped": dict(sim.core.ledger.dropped_reasons),
        "virtual_s": steps[-1]["time_s"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1", help="'0,1' or '0-4'")
    ap.add_argument("--eta", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if "-" in args.seeds:
        lo, hi = (int(x) for x in args.seeds.split("-", 1))
        seeds = list(range(lo, hi + 1))
    else:
        seeds = [int(x) for x in args.seeds.split(",")]
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    t0 = time.monotonic()
    runs = []
    for seed in seeds:
        for policy in POLICIES:
            r = run(policy, seed, args.eta)
            runs.append(r)
            print(
                f"seed {seed} {policy:18s} trained length "
                f"{r['trained_response_tokens_per_sample']:6.1f} tokens  dropped {r['dropped']}  "
                f"generated {r['generated_tokens']:,} trained {r['trained_response_tokens']:,}  "
                f"{r['virtual_s']:.0f} virtual s",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"workload": WORKLOAD, "runs": runs}, indent=1) + "\n")
    print(f"wrote {args.out} ({len(runs)} runs, {time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
