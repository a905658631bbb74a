"""Soak run on the simulator: many steps at many instances with random instance deaths and
restarts (and optionally trainer crashes that restart the app from its last checkpoint); the
trajectory ledger is checked after every fault and at the end.

    .venv/bin/python benchmarks/soak_sim.py                 # 10,000 steps x 128 instances
    .venv/bin/python benchmarks/soak_sim.py --steps 500     # the short version

Writes bench-results/soak_sim.json and prints the figures (docs/reliability.md quotes them).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import structlog

from staleflow_trainer.sim.faults import FaultPlan, FaultySimulation, faulty_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--instances", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--eta", type=int, default=2)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--death-rate", type=float, default=1.0, help="instance deaths per second")
    ap.add_argument("--down-s", type=float, default=5.0)
    ap.add_argument("--crash-rate", type=float, default=0.002, help="trainer crashes per second")
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument(
        "--check-every-fault",
        action="store_true",
        help="full ledger check after every fault (slow at this size)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-results/soak_sim.json")
    a = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    cfg = faulty_config(
        checkpoint_every=a.checkpoint_every,
        instances=a.instances,
        steps=a.steps,
        batch=a.batch,
        group=a.group,
        eta=a.eta,
        seed=a.seed,
        response_len_median=a.response_len,
    )
    plan = FaultPlan(
        seed=a.seed,
        instance_death_rate=a.death_rate,
        down_s=a.down_s,
        trainer_crash_rate=a.crash_rate,
        check_every_fault=a.check_every_fault,
    )
    t0 = time.perf_counter()
    sim = FaultySimulation(cfg, plan)
    sim.run()  # ends with the ledger check; raises if anything was lost or double counted
    wall = time.perf_counter() - t0
    counts = sim.check()
    hist = {str(k): v for k, v in sorted(sim.core.protocol.stats().staleness_histogram.items())}
    admitted = sum(sim.core.protocol.stats().trajectories_by_state.values())
    result = {
        "steps": sim.core.steps_done,
        "steps_trained_incl_rolled_back": sim.steps_trained,
        "instances": a.instances,
        "batch": a.batch,
        "group": a.group,
        "eta": a.eta,
        "virtual_s": round(sim.now, 1),
        "wall_s": round(wall, 1),
        "faults": sim.faults,
        "ledger": counts,
        "admitted": admitted,
        "consumed_staleness_hist": hist,
        "max_consumed_staleness": max(int(k) for k in hist) if hist else 0,
        "balanced": counts["consumed"] == sum(hist.values()) == sim.core.steps_done * a.batch * a.group,
        "plan": {"death_rate": a.death_rate, "down_s": a.down_s, "crash_rate": a.crash_rate,
                 "checkpoint_every": a.checkpoint_every, "seed": a.seed},
    }  # fmt: skip
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    if not result["balanced"]:
        raise SystemExit("ledger does not balance")


if __name__ == "__main__":
    main()
