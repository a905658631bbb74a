"""A single-controller RL loop in the style of verl, with the staleness protocol inside it.

One driver process — the single controller — owns a ``StalenessProtocol`` and orchestrates
Ray actors: rollout workers that generate samples with the weights they hold (a toy policy:
random response lengths and a reward that depends on the weights version), and a trainer
actor that trains on a consumed batch, takes real time doing it, and returns new weights.
The driver publishes a version to the protocol only once the trainer has returned its
weights, and only then tells the rollout workers to load them.

Every sample carries the weights version its worker really held when it started generating
it; the driver records ``consumed buffer − that version`` for every trained sample (the true
staleness), which never exceeds η whatever the training time.

    python examples/protocol_single_controller.py --eta 1 --train-delay 0.3 --steps 6
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import deque
from typing import Any

import ray

from staleness_protocol import (
    Abort,
    Admission,
    GroupAborted,
    ProtocolConfig,
    ReplacementRequest,
    StalenessProtocol,
)

TICK_S = 0.004  # generation time of one toy token
POLL_S = 0.005  # the controller's cycle
MAX_RUNNING = 12  # concurrent samples per rollout worker


def toy_reward(weights_version: int, prompt: str, length: int) -> float:
    """A reward that depends on the policy that generated the sample (its weights version)."""
    return float((hash(prompt) + weights_version + length) % 3 == 0)


@ray.remote(num_cpus=0)
class RolloutWorker:
    """Generates samples with the weights it holds; each result is stamped with them."""

    def __init__(self, seed: int) -> None:
        self.version = 0
        self.rng = random.Random(seed)
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.done: list[dict[str, Any]] = []

    async def load_weights(self, version: int) -> int:
        self.version = version  # samples already running keep the version they started with
        return version

    async def submit(self, requests: list[tuple[str, str]]) -> None:
        for tid, prompt in requests:
            start_version = self.version  # generation starts now, with these weights
            self.tasks[tid] = asyncio.ensure_future(self._generate(tid, prompt, start_version))

    async def _generate(self, tid: str, prompt: str, start_version: int) -> None:
        length = self.rng.randint(1, 8) if self.rng.random() > 0.05 else self.rng.randint(20, 40)
        await asyncio.sleep(length * TICK_S)
        self.tasks.pop(tid, None)
        self.done.append(
            {
                "trajectory_id": tid,
                "weights_version": start_version,
                "tokens": length,
                "reward": toy_reward(start_version, prompt, length),
            }
        )

    async def abort(self, trajectory_ids: list[str]) -> None:
        for tid in trajectory_ids:
            task = self.tasks.pop(tid, None)
            if task is not None:
                task.cancel()

    async def poll(self) -> list[dict[str, Any]]:
        out, self.done = self.done, []
        return out


@ray.remote(num_cpus=0)
class Trainer:
    """Trains version ``v`` into ``v + 1`` on a batch; a step takes ``delay_s`` seconds."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def train(self, version: int, samples: list[dict[str, Any]]) -> int:
        time.sleep(self.delay_s)  # the real time a training step takes
        assert all(s["weights_version"] <= version for s in samples)
        return version + 1  # the new weights (their version stands for them here)


