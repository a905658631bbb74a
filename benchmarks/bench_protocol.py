"""Staleness-protocol cost: flat as a run grows, and per operation as the load grows.

Two measurements, printed side by side and written to ``bench-results/protocol.json``:

1. **A long run** (default 2,000 training steps; ``--steps 10000`` for the long version) at
   B = 64 groups x n = 16 (n' = 18 with group redundancy), eta = 10, B' = 72 (batch redundancy),
   stuck resolution on: about 11,000 trajectories running. Rollout instances sit at the
   published version or up to three versions behind; lengths are log-normal with a 1 % tail 5x
   longer, so stragglers keep buffers open; the trainer consumes a READY buffer, trains for one
   tick and publishes. The run keeps a copy of its state (protocol and workload) at step 100
   and at the last step; then it times ``--window`` steps from each copy, alternating
   ``--rounds`` times so both see the same machine load, and records the checkpoint size
   (``to_dict`` as JSON bytes), the ``to_dict`` time, what the ledger holds, and the p50 / p99
   of every protocol call (each timed on its own).
2. **A scale curve**: the same per-call percentiles with 10 K to 1 M trajectories in flight
   (eta = 10, n' = 18, B' = 9/8 B, B the smallest that reaches each load; every buffer filled
   with reservations, then buffers finished, consumed, published and refilled for a few
   steps), with the checkpoint size and ``to_dict`` time at each load and the growth ratio of
   every figure from one point to the next.

Targets: p50 of every per-trajectory call (can_reserve, reserve, finish) <= 5 us, consume
<= 1 ms at B = 64 (a larger B consumes more trajectories: the curve also shows consume per
consumed trajectory). ``--smoke`` runs a short version of both in a few seconds.

    python benchmarks/bench_protocol.py [--steps 10000] [--in-flight 10000,...] [--smoke]
"""

from __future__ import annotations

import argparse
import copy
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


