"""A streaming rollout/trainer loop in the style of AReaL or slime, with the staleness protocol.

Rollout workers generate continuously and stream every finished sample into an asyncio queue;
a trainer takes a batch whenever one is ready, trains for a while and publishes new weights,
which the workers pull as soon as they see them. Between the two sits a controller task that
owns the ``StalenessProtocol``: it decides which prompts a worker may start (admission at the
version the worker holds), files finished samples (``finish``), hands READY batches to the
trainer (``consume``) and publishes versions the trainer produced (``publish``). Everything
runs on one event loop and the protocol is only touched between ``await``s, so it needs no
lock.

Every sample carries the weights version its worker really held when it started generating
it; the trainer records ``consumed buffer − that version`` for every sample it trains (the
true staleness), which never exceeds η whatever the training time.

    python examples/protocol_streaming.py --eta 2 --train-delay 0.1 --steps 8
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import deque
from typing import Any

from staleness_protocol import (
    Abort,
    Admission,
    Batch,
    ProtocolConfig,
    StalenessProtocol,
)

TICK_S = 0.002  # generation time of one toy token
SYNC_S = 0.005  # time to pull new weights


class Controller:
    """Owns the protocol; every method runs without awaiting, so calls never interleave."""

    def __init__(self, p: StalenessProtocol, batches: asyncio.Queue[Batch | None], steps: int):
        self.p = p
        self.batches = batches
        self.steps = steps
        self.prompts: deque[str] = deque()
        self.serial = 0
        self.tasks: dict[str, asyncio.Task[None]] = {}  # trajectory id -> its generation
        self.samples: dict[str, dict[str, Any]] = {}  # finished, waiting to be trained
        self.trainer_busy = False

    def admit(self, version: int) -> list[tuple[str, str]]:
        """A worker holding ``version`` asks for work: one group, or nothing (wait)."""
        p = self.p
        while len(self.prompts) < 4:
            self.prompts.append(f"prompt{self.serial}")
            self.serial += 1
        gid = self.prompts[0]
        if p.can_reserve(gid, version) is not Admission.ADMIT:
            return []  # WAIT, or SYNC: the worker pulls newer weights before asking again
        self.prompts.popleft()
        out = []
        for k in range(p.config.samples_per_group):
            tid = f"{gid}/{k}"
            p.reserve(gid, tid, version)
            out.append((tid, gid))
        return out

    def finished(self, sample: dict[str, Any]) -> None:
        tid = sample["trajectory_id"]
        self.tasks.pop(tid, None)
        if self.p.live_version(tid) is None:
            return  # aborted while it ran
        self.samples[tid] = sample
        self.p.finish(tid)
        self.act()

    def published(self, version: int) -> None:
        self.p.publish(version)
        self.trainer_busy = False
        self.act()

    def act(self) -> None:
        """Drain the notices, and hand the trainer a batch when it is idle."""
        p = self.p
        for notice in p.take_notices():
            if isinstance(notice, Abort):
                tid = str(notice.trajectory_id)
                self.samples.pop(tid, None)
                task = self.tasks.pop(tid, None)
                if task is not None:
                    task.cancel()
        if not self.trainer_busy and p.next_buffer < self.steps and p.ready():
            self.trainer_busy = True
            self.batches.put_nowait(p.consume())


async def rollout_worker(
    c: Controller, latest: dict[str, int], stop: asyncio.Event, seed: int
) -> None:
    """Pulls the newest published weights when it sees them, then streams samples."""
    rng = random.Random(seed)
    version = 0
    running: set[asyncio.Task[None]] = set()

    async def generate(tid: str, prompt: str, start_version: int) -> None:
        length = rng.randint(1, 8) if rng.random() > 0.05 else rng.randint(20, 40)
        await asyncio.sleep(length * TICK_S)
        c.finished({"trajectory_id": tid, "weights_version": start_version, "tokens": length})

    while not stop.is_set():
        if latest["version"] > version:
            await asyncio.sleep(SYNC_S)  # pull the weights; running samples keep theirs
            version = latest["version"]
        running = {t for t in running if not t.done()}
        work = c.admit(version) if len(running) < 12 else []
        for tid, prompt in work:
            task = asyncio.ensure_future(generate(tid, prompt, version))
            c.tasks[tid] = task
            running.add(task)
        await asyncio.sleep(TICK_S if not work else 0)
    for t in running:
        t.cancel()


async def trainer(
    c: Controller,
    batches: asyncio.Queue[Batch | None],
    latest: dict[str, int],
    delay_s: float,
    true_staleness: dict[int, int],
) -> None:
    while (batch := await batches.get()) is not None:
        for group in batch.trajectory_ids:
            for tid in group:
                s = batch.version - c.samples.pop(str(tid))["weights_version"]
                true_staleness[s] = true_staleness.get(s, 0) + 1
        await asyncio.sleep(delay_s)  # the training step
        latest["version"] = batch.version + 1  # the new weights can be pulled now
        c.published(batch.version + 1)


async def run(
    *,
    eta: int,
    train_delay_s: float,
    steps: int = 8,
    workers: int = 3,
    batch_size: int = 4,
    group_size: int = 4,
    seed: int = 0,
) -> dict[str, Any]:
    """Train ``steps`` steps; returns the true and the protocol's staleness histograms."""
    p = StalenessProtocol(
        ProtocolConfig(batch_size=batch_size, group_size=group_size, eta=eta, group_redundancy=1)
    )
    batches: asyncio.Queue[Batch | None] = asyncio.Queue()
    c = Controller(p, batches, steps)
    latest = {"version": 0}
    stop = asyncio.Event()
    true_staleness: dict[int, int] = {}
    started = time.monotonic()
    train = asyncio.ensure_future(trainer(c, batches, latest, train_delay_s, true_staleness))
    rollout = [
        asyncio.ensure_future(rollout_worker(c, latest, stop, seed * 100 + i))
        for i in range(workers)
    ]
    while p.published_version < steps:
        await asyncio.sleep(0.01)
        if train.done():
            train.result()  # surface a failure
    stop.set()
    await batches.put(None)
    await asyncio.gather(*rollout, train)
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
    ap = argparse.ArgumentParser(description="AReaL/slime-style streaming loop with the protocol")
    ap.add_argument("--eta", type=int, default=2)
    ap.add_argument("--train-delay", type=float, default=0.1, help="seconds per training step")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    report = asyncio.run(run(eta=args.eta, train_delay_s=args.train_delay, steps=args.steps))
    for key, value in report.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