def run(
    *,
    eta: int,
    train_delay_s: float,
    steps: int = 6,
    workers: int = 3,
    batch_size: int = 4,
    group_size: int = 4,
    seed: int = 0,
) -> dict[str, Any]:
    """Train ``steps`` steps; returns the true and the protocol's staleness histograms."""
    p = StalenessProtocol(
        ProtocolConfig(batch_size=batch_size, group_size=group_size, eta=eta, group_redundancy=1)
    )
    rollout = [RolloutWorker.remote(seed * 100 + i) for i in range(workers)]  # type: ignore[attr-defined]
    trainer = Trainer.remote(train_delay_s)  # type: ignore[attr-defined]
    held = [0] * workers  # the weights each worker holds (it loaded what the driver sent)
    running: list[set[str]] = [set() for _ in range(workers)]
    where: dict[str, int] = {}  # trajectory id -> worker running it
    results: dict[str, dict[str, Any]] = {}  # finished samples waiting to be trained
    queue: deque[str] = deque()
    serial = 0
    training: Any = None  # the trainer's pending step
    true_staleness: dict[int, int] = {}
    started = time.monotonic()
    while p.published_version < steps:
        while len(queue) < 2 * batch_size:  # the data loader
            queue.append(f"prompt{serial}")
            serial += 1
        # 1. admission: each queued prompt becomes a group on one worker, or stays queued
        submits: list[list[tuple[str, str]]] = [[] for _ in range(workers)]
        for _ in range(len(queue)):
            gid = queue.popleft()
            order = sorted(range(workers), key=lambda i: len(running[i]))
            for i in order:
                if len(running[i]) + p.config.samples_per_group > MAX_RUNNING:
                    continue
                answer = p.can_reserve(gid, held[i])
                if answer is Admission.ADMIT:
                    for k in range(p.config.samples_per_group):
                        tid = f"{gid}/{k}"
                        p.reserve(gid, tid, held[i])
                        submits[i].append((tid, gid))
                        running[i].add(tid)
                        where[tid] = i
                    break
            else:
                queue.append(gid)  # WAIT (or no room on any worker): ask again next cycle
        for i, reqs in enumerate(submits):
            if reqs:
                rollout[i].submit.remote(reqs)
        # 2. results: finished samples are rewarded and reported
        for i, done in enumerate(ray.get([w.poll.remote() for w in rollout])):
            for r in done:
                tid = r["trajectory_id"]
                running[i].discard(tid)
                where.pop(tid, None)
                if p.live_version(tid) is None:
                    continue  # the protocol aborted it while it ran: discard
                results[tid] = r
                p.finish(tid)
        # 3. what the protocol decided: stop aborted samples, forget closed groups
        aborts: dict[int, list[str]] = {}
        for notice in p.take_notices():
            if isinstance(notice, Abort):
                tid = str(notice.trajectory_id)
                results.pop(tid, None)
                i = where.pop(tid, None)
                if i is not None:
                    running[i].discard(tid)
                    aborts.setdefault(i, []).append(tid)
            elif isinstance(notice, GroupAborted | ReplacementRequest):
                pass  # each group is admitted whole, and prompts never run out here
        for i, ids in aborts.items():
            rollout[i].abort.remote(ids)
        # 4. the trainer: train a READY batch, then publish and load the new weights
        if training is None and p.next_buffer < steps and p.ready():
            batch = p.consume()
            samples = [results.pop(str(t)) for g in batch.trajectory_ids for t in g]
            for s in samples:
                st = batch.version - s["weights_version"]
                true_staleness[st] = true_staleness.get(st, 0) + 1
            training = trainer.train.remote(batch.version, samples)
        elif training is not None and ray.wait([training], timeout=0)[0]:
            version = ray.get(training)
            training = None
            p.publish(version)  # the weights exist now: admission at this version opens
            ray.get([w.load_weights.remote(version) for w in rollout])
            held = [version] * workers
        time.sleep(POLL_S)
    for w in rollout:
        ray.kill(w)
    ray.kill(trainer)
    stats = p.stats()
    return {
        "eta": eta,
        "train_delay_s": train_delay_s,
        "steps": stats.consumed_batches,
        "true_staleness_histogram": dict(sorted(true_staleness.items())),
        "protocol_staleness_histogram": stats.staleness_histogram,
        "aborts_by_reason": stats.aborts_by_reason,
        "wall_s": round(time.monotonic() - started, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description="verl-style single controller embedding the protocol")
    ap.add_argument("--eta", type=int, default=1)
    ap.add_argument("--train-delay", type=float, default=0.3, help="seconds per training step")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--workers", type=int, default=3)
    args = ap.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    report = run(
        eta=args.eta, train_delay_s=args.train_delay, steps=args.steps, workers=args.workers
    )
    for key, value in report.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
