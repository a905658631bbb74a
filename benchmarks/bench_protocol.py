"""Staleness-protocol cost: flat as a run grows, and per operation as the load grows.

Two measurements, printed side by side and written to ``bench-results/protocol.json``:

1. **A long run** (default 10,000 training steps) at B = 64 groups x n = 16 (n' = 18 with
   group redundancy), eta = 10, B' = 72 (batch redundancy), stuck resolution on: about 11,000
   trajectories running. Rollout instances sit at the published version or up to three
   versions behind; lengths are log-normal with a 1 % tail 5x longer, so stragglers keep
   buffers open; the trainer consumes a READY buffer, trains for one tick and publishes.
   At step 100 and at the last step it records the checkpoint size (``to_dict`` as JSON
   bytes), the ``to_dict`` time, what the ledger holds, and the p50 / p99 of every protocol
   call over the ``--window`` steps before that point (each call timed on its own).
2. **A scale curve**: the same per-call percentiles with 10 K to 1 M trajectories in flight
   (eta = 10, n' = 18, B' = 9/8 B, B grown to reach each load; every buffer filled with
   reservations, then buffers finished, consumed, published and refilled for a few steps).

Targets: p50 of every per-trajectory call (can_reserve, reserve, finish) <= 5 us, consume
<= 1 ms at B = 64 (a larger B consumes more trajectories: the curve also shows consume per
consumed trajectory). ``--smoke`` runs a short version of both in a few seconds.

    python benchmarks/bench_protocol.py [--steps 10000] [--smoke]
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

from staleness_protocol import Abort, Admission, ProtocolConfig, StalenessProtocol

MEDIAN_TICKS = 10.0
SIGMA = 0.15  # spread of log-lengths; the 1% 5x tail supplies the stragglers
TARGETS = {"per_trajectory_p50_us": 5.0, "consume_p50_us": 1000.0}
PER_TRAJECTORY = ("can_reserve", "reserve", "finish")
OPS = (*PER_TRAJECTORY, "consume")
ADMIT = Admission.ADMIT
clock = time.perf_counter_ns


def pct(xs: list[int], q: float) -> float:
    """The q-quantile of nanosecond samples, in microseconds (0 when there are none)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] / 1000.0


def summarize(times: dict[str, list[int]]) -> dict[str, float | int]:
    out: dict[str, float | int] = {}
    for name in OPS:
        out[f"{name}_us_p50"] = round(pct(times[name], 0.50), 3)
        out[f"{name}_us_p99"] = round(pct(times[name], 0.99), 3)
        out[f"{name}_n"] = len(times[name])
    return out


def checkpoint_cost(p: StalenessProtocol) -> dict[str, float | int]:
    """Size of the checkpoint and the time ``to_dict`` takes (median of 5)."""
    runs = []
    for _ in range(5):
        t0 = clock()
        d = p.to_dict()
        runs.append(clock() - t0)
    runs.sort()
    stats = p.stats()
    return {
        "checkpoint_bytes": len(json.dumps(d)),
        "to_dict_ms": round(runs[2] / 1e6, 3),
        "ledger_trajectories": len(d["trajectories"]),
        "ledger_groups": len(d["groups"]),
        "tombstones": stats.tombstones,
        "trajectories_ever": sum(stats.trajectories_by_state.values()),
    }


# ------------------------------------------------------------------------------ long run


