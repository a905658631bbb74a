"""A worked example: the protocol embedded in a small simulated RL loop.

Run it with ``python -m staleness_protocol.example [--steps N] [--seed S] [--train-ticks T]``.

Three rollout instances generate GRPO groups in virtual ticks (random lengths, a long tail),
sync to the newest *published* version at their own pace (interrupting running work, which
resumes elsewhere with its V_traj kept — partial rollout and migration), and a trainer
consumes a batch whenever the protocol says one is READY, trains for ``train_ticks`` ticks and
only then publishes the new weights. DAPO-style filtering drops groups whose rewards are all
equal and the protocol asks for replacement prompts; group redundancy aborts surplus samples;
stuck buffers are resolved when the trainer has waited too long. Everything the protocol
decides on its own arrives as notices that this loop drains once per tick and acts on.

Each trajectory remembers the weights version its instance really had when generation
started; the summary checks that ``consumed buffer − that version`` never exceeds η.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from typing import Any

from . import (
    Abort,
    Admission,
    ProtocolConfig,
    ReplacementRequest,
    StalenessProtocol,
)
from .testing import check_invariants

CAPACITY = 10  # concurrent trajectories per instance
STUCK_AFTER = 10  # ticks the trainer waits before calling resolve_stuck()


class _Instance:
    def __init__(self, name: str) -> None:
        self.name = name
        self.weights = 0  # the version of the weights it holds (always a published one)
        self.running: dict[int, int] = {}  # trajectory id -> ticks left


def run(
    steps: int = 6, seed: int = 0, train_ticks: int = 3, emit: Callable[[str], None] = print
) -> dict[str, Any]:
    """Simulate until ``steps`` batches were trained and published; return a summary dict."""
    cfg = ProtocolConfig(
        batch_size=4, group_size=4, eta=2, group_redundancy=1, filtering=True, stuck_threshold=1
    )
    p = StalenessProtocol(cfg)
    rng = random.Random(seed)
    instances = [_Instance(f"inst{i}") for i in range(3)]
    parked: dict[int, int] = {}  # interrupted trajectories waiting to resume: id -> ticks left
    started_on: dict[int, int] = {}  # trajectory id -> weights version it was generated with
    doomed: set[int] = set()  # groups whose rewards will all be equal (filtered)
    finished_in: dict[int, int] = {}
    true_staleness: dict[int, int] = {}
    training: tuple[int, int] | None = None  # (version being trained, ticks left)
    next_group = next_traj = 0
    syncs = migrations = waited = tick = replacements = 0

    def length() -> int:
        return rng.randint(2, 6) if rng.random() > 0.1 else rng.randint(15, 25)  # long tail

    emit(f"config: {cfg}")
    while p.published_version < steps:
        tick += 1
        # 1. sync: a stale instance pulls the newest *published* weights when it must, or now
        #    and then when it is idle (never the version being trained: it does not exist yet)
        for inst in instances:
            if inst.weights < p.published_version and (
                p.must_sync(inst.weights) or not inst.running or rng.random() < 0.2
            ):
                parked.update(inst.running)  # interrupt: partial outputs go back to the queue
                migrations += len(inst.running)
                inst.running.clear()
                inst.weights = p.published_version
                syncs += 1
        # 2. route: resume parked trajectories first (any instance at version >= V_traj) ...
        for tid in list(parked):
            for inst in sorted(instances, key=lambda i: len(i.running)):
                if len(inst.running) < CAPACITY and p.can_resume(tid, inst.weights):
                    inst.running[tid] = parked.pop(tid)
                    break
        # ... then admit new prompts; a group's samples spread over instances (and versions)
        for inst in instances:
            while CAPACITY - len(inst.running) >= 2 and (
                p.can_reserve(next_group, inst.weights) is Admission.ADMIT
            ):
                gid, next_group = next_group, next_group + 1
                if rng.random() < 0.15:
                    doomed.add(gid)
                for m in range(cfg.samples_per_group):
                    target = inst if m % 2 == 0 else rng.choice(instances)
                    if (
                        len(target.running) >= CAPACITY
                        or p.can_reserve(gid, target.weights) is not Admission.ADMIT
                    ):
                        target = inst
                    p.reserve(gid, next_traj, target.weights)
                    target.running[next_traj] = length()
                    started_on[next_traj] = target.weights
                    next_traj += 1
        # 3. generate one tick; finished trajectories are rewarded and reported
        for inst in instances:
            for tid in list(inst.running):
                inst.running[tid] -= 1
                if inst.running[tid] > 0:
                    continue
                del inst.running[tid]
                if p.live_version(tid) is None:
                    continue  # aborted by the protocol this tick; its notice is queued
                gid = int(p.trajectory(tid).group_id)
                finished_in[gid] = finished_in.get(gid, 0) + 1
                if gid in doomed and finished_in[gid] == cfg.group_size:
                    p.drop_group(gid, "all rewards equal")  # DAPO dynamic sampling
                else:
                    p.finish(tid)
        # 4. act on what the protocol decided: stop aborted work, count replacement prompts
        for notice in p.take_notices():
            if isinstance(notice, Abort):
                for inst in instances:
                    inst.running.pop(notice.trajectory_id, None)  # type: ignore[arg-type]
                parked.pop(notice.trajectory_id, None)  # type: ignore[arg-type]
            elif isinstance(notice, ReplacementRequest):
                replacements += 1  # new prompts are admitted by routing anyway
        # 5. the trainer: consume when READY, train for a while, then publish the new weights
        if training is not None:
            version, left = training
            training = (version, left - 1) if left > 1 else None
            if training is None:
                p.publish(version + 1)
                emit(f"          (tick {tick:>3}): published v{version + 1}")
        if training is None and p.next_buffer < steps and p.ready():
            waited = 0
            batch = p.consume()
            hist: dict[int, int] = {}
            for tids in batch.trajectory_ids:
                for t in tids:
                    s = batch.version - started_on[int(t)]
                    hist[s] = hist.get(s, 0) + 1
                    true_staleness[s] = true_staleness.get(s, 0) + 1
            training = (batch.version, train_ticks)
            emit(
                f"step {batch.version:>2} (tick {tick:>3}): training v{batch.version} -> "
                f"v{batch.version + 1} on groups {list(batch.group_ids)}; "
                f"true staleness histogram {dict(sorted(hist.items()))}"
            )
        elif training is None:
            waited += 1
            if waited >= STUCK_AFTER and p.resolve_stuck().resolved:
                emit(f"          (tick {tick:>3}): buffer {p.next_buffer} was stuck; resolved")
        check_invariants(p)
    stats = p.stats()
    summary = {
        "steps": stats.consumed_batches,
        "ticks": tick,
        "trajectories_by_state": stats.trajectories_by_state,
        "aborts_by_reason": stats.aborts_by_reason,
        "replacements_requested": stats.replacements_requested,
        "replacements_drained": replacements,
        "staleness_histogram": stats.staleness_histogram,
        "true_staleness_histogram": dict(sorted(true_staleness.items())),
        "syncs": syncs,
        "interrupted_for_sync": migrations,
        "abort_floor": stats.abort_floor,
        "checkpoint_trajectories": len(p.to_dict()["trajectories"]),
    }
    emit("summary:")
    for key, value in summary.items():
        emit(f"  {key}: {value}")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description="Simulated RL loop embedding StalenessProtocol")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-ticks", type=int, default=3, help="ticks a training step takes")
    args = ap.parse_args()
    run(args.steps, args.seed, args.train_ticks)


if __name__ == "__main__":
    main()
