"""Coordinator cycle cost at paper scale, and how it grows with instances and queue length.

Each measured cycle is one ``Coordinator.step``: ingest one snapshot per instance, drain
protocol aborts, admission gate, sync decisions, routing (with Reserve through the real
protocol), migration. Every iteration starts from the same state (protocol restored from a
checkpoint, a fresh coordinator; neither timed). A point is (instances, queued): each instance
runs 32 trajectories (skewed: 8 to 56 per instance), a quarter of the queue is partial
(interrupted) trajectories whose groups are reserved, B = instances groups of n = 16, η = 3.
The η = 3 policies run on the full state; ``sync`` (η = 0) and ``one-step`` (η = 1) run the
same instances and queue with their own η and no partials (their batches are never
interrupted), where a cycle with a batch in flight admits nothing.

Two measurements, written to bench-results/coordinator.json:

1. **The paper point** (default): 128 instances, 8,192 queued, every policy side by side.
2. **A scale curve** (``--scale``): 32 → 1,024 instances with 1 K → 64 K queued, the policies
   in ``--curve-policies`` (default staleflow and all-vanilla), p50 / p99 per point and the
   growth ratio from one point to the next.

Target: staleflow p50 ≤ 5 ms at the paper point and at 1,024 instances × 64 K queued.
``--smoke`` runs tiny versions of both in seconds. ``--points 1024x65536`` runs the curve at
the given points only, ``--no-paper`` skips the paper point.

3. **Against another version** (``--against SRC``, SRC a ``rollout-coordinator/src`` folder
   of another checkout): the curve points run in two worker processes, this code and SRC's,
   their cycles interleaved one by one (so both see the same machine load), with the ratio of
   their CPU p50s. Nothing else runs in that mode.

    python benchmarks/bench_coordinator.py [--scale] [--smoke] [--points IxQ,...] [--no-paper]
        [--against SRC]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import logging
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog

from rollout_coordinator import (
    Coordinator,
    CoordinatorConfig,
    InstanceSnapshot,
    QueuedTrajectory,
    QueueView,
    RunningEntry,
)
from rollout_coordinator.policies import POLICIES, build_policy
from staleness_protocol import StalenessProtocol, UnboundedFifo, protocol_from_dict

AnyProtocol = StalenessProtocol | UnboundedFifo

RUNNING_PER_INSTANCE = 32
PARTIAL_SHARE = 4  # one queued trajectory in four is a partial
ETA = 3
N = 16  # trajectories per group
CURRENT = 3
KV_CAP = 400_000
TARGET_P50_MS = 5.0
PAPER = (128, 8192)
CURVE = ((32, 1024), (128, 4096), (512, 16384), (1024, 65536))
SMOKE_PAPER = (8, 256)
SMOKE_CURVE = ((8, 256), (16, 512))
State = tuple[dict[str, Any], list[dict[str, Any]], QueueView]


def new_protocol(policy: str, batch: int, eta: int) -> AnyProtocol:
    """The protocol ``policy`` runs over (``Policy.protocol``), built where both of the app's
    shells build theirs (``control.config.core_config``): per-version buffers, or the
    baselines' FIFOs with the caps the app gives them; no stuck-buffer resolution. (The app
    is imported here, not by ``--worker``: a worker may run another checkout's coordinator.)"""
    from staleflow_trainer.config import load_config
    from staleflow_trainer.control.config import build_protocol, core_config

    cfg = load_config(None, [
        f"coordinator.policy={policy}", f"protocol.eta={eta}", f"protocol.batch_size={batch}",
        f"protocol.group_size={N}", "protocol.stuck_threshold=0",
    ])  # fmt: skip
    return build_protocol(core_config(cfg, rows=None).protocol, start_version=CURRENT)


