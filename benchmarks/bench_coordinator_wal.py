"""What the coordinator's write-ahead journal costs per commit, for a large protocol state.

A protocol at B=64, n=16, eta=3 is driven through ``steps`` training steps of realistic traffic
(each step: every group of the next buffer reserved member by member, finished, consumed). After
a warm-up of ``warm`` steps (so the protocol holds a long history, as late in a run), every
step's traffic is committed in ``commits_per_step`` commits (one per control-loop cycle: the ops
of that cycle plus the changed bookkeeping keys, fsynced). Printed and written to
``bench-results/coordinator_wal.json``: per-commit seconds (mean, p50, p99, max) and bytes; the
cost of one full snapshot of the same state (``to_dict`` + JSON, what a naive per-cycle
persist would pay) for comparison; the compaction (new base) cost; and the replay time of a
journal of ``steps`` steps.

    .venv/bin/python benchmarks/bench_coordinator_wal.py [--warm 100] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from staleflow_trainer.actors.write_ahead import JournaledProtocol, WriteAheadLog, replay_state
from staleness_protocol import Admission, ProtocolConfig, StalenessProtocol

B, N, ETA = 64, 16, 3


def _step(p: JournaledProtocol, g: int) -> tuple[int, list[list[str]]]:
    """One step of traffic; returns the next group serial and the cycle-sized chunks of
    reserved ids (the order a loop would see them)."""
    reserved: list[str] = []
    while True:
        gid = f"g{g:07d}"
        if p.can_reserve(gid, p.published_version) is not Admission.ADMIT:
            break
        for i in range(N):
            p.reserve(gid, f"{gid}/{i}", p.published_version)
            reserved.append(f"{gid}/{i}")
        g += 1
    for t in list(p.in_flight()):
        if p.trajectory(t).buffer == p.next_buffer:
            p.finish(t)
    p.publish(p.consume().version + 1)
    return g, [reserved]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warm", type=int, default=100)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--commits-per-step", type=int, default=20)
    ap.add_argument("--out", default="bench-results/coordinator_wal.json")
    a = ap.parse_args()
    p = JournaledProtocol(StalenessProtocol(ProtocolConfig(batch_size=B, group_size=N, eta=ETA)))
    g = 0
    for _ in range(a.warm):
        g, _ = _step(p, g)
    p.take_ops()
    book = {
        "steps_done": a.warm,
        "serial": g,
        "fresh": [f"g{g + i:07d}" for i in range(B)],
        "rewards": {f"g{g:07d}/{i}": 1.0 for i in range(B * N)},  # a full batch's scores
        "counters": {"routes": 0},
    }
    with tempfile.TemporaryDirectory() as d:
        wal = WriteAheadLog(Path(d))
        t0 = time.perf_counter()
        wal.reset({"protocol": p.inner.to_dict(), "groups": {}, **book})
        base_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        snap = json.dumps(p.inner.to_dict()).encode()
        snapshot_s = time.perf_counter() - t0
        times: list[float] = []
        sizes: list[int] = []
        for k in range(a.steps):
            g, _ = _step(p, g)
            ops = p.take_ops()
            chunk = max(1, len(ops) // a.commits_per_step)
            for c in range(0, len(ops), chunk):
                book["counters"] = {"routes": book["counters"]["routes"] + 1}
                t0 = time.perf_counter()
                before = wal.stats["bytes"]
                wal.append(
                    {
                        "ops": ops[c : c + chunk],
                        "groups": [],
                        "book": {"counters": book["counters"], "steps_done": a.warm + k},
                    }
                )
                times.append(time.perf_counter() - t0)
                sizes.append(int(wal.stats["bytes"] - before))
        t0 = time.perf_counter()
        base, recs = WriteAheadLog(Path(d)).load()
        q, _ = replay_state(base, recs)
        replay_s = time.perf_counter() - t0
        assert q.to_dict() == p.inner.to_dict(), "replay diverged"
        t0 = time.perf_counter()
        wal.compact({"protocol": p.inner.to_dict(), "groups": {}, **book})
        compact_s = time.perf_counter() - t0
    times.sort()
    res = {
        "config": {
            "batch_size": B,
            "group_size": N,
            "eta": ETA,
            "warm_steps": a.warm,
            "steps": a.steps,
        },
        "protocol_trajectories": len(p.inner.to_dict()["trajectories"]),
        "commits": len(times),
        "commit_s_mean": statistics.fmean(times),
        "commit_s_p50": times[len(times) // 2],
        "commit_s_p99": times[int(len(times) * 0.99)],
        "commit_s_max": times[-1],
        "commit_bytes_mean": statistics.fmean(sizes),
        "full_snapshot_s": snapshot_s,
        "full_snapshot_bytes": len(snap),
        "base_write_s": base_s,
        "compact_s": compact_s,
        "replay_s": replay_s,
        "replayed_records": len(recs),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    for k, v in res.items():
        print(f"{k:24s} {v}")


if __name__ == "__main__":
    main()