def long_run(steps: int, points: tuple[int, ...], window: int, seed: int) -> dict[str, Any]:
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
    events: list[tuple[float, int]] = []  # (finish tick, trajectory id)
    running: set[int] = set()
    next_tid = next_gid = 0
    now = 0.0
    training = False  # a consumed step trains for one tick, then its version is published
    at: dict[int, dict[str, Any]] = {}
    times: dict[str, list[int]] = {name: [] for name in OPS}
    running_samples: list[int] = []
    t_start = time.perf_counter()
    while len(at) < len(points):
        c = p.next_buffer
        timed = any(pt - window <= c < pt for pt in points)
        published = p.published_version
        # admission: fill free slots with new prompts from instances at the published
        # version or a bit behind
        while True:
            v = published if rng.random() < 0.7 else max(0, published - rng.randint(1, 3))
            gid = next_gid
            t0 = clock()
            answer = p.can_reserve(gid, v)
            t1 = clock()
            if timed:
                times["can_reserve"].append(t1 - t0)
            if answer is not ADMIT:
                if v == published:
                    break
                continue
            next_gid += 1
            for _ in range(cfg.samples_per_group):
                t0 = clock()
                p.reserve(gid, next_tid, v)
                t1 = clock()
                if timed:
                    times["reserve"].append(t1 - t0)
                length = rng.lognormvariate(math.log(MEDIAN_TICKS), SIGMA)
                if rng.random() < 0.01:
                    length *= 5
                heapq.heappush(events, (now + length, next_tid))
                running.add(next_tid)
                next_tid += 1
        if timed:
            running_samples.append(len(running))
        # generation: everything due by the end of this tick finishes (rewarded)
        now += 1.0
        while events and events[0][0] <= now:
            _, tid = heapq.heappop(events)
            if tid not in running:
                continue  # aborted earlier (group surplus / batch surplus / stuck)
            running.discard(tid)
            t0 = clock()
            p.finish(tid)
            t1 = clock()
            if timed:
                times["finish"].append(t1 - t0)
        # the trainer: publish what trained last tick, consume the next READY buffer
        if training:
            p.publish(p.next_buffer)
            training = False
        if p.ready():
            t0 = clock()
            p.consume()
            t1 = clock()
            if timed:
                times["consume"].append(t1 - t0)
            training = True
            c = p.next_buffer
            if c in points and c not in at:
                gc.collect()
                at[c] = {**checkpoint_cost(p), **summarize(times)}
                at[c]["running_mean"] = round(sum(running_samples) / max(1, len(running_samples)))
                at[c]["wall_s_so_far"] = round(time.perf_counter() - t_start, 1)
                times = {name: [] for name in OPS}
                running_samples = []
        else:
            p.resolve_stuck()
        for n in p.take_notices():
            if isinstance(n, Abort):
                running.discard(n.trajectory_id)  # type: ignore[arg-type]
    stats = p.stats()
    return {
        "workload": (
            "B=64 n=16 (n'=18) eta=10 B'=72 stuck_threshold=4, log-normal lengths + 1% 5x "
            "tail, instances at the published version..3 behind, one tick of training"
        ),
        "steps": steps,
        "window_steps": window,
        "at_step": {str(k): v for k, v in sorted(at.items())},
        "aborts_by_reason": stats.aborts_by_reason,
        "staleness_histogram": stats.staleness_histogram,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }


# --------------------------------------------------------------------------- scale curve


