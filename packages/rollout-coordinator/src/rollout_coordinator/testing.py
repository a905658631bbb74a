"""Builders for hand-made snapshots, queue items and a coordinator over the real protocol.

For tests of this package and of code that embeds the coordinator (simulators, apps).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from rollout_coordinator import (
    Command,
    Coordinator,
    CoordinatorConfig,
    InstanceSnapshot,
    Interrupt,
    QueuedTrajectory,
    Route,
    RunningEntry,
    RunningRows,
    Sync,
)
from staleness_protocol import ProtocolConfig, StalenessProtocol

CAP = 100_000


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


_seq = itertools.count(1)


def snap(
    iid: str,
    *,
    version: int = 0,
    n: int = 0,
    tokens_each: int = 1000,
    waiting: int = 0,
    t: float = 0.0,
    cap: int = CAP,
    tput: float = 0.0,
    running: tuple[RunningEntry, ...] | None = None,
) -> InstanceSnapshot:
    if running is None:
        running = tuple(
            RunningEntry(trajectory_id=f"{iid}-r{k}", prompt_tokens=tokens_each, generated_tokens=0)
            for k in range(n)
        )
    kv = sum(e.tokens for e in running)
    return InstanceSnapshot(
        instance_id=iid,
        seq=next(_seq),
        time_s=t,
        version=version,
        running=running,
        waiting=waiting,
        kv_used_tokens=kv,
        kv_capacity_tokens=cap,
        throughput_tokens_per_s=tput,
    )


def as_running_rows(s: InstanceSnapshot) -> InstanceSnapshot:
    """``s`` with its running list as :class:`RunningRows` (the last entry as the tail, the
    generated counts split into columns and an offset), built unchecked as a simulator does."""
    head = s.running[:-1]
    off = min((e.generated_tokens for e in head), default=0)
    rows = RunningRows(
        tuple(e.trajectory_id for e in head),
        tuple(e.prompt_tokens for e in head),
        tuple(e.generated_tokens - off for e in head),
        off,
        tuple(s.running[-1:]),
    )
    return InstanceSnapshot.unchecked(
        s.instance_id,
        s.seq,
        s.time_s,
        s.version,
        rows,
        s.waiting,
        s.kv_used_tokens,
        s.kv_capacity_tokens,
        s.throughput_tokens_per_s,
    )


def new(tid: str, group: str = "g0", length: int = 500) -> QueuedTrajectory:
    return QueuedTrajectory(trajectory_id=tid, group_id=group, v_traj=None, prompt_len=length)


def partial(
    tid: str, v: int, group: str = "gp", length: int = 500, gen: int = 100
) -> QueuedTrajectory:
    return QueuedTrajectory(
        trajectory_id=tid, group_id=group, v_traj=v, prompt_len=length, generated_len=gen
    )


def make(
    policy: str = "staleflow",
    *,
    batch: int = 4,
    group: int = 2,
    eta: int = 2,
    start_version: int = 0,
    instances: Iterable[tuple[str, int]] = (),
    **cfg: Any,
) -> tuple[Coordinator, StalenessProtocol, Clock]:
    proto = StalenessProtocol(
        ProtocolConfig(batch_size=batch, group_size=group, eta=eta), start_version=start_version
    )
    clock = Clock()
    coord = Coordinator(CoordinatorConfig(policy=policy, **cfg), proto, clock)
    for iid, v in instances:
        coord.add_instance(iid, kv_capacity_tokens=CAP, version=v)
    return coord, proto, clock


def routes(cmds: Iterable[Command]) -> dict[str, str]:
    """A cycle's routes: trajectory id -> instance id."""
    return {c.trajectory_id: c.instance_id for c in cmds if isinstance(c, Route)}


def syncs(cmds: Iterable[Command]) -> dict[str, int]:
    """A cycle's syncs: instance id -> the version it syncs to."""
    return {c.instance_id: c.to_version for c in cmds if isinstance(c, Sync)}


def interrupts(cmds: Iterable[Command]) -> list[Interrupt]:
    """A cycle's interrupts, in order."""
    return [c for c in cmds if isinstance(c, Interrupt)]
