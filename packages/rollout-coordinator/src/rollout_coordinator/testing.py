"""Builders for hand-made snapshots, queue items and a coordinator over the real protocol.

For tests of this package and of code that embeds the coordinator (simulators, apps).
"""

from __future__ import annotations

import itertools

from rollout_coordinator import (
    Coordinator,
    CoordinatorConfig,
    InstanceSnapshot,
    QueuedTrajectory,
    RunningEntry,
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
    iid, *, version=0, n=0, tokens_each=1000, waiting=0, t=0.0, cap=CAP, tput=0.0, running=None
):
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


def new(tid, group="g0", length=500):
    return QueuedTrajectory(trajectory_id=tid, group_id=group, v_traj=None, prompt_len=length)


def partial(tid, v, group="gp", length=500, gen=100):
    return QueuedTrajectory(
        trajectory_id=tid, group_id=group, v_traj=v, prompt_len=length, generated_len=gen
    )


def make(
    policy="staleflow",
    *,
    batch=4,
    group=2,
    eta=2,
    start_version=0,
    instances=(),
    latest_version=None,
    **cfg,
):
    proto = StalenessProtocol(
        ProtocolConfig(batch_size=batch, group_size=group, eta=eta), start_version=start_version
    )
    clock = Clock()
    coord = Coordinator(
        CoordinatorConfig(policy=policy, **cfg), proto, clock, latest_version=latest_version
    )
    for iid, v in instances:
        coord.add_instance(iid, kv_capacity_tokens=CAP, version=v)
    return coord, proto, clock