def scale_point(batch: int, rounds: int, seed: int) -> dict[str, Any]:
    """``rounds`` steady steps with every buffer full of reservations at B = ``batch``."""
    cfg = ProtocolConfig(
        batch_size=batch,
        group_size=16,
        eta=10,
        batch_redundancy=max(1, batch // 8),
        group_redundancy=2,
    )
    p = StalenessProtocol(cfg)
    rng = random.Random(seed)
    members: dict[int, list[int]] = {}  # group -> its trajectory ids
    by_buffer: dict[int, list[int]] = {}  # reservation buffer -> groups
    times: dict[str, list[int]] = {name: [] for name in OPS}
    next_gid = next_tid = 0

    def admit(record: bool) -> None:
        nonlocal next_gid, next_tid
        v = p.published_version
        while True:
            gid = next_gid
            t0 = clock()
            answer = p.can_reserve(gid, v)
            t1 = clock()
            if record:
                times["can_reserve"].append(t1 - t0)
            if answer is not ADMIT:
                return
            next_gid += 1
            ids = []
            for _ in range(cfg.samples_per_group):
                t0 = clock()
                b = p.reserve(gid, next_tid, v)
                t1 = clock()
                if record:
                    times["reserve"].append(t1 - t0)
                ids.append(next_tid)
                next_tid += 1
            members[gid] = ids
            by_buffer.setdefault(b, []).append(gid)

    admit(record=False)
    in_flight = len(p.in_flight())
    for r in range(rounds):
        record = r > 0  # the first round warms up
        c = p.next_buffer
        groups = by_buffer.pop(c, [])
        rng.shuffle(groups)
        for gid in groups[: cfg.batch_size]:
            ids = members.pop(gid)
            rng.shuffle(ids)
            for tid in ids[: cfg.group_size]:
                t0 = clock()
                p.finish(tid)
                t1 = clock()
                if record:
                    times["finish"].append(t1 - t0)
        for gid in groups[cfg.batch_size :]:
            members.pop(gid, None)  # batch surplus: aborted when the buffer became READY
        p.take_notices()
        t0 = clock()
        taken = p.consume()
        t1 = clock()
        if record:
            times["consume"].append(t1 - t0)
        p.publish(taken.version + 1)
        admit(record)
    out: dict[str, Any] = {"batch_size": batch, "in_flight": in_flight, **summarize(times)}
    consumed = cfg.batch_size * cfg.group_size
    out["consume_us_per_trajectory"] = round(float(out["consume_us_p50"]) / consumed, 4)
    return out


# ---------------------------------------------------------------------------------- main


def verdict(res: dict[str, Any]) -> dict[str, bool]:
    """Each target met at every measured point of the long run?"""
    ok: dict[str, bool] = {}
    for point in res["long_run"]["at_step"].values():
        for name in PER_TRAJECTORY:
            key = f"{name}_p50_le_5us"
            ok[key] = ok.get(key, True) and point[f"{name}_us_p50"] <= TARGETS["per_trajectory_p50_us"]
        ok["consume_p50_le_1ms"] = ok.get("consume_p50_le_1ms", True) and (
            point["consume_us_p50"] <= TARGETS["consume_p50_us"]
        )
    return ok


def report(res: dict[str, Any]) -> None:
    lr = res["long_run"]
    (k0, a), (k1, b) = list(lr["at_step"].items())[:2]
    print(f"protocol bench: {lr['workload']}")
    print(f"  long run: {lr['steps']} steps in {lr['wall_s']} s; consumed staleness "
          f"{lr['staleness_histogram']}")  # fmt: skip
    print(f"  {'':<26}{'step ' + k0:>14}{'step ' + k1:>14}{'ratio':>9}")
    rows = [
        ("checkpoint bytes", "checkpoint_bytes"),
        ("to_dict ms", "to_dict_ms"),
        ("ledger trajectories", "ledger_trajectories"),
        ("tombstones", "tombstones"),
        ("trajectories ever", "trajectories_ever"),
        ("running (mean)", "running_mean"),
        *[(f"{op} p50 us", f"{op}_us_p50") for op in OPS],
        *[(f"{op} p99 us", f"{op}_us_p99") for op in OPS],
    ]
    for label, key in rows:
        x, y = a[key], b[key]
        ratio = f"{y / x:.2f}" if x else "-"
        print(f"  {label:<26}{x:>14}{y:>14}{ratio:>9}")
    print(f"  scale curve (eta=10, n'=18, B'=9/8 B):")
    print(f"  {'in flight':>10}{'B':>6}" + "".join(f"{op + ' p50':>16}" for op in OPS)
          + f"{'consume/traj':>14}")  # fmt: skip
    for s in res["scale"]:
        print(f"  {s['in_flight']:>10}{s['batch_size']:>6}"
              + "".join(f"{s[f'{op}_us_p50']:>13.2f} us" for op in OPS)
              + f"{s['consume_us_per_trajectory']:>11.3f} us")  # fmt: skip
    print(f"  targets (p50 per-trajectory call <= 5 us, consume <= 1 ms at B=64): "
          f"{res['meets_targets']}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000, help="training steps of the long run")
    ap.add_argument("--window", type=int, default=20, help="steps timed before each point")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", default="64,192,640,1920,4480", help="batch sizes of the curve")
    ap.add_argument("--rounds", type=int, default=3, help="steps per scale point")
    ap.add_argument("--smoke", action="store_true", help="a short run of both (seconds)")
    ap.add_argument("--out", default="bench-results/protocol.json")
    a = ap.parse_args(argv)
    if a.smoke:
        a.steps, a.window, a.scale, a.rounds = 40, 5, "64,128", 2
    first = min(100, a.steps // 4)
    res: dict[str, Any] = {
        "python": sys.version.split()[0],
        "smoke": a.smoke,
        "long_run": long_run(a.steps, (first, a.steps), a.window, a.seed),
        "scale": [scale_point(int(b), a.rounds, a.seed) for b in a.scale.split(",")],
        "targets": TARGETS,
    }
    res["meets_targets"] = verdict(res)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    report(res)
    print(f"  wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
