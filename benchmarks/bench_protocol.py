"""Steady-state staleness-protocol workload: per-operation latency percentiles.

B = 64 groups x n = 16 (n' = 18 with group redundancy), eta = 10, B' = 72 (batch redundancy):
about 11 buffers x 72 groups x 18 members > 10,000 trajectories in flight. Rollout instances
sit at the current version or a few versions behind; finishes arrive in random order, so
stragglers keep buffers open the way long-tailed responses do. Every protocol call is timed
on its own with perf_counter_ns; warm-up steps (pipeline filling) are excluded.

Writes bench-results/protocol.json and prints the numbers next to their targets.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from pathlib import Path

from staleness_protocol import ProtocolConfig, StalenessProtocol

MEDIAN_TICKS = 10.0
SIGMA = 0.15  # spread of log-lengths; the 1% 5x tail supplies the stragglers
TARGETS = {"per_trajectory_p50_us": 5.0, "per_trajectory_p99_us": 50.0, "consume_p50_us": 1000.0}


def pct(xs: list[int], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] / 1000.0  # ns -> us


def run(steps: int, warmup: int, seed: int) -> dict[str, float | int | str]:
    cfg = ProtocolConfig(
        batch_size=64,
        group_size=16,
        eta=10,
        batch_redundancy=8,
        group_redundancy=2,
        stuck_threshold=4,
    )
    p = StalenessProtocol(cfg)
    rng = random.Random(seed)
    clock = time.perf_counter_ns
    t_can: list[int] = []
    t_res: list[int] = []
    t_fin: list[int] = []
    t_con: list[int] = []
    # Virtual time: each trajectory's generation takes a log-normal number of ticks (median
    # MEDIAN_TICKS) with a 1% tail 5x longer; a tick is one admission/finish/consume round.
    events: list[tuple[float, int]] = []  # (finish tick, trajectory id)
    running: set[int] = set()
    next_tid = 0
    next_gid = 0
    now = 0.0
    in_flight_samples: list[int] = []
    live_samples: list[int] = []
    aborted = 0
    measuring = False
    while p.current_version < steps:
        measuring = p.current_version >= warmup
        c = p.current_version
        # admission: fill free slots with new prompts from instances at c or a bit behind
        while True:
            v = c if rng.random() < 0.7 else max(0, c - rng.randint(1, 3))
            gid = next_gid
            t0 = clock()
            ok = p.can_reserve(gid, v)
            t1 = clock()
            if measuring:
                t_can.append(t1 - t0)
            if not ok:
                if v == c:
                    break
                continue
            next_gid += 1
            for _ in range(cfg.samples_per_group):
                t0 = clock()
                p.reserve(gid, next_tid, v)
                t1 = clock()
                if measuring:
                    t_res.append(t1 - t0)
                length = rng.lognormvariate(math.log(MEDIAN_TICKS), SIGMA)
                if rng.random() < 0.01:
                    length *= 5
                heapq.heappush(events, (now + length, next_tid))
                running.add(next_tid)
                next_tid += 1
        if measuring:
            in_flight_samples.append(len(running))
            counts = p.stats().trajectories_by_state
            live_samples.append(counts["in_flight"] + counts["finished"] + counts["occupied"])
        # generation: everything due by the end of this tick finishes (rewarded)
        now += 1.0
        while events and events[0][0] <= now:
            _, tid = heapq.heappop(events)
            if tid not in running:
                continue  # aborted earlier (group surplus / batch surplus)
            running.discard(tid)
            t0 = clock()
            p.finish(tid)
            t1 = clock()
            if measuring:
                t_fin.append(t1 - t0)
            for a in p.take_aborts():
                running.discard(a.trajectory_id)  # type: ignore[arg-type]
                aborted += 1
        while p.ready():
            t0 = clock()
            p.consume()
            t1 = clock()
            if p.current_version > warmup:
                t_con.append(t1 - t0)
        if not p.ready():
            p.resolve_stuck()
            for a in p.take_aborts():
                running.discard(a.trajectory_id)  # type: ignore[arg-type]
                aborted += 1
        p.take_replacements()

    stats = p.stats()
    out: dict[str, float | int | str] = {
        "workload": "B=64 n=16 (n'=18) eta=10 B'=72, log-normal lengths + 1% 5x tail, instances at v..v-3",
        "steps": steps,
        "warmup_steps": warmup,
        "running_mean": round(sum(in_flight_samples) / max(1, len(in_flight_samples))),
        "running_min": min(in_flight_samples, default=0),
        "live_mean": round(sum(live_samples) / max(1, len(live_samples))),
        "ops_measured": len(t_can) + len(t_res) + len(t_fin) + len(t_con),
        "aborts": aborted,
        "staleness_histogram": json.dumps(stats.staleness_histogram),
        "python": sys.version.split()[0],
    }
    for name, xs in (
        ("can_reserve", t_can),
        ("reserve", t_res),
        ("finish", t_fin),
        ("consume", t_con),
    ):
        out[f"{name}_us_p50"] = round(pct(xs, 0.50), 3)
        out[f"{name}_us_p99"] = round(pct(xs, 0.99), 3)
        out[f"{name}_n"] = len(xs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-results/protocol.json")
    args = ap.parse_args()
    res = run(args.steps, args.warmup, args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    per_traj = ("can_reserve", "reserve", "finish")
    print(f"protocol bench: {res['workload']}")
    print(
        f"  running trajectories: mean {res['running_mean']}, min {res['running_min']}; "
        f"admitted-not-consumed mean {res['live_mean']}; ops timed {res['ops_measured']}"
    )
    print(f"  consumed staleness histogram: {res['staleness_histogram']}")
    for name in (*per_traj, "consume"):
        p50, p99 = res[f"{name}_us_p50"], res[f"{name}_us_p99"]
        t50 = TARGETS["consume_p50_us"] if name == "consume" else TARGETS["per_trajectory_p50_us"]
        t99 = "" if name == "consume" else f" (target {TARGETS['per_trajectory_p99_us']:g})"
        print(f"  {name:<12} p50 {p50:>9.2f} us (target {t50:g})   p99 {p99:>9.2f} us{t99}")
    print(f"  wrote {args.out}")


if __name__ == "__main__":
    main()
