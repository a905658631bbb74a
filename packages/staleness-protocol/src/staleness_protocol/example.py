"""A worked example: the protocol embedded in a small simulated RL loop.

Run it with ``python -m staleness_protocol.example [--steps N] [--seed S]``.

Three rollout instances generate GRPO groups in virtual ticks (random lengths, a long tail),
sync to new versions at their own pace (interrupting running work, which resumes elsewhere
with its V_traj kept — partial rollout and migration), and a trainer consumes a batch whenever
the protocol says one is READY. DAPO-style filtering drops groups whose rewards are all equal
and the protocol asks for replacement prompts; group redundancy aborts surplus samples; stuck
buffers are resolved when the trainer has waited too long. Everything the protocol decides
arrives as data (abort records, replacement requests) that this loop acts on.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from typing import Any

from . import ProtocolConfig, StalenessProtocol
from .testing import check_invariants

CAPACITY = 10  # concurrent trajectories per instance
STUCK_AFTER = 10  # ticks the trainer waits before calling resolve_stuck()


class _Instance:
    def __init__(self, name: str) -> None:
        self.name = name
        self.version = 0
        self.running: dict[int, int] = {}  # trajectory id -> ticks left


def run(steps: int = 6, seed: int = 0, emit: Callable[[str], None] = print) -> dict[str, Any]:
    """Simulate until ``steps`` batches were trained; return a summary dict."""
    cfg = ProtocolConfig(
        batch_size=4, group_size=4, eta=2, group_redundancy=1, filtering=True, stuck_threshold=1
    )
    p = StalenessProtocol(cfg)
    rng = random.Random(seed)
    instances = [_Instance(f"inst{i}") for i in range(3)]
    parked: dict[int, int] = {}  # interrupted trajectories waiting to resume: id -> ticks left
    doomed: set[int] = set()  # groups whose rewards will all be equal (filtered)
    finished_in: dict[int, int] = {}
    next_group = next_traj = 0
    syncs = migrations = waited = tick = 0

    def length() -> int:
        return rng.randint(2, 6) if rng.random() > 0.1 else rng.randint(15, 25)  # long tail

    emit(f"config: {cfg}")
    while p.current_version < steps:
        tick += 1
        # 1. sync: a stale instance syncs when it must, or now and then when it is idle
        for inst in instances:
            if inst.version < p.current_version and (
                p.must_sync(inst.version) or not inst.running or rng.random() < 0.2
            ):
                parked.update(inst.running)  # interrupt: partial outputs go back to the queue
                migrations += len(inst.running)
                inst.running.clear()
                inst.version = p.current_version
                syncs += 1
        # 2. route: resume parked trajectories first (any instance at version >= V_traj) ...
        for tid in list(parked):
            for inst in sorted(instances, key=lambda i: len(i.running)):
                if len(inst.running) < CAPACITY and p.can_resume(tid, inst.version):
                    inst.running[tid] = parked.pop(tid)
                    break
        # ... then admit new prompts; a group's samples spread over instances (and versions)
        for inst in instances:
            while CAPACITY - len(inst.running) >= 2 and p.can_reserve(next_group, inst.version):
                gid, next_group = next_group, next_group + 1
                if rng.random() < 0.15:
                    doomed.add(gid)
                for m in range(cfg.samples_per_group):
                    target = inst if m % 2 == 0 else rng.choice(instances)
                    if len(target.running) >= CAPACITY or not p.can_reserve(gid, target.version):
                        target = inst
                    p.reserve(gid, next_traj, target.version)
                    target.running[next_traj] = length()
                    next_traj += 1
        # 3. generate one tick; finished trajectories are rewarded and reported
        for inst in instances:
            for tid in list(inst.running):
                inst.running[tid] -= 1
                if inst.running[tid] > 0:
                    continue
                del inst.running[tid]
                if p.trajectory(tid).state != "in_flight":
                    continue  # aborted by the protocol this tick
                gid = int(p.trajectory(tid).group_id)
                finished_in[gid] = finished_in.get(gid, 0) + 1
                if gid in doomed and finished_in[gid] == cfg.group_size:
                    p.drop_group(gid, "all rewards equal")  # DAPO dynamic sampling
                else:
                    p.finish(tid)
        # 4. act on the protocol's abort commands (surplus samples, stuck stragglers)
        for a in p.take_aborts():
            for inst in instances:
                inst.running.pop(a.trajectory_id, None)  # type: ignore[arg-type]
            parked.pop(a.trajectory_id, None)  # type: ignore[arg-type]
        p.take_replacements()  # new prompts are admitted by routing anyway; counted in stats
        # 5. the trainer
        if p.ready():
            waited = 0
            batch = p.consume()
            hist: dict[int, int] = {}
            for stale in batch.trajectory_staleness:
                for s in stale:
                    hist[s] = hist.get(s, 0) + 1
            emit(
                f"step {batch.version:>2} (tick {tick:>3}): trained v{batch.version} -> "
                f"v{batch.version + 1} on groups {list(batch.group_ids)}; "
                f"staleness histogram {dict(sorted(hist.items()))}"
            )
        else:
            waited += 1
            if waited >= STUCK_AFTER and p.resolve_stuck().resolved:
                emit(f"          (tick {tick:>3}): buffer {p.current_version} was stuck; resolved")
        check_invariants(p)
    stats = p.stats()
    summary = {
        "steps": stats.consumed_batches,
        "ticks": tick,
        "trajectories_by_state": stats.trajectories_by_state,
        "aborts_by_reason": stats.aborts_by_reason,
        "replacements_requested": stats.replacements_requested,
        "staleness_histogram": stats.staleness_histogram,
        "syncs": syncs,
        "interrupted_for_sync": migrations,
        "abort_floor": stats.abort_floor,
    }
    emit("summary:")
    for key, value in summary.items():
        emit(f"  {key}: {value}")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description="Simulated RL loop embedding StalenessProtocol")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    run(args.steps, args.seed)


if __name__ == "__main__":
    main()