def checkpoint_cost(p: StalenessProtocol, repeats: int = 5) -> dict[str, float | int]:
    """Size of the checkpoint and the time ``to_dict`` takes (median of ``repeats``)."""
    runs = []
    for _ in range(repeats):
        t0 = clock()
        d = p.to_dict()
        runs.append(clock() - t0)
    runs.sort()
    stats = p.stats()
    return {
        "checkpoint_bytes": len(json.dumps(d)),
        "to_dict_ms": round(runs[len(runs) // 2] / 1e6, 3),
        "ledger_trajectories": len(d["trajectories"]),
        "ledger_groups": len(d["groups"]),
        "tombstones": stats.tombstones,
        "trajectories_ever": sum(stats.trajectories_by_state.values()),
    }


# ------------------------------------------------------------------------------ long run


class LongRun:
    """The rollout/trainer workload around one protocol, one tick per ``tick()`` call."""

    def __init__(self, seed: int) -> None:
        self.cfg = ProtocolConfig(
            batch_size=64,
            group_size=16,
            eta=10,
            batch_redundancy=8,
            group_redundancy=2,
            stuck_threshold=4,
        )
        self.p = StalenessProtocol(self.cfg)
        self.rng = random.Random(seed)
        self.events: list[tuple[float, int]] = []  # (finish tick, trajectory id)
        self.running: set[int] = set()
        self.next_tid = self.next_gid = 0
        self.now = 0.0
        self.training = False  # a consumed step trains for one tick, then is published

    def tick(self, times: dict[str, list[int]] | None = None) -> None:
        """One round: admit, generate, finish, train; each call timed into ``times``."""
        p, rng, cfg = self.p, self.rng, self.cfg
        published = p.published_version
        # admission: fill free slots with new prompts from instances at the published
        # version or a bit behind
        while True:
            v = published if rng.random() < 0.7 else max(0, published - rng.randint(1, 3))
            gid = self.next_gid
            t0 = clock()
            answer = p.can_reserve(gid, v)
            t1 = clock()
            if times is not None:
                times["can_reserve"].append(t1 - t0)
            if answer is not ADMIT:
                if v == published:
                    break
                continue
            self.next_gid += 1
            for _ in range(cfg.samples_per_group):
                tid = self.next_tid
                t0 = clock()
                p.reserve(gid, tid, v)
                t1 = clock()
                if times is not None:
                    times["reserve"].append(t1 - t0)
                length = rng.lognormvariate(math.log(MEDIAN_TICKS), SIGMA)
                if rng.random() < 0.01:
                    length *= 5
                heapq.heappush(self.events, (self.now + length, tid))
                self.running.add(tid)
                self.next_tid += 1
        # generation: everything due by the end of this tick finishes (rewarded)
        self.now += 1.0
        events, running = self.events, self.running
        while events and events[0][0] <= self.now:
            _, tid = heapq.heappop(events)
            if tid not in running:
                continue  # aborted earlier (group surplus / batch surplus / stuck)
            running.discard(tid)
            t0 = clock()
            p.finish(tid)
            t1 = clock()
            if times is not None:
                times["finish"].append(t1 - t0)
        # the trainer: publish what trained last tick, consume the next READY buffer
        if self.training:
            p.publish(p.next_buffer)
            self.training = False
        if p.ready():
            t0 = clock()
            p.consume()
            t1 = clock()
            if times is not None:
                times["consume"].append(t1 - t0)
            self.training = True
        else:
            p.resolve_stuck()
        for n in p.take_notices():
            if isinstance(n, Abort):
                running.discard(n.trajectory_id)  # type: ignore[arg-type]

    def run_to(self, step: int) -> None:
        while self.p.next_buffer < step:
            self.tick()


def measure(state: LongRun, window: int) -> dict[str, list[int]]:
    """Time every call over ``window`` steps from a copy of ``state`` (which stays as is)."""
    run = copy.deepcopy(state)
    times: dict[str, list[int]] = {name: [] for name in OPS}
    stop = run.p.next_buffer + window
    gc.collect()
    while run.p.next_buffer < stop:
        run.tick(times)
    return times


def long_run(steps: int, first: int, window: int, rounds: int, seed: int) -> dict[str, Any]:
    """Run to ``first`` and keep a copy, run on to ``steps`` and keep a copy; then time the
    same ``window`` steps of each, alternating ``rounds`` times, so both see the same load."""
    t_start = time.perf_counter()
    run = LongRun(seed)
    run.run_to(first)
    early = copy.deepcopy(run)
    run.run_to(steps)
    late = run
    wall_run = time.perf_counter() - t_start
    times = {k: {name: [] for name in OPS} for k in (first, steps)}
    ckpt: dict[int, list[dict[str, float | int]]] = {first: [], steps: []}
    for _ in range(rounds):
        for k, state in ((first, early), (steps, late)):
            for name, xs in measure(state, window).items():
                times[k][name] += xs
            ckpt[k].append(checkpoint_cost(state.p))
    at: dict[str, Any] = {}
    for k, state in ((first, early), (steps, late)):
        to_dict = sorted(c["to_dict_ms"] for c in ckpt[k])
        at[str(k)] = {
            **ckpt[k][0],
            "to_dict_ms": to_dict[len(to_dict) // 2],
            **summarize(times[k]),
            "running": len(state.running),
        }
    stats = late.p.stats()
    return {
        "workload": (
            "B=64 n=16 (n'=18) eta=10 B'=72 stuck_threshold=4, log-normal lengths + 1% 5x "
            "tail, instances at the published version..3 behind, one tick of training"
        ),
        "steps": steps,
        "window_steps": window,
        "rounds": rounds,
        "at_step": at,
        "aborts_by_reason": stats.aborts_by_reason,
        "staleness_histogram": stats.staleness_histogram,
        "wall_s_run": round(wall_run, 1),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }


# --------------------------------------------------------------------------- scale curve


def scale_config(batch: int) -> ProtocolConfig:
    return ProtocolConfig(
        batch_size=batch,
        group_size=16,
        eta=10,
        batch_redundancy=max(1, batch // 8),
        group_redundancy=2,
    )


def batch_for(in_flight: int) -> int:
    """The smallest B whose full buffers hold at least ``in_flight`` trajectories."""

    def slots(b: int) -> int:
        cfg = scale_config(b)
        groups = cfg.batch_size + cfg.batch_redundancy
        return (cfg.eta + 1) * groups * cfg.samples_per_group

    lo, hi = 1, 1
    while slots(hi) < in_flight:
        hi *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if slots(mid) < in_flight else (lo, mid)
    return lo


def scale_point(batch: int, rounds: int, seed: int) -> dict[str, Any]:
    """``rounds`` steady steps with every buffer full of reservations at B = ``batch``."""
    cfg = scale_config(batch)
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
    gc.collect()
    ckpt = checkpoint_cost(p, repeats=3)
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
    out["checkpoint_bytes"] = ckpt["checkpoint_bytes"]
    out["to_dict_ms"] = ckpt["to_dict_ms"]
    consumed = cfg.batch_size * cfg.group_size
    out["consume_us_per_trajectory"] = round(float(out["consume_us_p50"]) / consumed, 4)
    return out


CURVE_FIGURES = (
    "in_flight",
    *(f"{op}_us_p50" for op in OPS),
    "consume_us_per_trajectory",
    "checkpoint_bytes",
    "to_dict_ms",
)


def with_growth(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each point plus ``growth``: every curve figure divided by the previous point's."""
    out = []
    for prev, point in zip([None, *points], points, strict=False):
        growth = {
            k: round(point[k] / prev[k], 2) if prev and prev[k] else None for k in CURVE_FIGURES
        }
        out.append({**point, "growth": growth})
    return out


# ---------------------------------------------------------------------------------- main


def verdict(res: dict[str, Any]) -> dict[str, bool]:
    """Each target met at every measured point of the long run?"""
    ok: dict[str, bool] = {}
    for point in res["long_run"]["at_step"].values():
        for name in PER_TRAJECTORY:
            key = f"{name}_p50_le_5us"
            ok[key] = (
                ok.get(key, True) and point[f"{name}_us_p50"] <= TARGETS["per_trajectory_p50_us"]
            )
        ok["consume_p50_le_1ms"] = ok.get("consume_p50_le_1ms", True) and (
            point["consume_us_p50"] <= TARGETS["consume_p50_us"]
        )
    return ok


def report(res: dict[str, Any]) -> None:
    lr = res["long_run"]
    (k0, a), (k1, b) = list(lr["at_step"].items())[:2]
    print(f"protocol bench: {lr['workload']}")
    print(f"  long run: {lr['steps']} steps in {lr['wall_s_run']} s; consumed staleness "
          f"{lr['staleness_histogram']}")  # fmt: skip
    print(f"  each point timed over {lr['window_steps']} steps x {lr['rounds']} rounds, "
          "alternating, from copies of the two states")  # fmt: skip
    print(f"  {'':<26}{'step ' + k0:>14}{'step ' + k1:>14}{'ratio':>9}")
    rows = [
        ("checkpoint bytes", "checkpoint_bytes"),
        ("to_dict ms", "to_dict_ms"),
        ("ledger trajectories", "ledger_trajectories"),
        ("tombstones", "tombstones"),
        ("trajectories ever", "trajectories_ever"),
        ("running", "running"),
        *[(f"{op} p50 us", f"{op}_us_p50") for op in OPS],
        *[(f"{op} p99 us", f"{op}_us_p99") for op in OPS],
    ]
    for label, key in rows:
        x, y = a[key], b[key]
        ratio = f"{y / x:.2f}" if x else "-"
        print(f"  {label:<26}{x:>14}{y:>14}{ratio:>9}")
    print("  scale curve (eta=10, n'=18, B'=9/8 B); 'x' rows: growth from the previous point")
    print(f"  {'':<3}{'in flight':>10}{'B':>6}" + "".join(f"{op + ' p50':>16}" for op in OPS)
          + f"{'consume/traj':>14}{'ckpt MB':>10}{'to_dict ms':>12}")  # fmt: skip
    for s in res["scale"]:
        print(f"  {'':<3}{s['in_flight']:>10}{s['batch_size']:>6}"
              + "".join(f"{s[f'{op}_us_p50']:>13.2f} us" for op in OPS)
              + f"{s['consume_us_per_trajectory']:>11.3f} us"
              + f"{s['checkpoint_bytes'] / 1e6:>10.1f}{s['to_dict_ms']:>12.1f}")  # fmt: skip
        g = s["growth"]
        if g["in_flight"] is not None:
            print(f"  {'x':<3}{g['in_flight']:>10.2f}{'':>6}"
                  + "".join(f"{g[f'{op}_us_p50'] or 0:>16.2f}" for op in OPS)
                  + f"{g['consume_us_per_trajectory'] or 0:>14.2f}"
                  + f"{g['checkpoint_bytes']:>10.2f}{g['to_dict_ms'] or 0:>12.2f}")  # fmt: skip
    print(f"  targets (p50 per-trajectory call <= 5 us, consume <= 1 ms at B=64): "
          f"{res['meets_targets']}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--steps", type=int, default=2_000, help="training steps of the long run")
    ap.add_argument("--window", type=int, default=10, help="steps timed at each point, per round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating timing rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--in-flight",
        default="10000,30000,100000,300000,1000000",
        help="trajectories in flight at each point of the scale curve",
    )
    ap.add_argument("--scale-steps", type=int, default=3, help="steps per scale point")
    ap.add_argument("--smoke", action="store_true", help="a short run of both (seconds)")
    ap.add_argument("--out", default="bench-results/protocol.json")
    a = ap.parse_args(argv)
    if a.smoke:
        a.steps, a.window, a.rounds, a.in_flight, a.scale_steps = 40, 3, 1, "2000,8000", 2
    try:
        loads = [int(x) for x in a.in_flight.split(",")]
    except ValueError:
        ap.error(f"--in-flight: comma-separated whole numbers, got {a.in_flight!r}")
    if not loads or min(loads) < 1:
        ap.error(f"--in-flight: every load must be >= 1, got {a.in_flight!r}")
    first = min(100, a.steps // 4)
    res: dict[str, Any] = {
        "python": sys.version.split()[0],
        "smoke": a.smoke,
        "long_run": long_run(a.steps, first, a.window, a.rounds, a.seed),
        "scale": with_growth([scale_point(batch_for(n), a.scale_steps, a.seed) for n in loads]),
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
