"""Coordinator cycle cost at paper scale: 128 instances, 8,192 queued, 4,096 running, η = 3.

Each measured cycle is one ``Coordinator.step``: ingest 128 snapshots, drain protocol aborts,
admission gate, sync decisions, routing (with Reserve through the real protocol), migration.
Every iteration starts from the same state (protocol restored from a checkpoint, a fresh
coordinator; neither timed). The η = 3 policies run on the full state; ``sync`` (η = 0) and
``one-step`` (η = 1) run the same instances and queue with their own η and no partials (their
batches are never interrupted), where a cycle with a batch in flight admits nothing.

Writes bench-results/coordinator.json: cycle_ms_p50 / cycle_ms_p99 (the staleflow policy) and
per-policy numbers with the work each cycle did. Target: staleflow p50 ≤ 5 ms. ``--smoke``
times 2 cycles per policy on the same state (the test suite runs it).

    .venv/bin/python benchmarks/bench_coordinator.py [--smoke] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from pathlib import Path

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
from staleness_protocol import (
    GcFifo,
    GcFifoConfig,
    ProtocolConfig,
    StalenessProtocol,
    protocol_from_dict,
)

INSTANCES = 128
RUNNING = 4096
QUEUED = 8192
PARTIAL = 2048
ETA = 3
B, N = 128, 16  # groups per batch, trajectories per group
CURRENT = 3
KV_CAP = 400_000
ITERS = 40


def build_state(eta: int, with_partials: bool, seed: int = 0, fifo: bool = False):
    """The instances, queue and protocol state; ``fifo``: the protocol is the GcFifo the
    FIFO baselines run on (its own cap: (eta + 1) * B groups in flight)."""
    rng = random.Random(seed)
    if fifo:
        cfg = GcFifoConfig(batch_size=B, group_size=N, eta=eta, max_inflight_groups=(eta + 1) * B)
        proto = GcFifo(cfg, start_version=CURRENT)
    else:
        proto = StalenessProtocol(
            ProtocolConfig(batch_size=B, group_size=N, eta=eta), start_version=CURRENT
        )
    versions = [CURRENT - (i % 3) if eta >= 2 else CURRENT for i in range(INSTANCES)]
    # skewed load: running counts between 8 and 56, summing to RUNNING
    counts = [8 + (i * 37) % 49 for i in range(INSTANCES)]
    scale = RUNNING / sum(counts)
    counts = [max(1, int(c * scale)) for c in counts]
    counts[0] += RUNNING - sum(counts)
    snaps = []
    tid = 0
    for i in range(INSTANCES):
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
        for k in range(RUNNING // N):
            for m in range(N):
                proto.reserve(f"rg{k}", f"r{k * N + m}", CURRENT - (k % 3))
        for k in range(PARTIAL // N):
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
    n_new = QUEUED - len(queue)
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


def run_policy(name: str, state, iters: int = ITERS) -> dict:
    ckpt, snaps, queue = state
    times, routes, syncs, interrupts = [], [], [], []
    for it in range(iters):
        proto = protocol_from_dict(ckpt)
        coord = Coordinator(CoordinatorConfig(policy=name), proto, lambda: 10.0)
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
        t0 = time.perf_counter()
        coord.step(batch, queue, now=10.0)
        times.append((time.perf_counter() - t0) * 1e3)
        rep = coord.last_cycle
        routes.append(rep.routes)
        syncs.append(rep.syncs)
        interrupts.append(rep.interrupts)
    times.sort()
    return {
        "cycle_ms_p50": round(statistics.median(times), 3),
        "cycle_ms_p99": round(times[min(len(times) - 1, int(0.99 * len(times)))], 3),
        "routes_per_cycle": routes[0],
        "syncs_per_cycle": syncs[0],
        "interrupt_cmds_per_cycle": interrupts[0],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="2 cycles per policy (seconds)")
    ap.add_argument("--out", default=None, help="default: bench-results/coordinator.json")
    a = ap.parse_args(argv)
    iters = 2 if a.smoke else ITERS
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    full = build_state(ETA, with_partials=True)
    full_fifo = None
    results = {}
    for name in POLICIES:
        if name == "sync":
            state = build_state(0, with_partials=False)
        elif name == "one-step":
            state = build_state(1, with_partials=False)
        elif build_policy(name).protocol == "gc-fifo":
            if full_fifo is None:
                full_fifo = build_state(ETA, with_partials=True, fifo=True)
            state = full_fifo
        else:
            state = full
        results[name] = run_policy(name, state, iters)
        r = results[name]
        print(
            f"{name:18s} p50 {r['cycle_ms_p50']:7.2f} ms  p99 {r['cycle_ms_p99']:7.2f} ms  "
            f"routes {r['routes_per_cycle']:5d}  syncs {r['syncs_per_cycle']:3d}"
        )
    out = {
        "instances": INSTANCES,
        "queued": QUEUED,
        "running": RUNNING,
        "eta": ETA,
        "iterations": iters,
        "smoke": a.smoke,
        "cycle_ms_p50": results["staleflow"]["cycle_ms_p50"],
        "cycle_ms_p99": results["staleflow"]["cycle_ms_p99"],
        "target_p50_ms": 5.0,
        "policies": results,
    }
    base = results["all-vanilla"]["cycle_ms_p50"]
    print(f"staleflow / all-vanilla cycle time: {results['staleflow']['cycle_ms_p50'] / base:.2f}x")
    default = Path(__file__).resolve().parent.parent / "bench-results" / "coordinator.json"
    path = Path(a.out) if a.out else default
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