def build_state(
    instances: int,
    queued: int,
    eta: int,
    with_partials: bool,
    policy: str,
    seed: int = 0,
    proto: AnyProtocol | None = None,
) -> State:
    rng = random.Random(seed)
    running_total = RUNNING_PER_INSTANCE * instances
    proto = new_protocol(policy, instances, eta) if proto is None else proto
    versions = [CURRENT - (i % 3) if eta >= 2 else CURRENT for i in range(instances)]
    # skewed load: running counts between 8 and 56, summing to running_total
    counts = [8 + (i * 37) % 49 for i in range(instances)]
    scale = running_total / sum(counts)
    counts = [max(1, int(c * scale)) for c in counts]
    counts[0] += running_total - sum(counts)
    snaps = []
    tid = 0
    for i in range(instances):
        running = []
        for _ in range(counts[i]):
            p, g = rng.randint(200, 1500), rng.randint(0, 6000)
            running.append(
                RunningEntry(trajectory_id=f"r{tid}", prompt_tokens=p, generated_tokens=g)
            )
            tid += 1
        kv = min(KV_CAP, sum(e.tokens for e in running))
        snaps.append(dict(instance_id=f"i{i}", version=versions[i], running=tuple(running), kv=kv))
    queue = []
    if with_partials:
        # reserve the running work's groups and the partials' groups so they are in flight
        for k in range(running_total // N):
            for m in range(N):
                proto.reserve(f"rg{k}", f"r{k * N + m}", CURRENT - (k % 3))
        for k in range(queued // PARTIAL_SHARE // N):
            v = CURRENT - 2 + (k % 3)
            for m in range(N):
                t = f"p{k * N + m}"
                proto.reserve(f"pg{k}", t, v)
                queue.append(
                    QueuedTrajectory(
                        trajectory_id=t,
                        group_id=f"pg{k}",
                        v_traj=v,
                        prompt_len=rng.randint(200, 1500),
                        generated_len=rng.randint(100, 8000),
                    )
                )
    n_new = queued - len(queue)
    for k in range(n_new):
        queue.append(
            QueuedTrajectory(
                trajectory_id=f"n{k}",
                group_id=f"ng{k // N}",
                v_traj=None,
                prompt_len=rng.randint(200, 1500),
            )
        )
    return proto.to_dict(), snaps, QueueView.from_unordered(queue)


def point_eta(policy: str) -> int:
    """The η a point of ``policy`` runs at: :data:`ETA`, or the one the policy models."""
    required = build_policy(policy).required_eta
    return ETA if required is None else required


def state_for(policy: str, instances: int, queued: int, proto: AnyProtocol | None = None) -> State:
    """The point's state; ``proto``: its fresh protocol, if built elsewhere (a worker that
    runs another checkout's coordinator gets it from this one's app, see :func:`against`)."""
    eta = point_eta(policy)
    return build_state(instances, queued, eta, with_partials=eta == ETA, policy=policy,
                       proto=proto)  # fmt: skip


def prepared(name: str, state: State, it: int) -> tuple[Coordinator, list[InstanceSnapshot]]:
    """A fresh coordinator on a restored protocol, and the cycle's snapshots (not timed)."""
    ckpt, snaps, _ = state
    proto = protocol_from_dict(ckpt)  # whichever protocol wrote it
    window = (
        {"verl_staleness_threshold": float(ETA)} if build_policy(name).protocol == "fifo" else {}
    )
    coord = Coordinator(CoordinatorConfig(policy=name, **window), proto, lambda: 10.0)
    for s in snaps:
        coord.add_instance(s["instance_id"], kv_capacity_tokens=KV_CAP, version=s["version"])
    batch = [
        InstanceSnapshot(
            instance_id=s["instance_id"],
            seq=it + 1,
            time_s=10.0,
            version=s["version"],
            running=s["running"],
            waiting=0,
            kv_used_tokens=s["kv"],
            kv_capacity_tokens=KV_CAP,
            throughput_tokens_per_s=1000.0,
        )
        for s in snaps
    ]
    return coord, batch


def run_policy(name: str, state: State, iters: int) -> dict[str, Any]:
    queue = state[2]
    times, cpu, routes, syncs, interrupts = [], [], [], [], []
    for it in range(iters):
        coord, batch = prepared(name, state, it)
        gc.collect()  # the untimed setup's garbage is not the cycle's
        t0, c0 = time.perf_counter(), time.thread_time()
        coord.step(batch, queue, now=10.0)
        cpu.append((time.thread_time() - c0) * 1e3)
        times.append((time.perf_counter() - t0) * 1e3)
        rep = coord.last_cycle
        routes.append(rep.routes)
        syncs.append(rep.syncs)
        interrupts.append(rep.interrupts)
    times.sort()
    cpu.sort()
    return {
        "cycle_ms_p50": round(statistics.median(times), 3),
        "cycle_ms_p99": round(times[min(len(times) - 1, int(0.99 * len(times)))], 3),
        "cpu_ms_p50": round(statistics.median(cpu), 3),
        "cpu_ms_p99": round(cpu[min(len(cpu) - 1, int(0.99 * len(cpu)))], 3),
        "iterations": iters,
        "routes_per_cycle": routes[0],
        "syncs_per_cycle": syncs[0],
        "interrupt_cmds_per_cycle": interrupts[0],
    }


def profile_cycle(name: str, state: State, top: int, cycles: int = 3) -> list[dict[str, Any]]:
    """cProfile ``cycles`` cycles on this thread's CPU clock (time other processes take
    is not charged to whatever function was running): the ``top`` functions by own time, as
    a share of the cycles' total."""
    prof = cProfile.Profile(time.thread_time)
    for it in range(cycles):
        coord, batch = prepared(name, state, it)
        gc.collect()
        prof.enable()
        coord.step(batch, state[2], now=10.0)
        prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(row[2] for row in stats.values()) or 1.0
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    root = str(Path(__file__).resolve().parent.parent) + os.sep
    return [
        {
            "function": f"{file.replace(root, '')}:{line}:{func}",
            "calls": row[1],
            "own_pct": round(100 * row[2] / total, 1),
            "cumulative_pct": round(100 * row[3] / total, 1),
        }
        for (file, line, func), row in rows
    ]


def paper_point(point: tuple[int, int], iters: int) -> dict[str, Any]:
    instances, queued = point
    full = state_for("staleflow", instances, queued)
    results = {}
    print(f"paper point: {instances} instances, {queued} queued, eta={ETA}, {iters} cycles")
    for name in POLICIES:
        pol = build_policy(name)
        same = pol.required_eta in (None, ETA) and pol.protocol == "buffers"
        state = full if same else state_for(name, instances, queued)
        r = results[name] = run_policy(name, state, iters)
        print(
            f"  {name:18s} p50 {r['cycle_ms_p50']:7.2f} ms  p99 {r['cycle_ms_p99']:7.2f} ms  "
            f"cpu p50 {r['cpu_ms_p50']:7.2f} ms  "
            f"routes {r['routes_per_cycle']:5d}  syncs {r['syncs_per_cycle']:3d}"
        )
    base = results["all-vanilla"]["cycle_ms_p50"]
    print(
        f"  staleflow / all-vanilla cycle time: {results['staleflow']['cycle_ms_p50'] / base:.2f}x"
    )
    return {"instances": instances, "queued": queued, "policies": results}


def scale_curve(
    points: tuple[tuple[int, int], ...], policies: list[str], iters: int, profile_top: int
) -> dict[str, Any]:
    curve: dict[str, list[dict[str, Any]]] = {name: [] for name in policies}
    print(f"scale curve: {RUNNING_PER_INSTANCE} running per instance, 1/{PARTIAL_SHARE} of "
          f"the queue partial, B = instances groups, eta={ETA}, {iters} cycles per point")  # fmt: skip
    print(f"  {'policy':<16}{'instances':>10}{'queued':>8}{'p50 ms':>10}{'p99 ms':>10}"
          f"{'x prev p50':>12}{'x prev p99':>12}{'cpu p50 ms':>12}{'x prev':>8}"
          f"{'routes':>8}")  # fmt: skip
    profile: dict[str, Any] = {}
    for name in policies:
        for instances, queued in points:
            state = state_for(name, instances, queued)
            r = {"instances": instances, "queued": queued, **run_policy(name, state, iters)}
            prev = curve[name][-1] if curve[name] else None
            for key, src in (
                ("p50", "cycle_ms_p50"),
                ("p99", "cycle_ms_p99"),
                ("cpu_p50", "cpu_ms_p50"),
            ):
                r[f"growth_{key}"] = round(r[src] / prev[src], 2) if prev and prev[src] else None
            curve[name].append(r)
            g50, g99, gc50 = (
                "-" if r[k] is None else f"{r[k]:.2f}"
                for k in ("growth_p50", "growth_p99", "growth_cpu_p50")
            )
            print(f"  {name:<16}{instances:>10}{queued:>8}{r['cycle_ms_p50']:>10.2f}"
                  f"{r['cycle_ms_p99']:>10.2f}{g50:>12}{g99:>12}{r['cpu_ms_p50']:>12.2f}"
                  f"{gc50:>8}{r['routes_per_cycle']:>8}")  # fmt: skip
            if profile_top and (instances, queued) == points[-1]:
                profile[name] = profile_cycle(name, state, profile_top)
    for name, rows in profile.items():
        inst, q = points[-1]
        print(f"  profile of {name} at {inst} instances x {q} queued (3 cycles, CPU clock):")
        for row in rows:
            print(f"    {row['own_pct']:5.1f} %  (cum {row['cumulative_pct']:5.1f} %)  "
                  f"{row['calls']:>7} calls  {row['function']}")  # fmt: skip
    return {"points": curve, "profile_largest": profile}


def _worker(policy: str, instances: int, queued: int, proto_path: str) -> int:
    """``--worker``: build the point's state (on the fresh protocol the parent wrote to
    ``proto_path``: the app that builds it may not run on the other checkout's coordinator),
    then time one cycle per line read (its number) and print ``cpu_ms wall_ms routes``."""
    proto = protocol_from_dict(json.loads(Path(proto_path).read_text()))
    state = state_for(policy, instances, queued, proto)
    print(f"ready {Path(sys.modules[Coordinator.__module__].__file__ or '?').parent}", flush=True)
    for line in sys.stdin:
        coord, batch = prepared(policy, state, int(line))
        gc.collect()
        t0, c0 = time.perf_counter(), time.thread_time()
        coord.step(batch, state[2], now=10.0)
        cpu, wall = (time.thread_time() - c0) * 1e3, (time.perf_counter() - t0) * 1e3
        print(f"{cpu} {wall} {coord.last_cycle.routes}", flush=True)
    return 0


def against(
    src: Path, points: tuple[tuple[int, int], ...], policies: list[str], iters: int
) -> dict[str, Any]:
    """Each point in two workers, this code (``current``) and ``src``'s (``other``), cycles
    interleaved one by one (which goes first alternates)."""
    print(f"against {src}: {iters} interleaved cycles per point, CPU / wall p50 in ms")
    print(f"  {'policy':<16}{'instances':>10}{'queued':>8}{'current cpu':>13}{'other cpu':>11}"
          f"{'ratio':>7}{'current wall':>14}{'other wall':>12}{'routes':>8}")  # fmt: skip
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in policies}
    code: dict[str, str] = {}  # the rollout_coordinator each side imported
    for name in policies:
        for instances, queued in points:
            workers = {}
            fresh = Path(tempfile.mkstemp(suffix=".json")[1])
            fresh.write_text(json.dumps(new_protocol(name, instances, point_eta(name)).to_dict()))
            for side, path in (("current", None), ("other", src)):
                env = dict(os.environ)
                if path is not None:
                    env["PYTHONPATH"] = os.pathsep.join([str(path), env.get("PYTHONPATH", "")])
                cmd = [sys.executable, __file__, "--worker", f"{name}:{instances}x{queued}:{fresh}"]
                workers[side] = w = subprocess.Popen(
                    cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
                )
                assert w.stdout is not None
                ready, path = w.stdout.readline().split(maxsplit=1)
                assert ready == "ready", side
                if code.setdefault(side, path.strip()) != path.strip():
                    raise RuntimeError(f"{side} ran {path.strip()}, before {code[side]}")
            times: dict[str, list[tuple[float, float, int]]] = {"current": [], "other": []}
            for it in range(iters):
                for side in ("current", "other") if it % 2 == 0 else ("other", "current"):
                    w = workers[side]
                    assert w.stdin is not None and w.stdout is not None
                    w.stdin.write(f"{it}\n")
                    w.stdin.flush()
                    cpu, wall, routes = w.stdout.readline().split()
                    times[side].append((float(cpu), float(wall), int(routes)))
            for w in workers.values():
                assert w.stdin is not None
                w.stdin.close()
                w.wait()
            fresh.unlink()
            r: dict[str, Any] = {"instances": instances, "queued": queued}
            for side, rows in times.items():
                r[f"{side}_cpu_ms_p50"] = round(statistics.median(t[0] for t in rows), 3)
                r[f"{side}_cycle_ms_p50"] = round(statistics.median(t[1] for t in rows), 3)
                r[f"{side}_routes"] = rows[0][2]
            r["cpu_ratio"] = round(r["current_cpu_ms_p50"] / r["other_cpu_ms_p50"], 3)
            out[name].append(r)
            print(f"  {name:<16}{instances:>10}{queued:>8}{r['current_cpu_ms_p50']:>13.2f}"
                  f"{r['other_cpu_ms_p50']:>11.2f}{r['cpu_ratio']:>7.2f}"
                  f"{r['current_cycle_ms_p50']:>14.2f}{r['other_cycle_ms_p50']:>12.2f}"
                  f"{r['current_routes']:>8}")  # fmt: skip
    print("  current: " + code.get("current", "-") + "\n  other:   " + code.get("other", "-"))
    return {"src": str(src), "code": code, "iterations": iters, "points": out}


def _write_report(res: dict[str, Any], out: str | None) -> int:
    default = Path(__file__).resolve().parent.parent / "bench-results" / "coordinator.json"
    path = Path(out) if out else default
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--scale", action="store_true", help="also run the 32 -> 1,024 curve")
    ap.add_argument("--curve-policies", default="staleflow,all-vanilla", help="curve policies")
    ap.add_argument("--iters", type=int, default=40, help="cycles per paper-point policy")
    ap.add_argument("--curve-iters", type=int, default=15, help="cycles per curve point")
    ap.add_argument("--profile-top", type=int, default=12, help="functions in the profile")
    ap.add_argument("--smoke", action="store_true", help="tiny paper point and curve (seconds)")
    ap.add_argument(
        "--points", default=None, help="curve points INSTANCESxQUEUED,... (implies --scale)"
    )
    ap.add_argument("--no-paper", action="store_true", help="skip the paper point")
    ap.add_argument(
        "--against", default=None, help="another checkout's rollout-coordinator/src: interleave"
    )
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # POLICY:IxQ:PATH (internal)
    ap.add_argument("--out", default=None, help="report path")
    a = ap.parse_args(argv)
    if a.worker:
        name, point, proto_path = a.worker.split(":", 2)
        inst, queued = point.split("x")
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
        return _worker(name, int(inst), int(queued), proto_path)
    policies = [p.strip() for p in a.curve_policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        ap.error(f"--curve-policies: unknown {unknown}; allowed: {', '.join(POLICIES)}")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    paper, curve = (SMOKE_PAPER, SMOKE_CURVE) if a.smoke else (PAPER, CURVE)
    if a.points:
        try:
            curve = tuple(
                (int(i), int(q)) for i, q in (p.lower().split("x") for p in a.points.split(","))
            )
        except ValueError:
            ap.error(f"--points: {a.points!r}; allowed: INSTANCESxQUEUED,... e.g. 1024x65536")
        if any(i < 1 or q < 0 for i, q in curve):
            ap.error(f"--points: {a.points!r}; instances must be >= 1 and queued >= 0")
    iters, curve_iters = (3, 3) if a.smoke else (a.iters, a.curve_iters)
    if a.against:
        src = Path(a.against).resolve()
        if not (src / "rollout_coordinator" / "__init__.py").is_file():
            ap.error(f"--against: {a.against!r}; allowed: a folder holding rollout_coordinator/")
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cpus")
    res: dict[str, Any] = {"smoke": a.smoke, "load_average": [round(x, 2) for x in load]}
    res["target_p50_ms"] = TARGET_P50_MS
    if a.against:
        res["against"] = against(src, curve, policies, curve_iters)
        return _write_report(res, a.out)
    meets = {}
    if not a.no_paper:
        res["paper"] = paper_point(paper, iters)
        sf = res["paper"]["policies"]["staleflow"]
        res.update(cycle_ms_p50=sf["cycle_ms_p50"], cycle_ms_p99=sf["cycle_ms_p99"])
        meets["paper_point"] = sf["cycle_ms_p50"] <= TARGET_P50_MS
        meets["paper_point_cpu"] = sf["cpu_ms_p50"] <= TARGET_P50_MS
    if a.scale or a.smoke or a.points:
        res["scale"] = scale_curve(curve, policies, curve_iters, a.profile_top)
        if "staleflow" in policies:
            last = res["scale"]["points"]["staleflow"][-1]
            meets["largest_point"] = last["cycle_ms_p50"] <= TARGET_P50_MS
            meets["largest_point_cpu"] = last["cpu_ms_p50"] <= TARGET_P50_MS
    res["meets_target_p50"] = meets
    print(f"staleflow p50 <= {TARGET_P50_MS} ms (wall; _cpu: this thread's CPU time): {meets}")
    end = os.getloadavg()
    res["load_average_end"] = [round(x, 2) for x in end]
    print(f"load average at the end {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}")
    return _write_report(res, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
