"""Load-balancing plan: link-class preference, balance, and greedy vs brute-force optimum."""

from __future__ import annotations

import itertools
import random

import pytest

from param_server._plan import (
    LinkClass,
    PlanRequest,
    SliceRef,
    plan_transfers,
    uniform_link,
)
from param_server.errors import UsageError

SHM = LinkClass(name="shm", rank=0, bandwidth_bytes_per_s=1e9, latency_s=1e-4)
RDMA = LinkClass(name="rdma", rank=1, bandwidth_bytes_per_s=4e9, latency_s=1e-5)
TCP = LinkClass(name="tcp", rank=2, bandwidth_bytes_per_s=1e8, latency_s=1e-3)


def _model(n: int, nbytes: int) -> list[SliceRef]:
    return [SliceRef(name=f"t{i}", index=0, nbytes=nbytes) for i in range(n)]


def test_4_workers_16_receivers_full_replication_is_balanced() -> None:
    workers = [f"ps{i}" for i in range(4)]
    receivers = [f"r{i}" for i in range(16)]
    slices = _model(64, 16 << 20)
    reqs = [PlanRequest(receiver=r, slice=s, holders=workers) for r in receivers for s in slices]
    plan = plan_transfers(reqs, uniform_link(SHM))
    assert len(plan.assignments) == 16 * 64
    loads = list(plan.load_s.values())
    mean = sum(loads) / len(loads)
    assert max(loads) / mean <= 1.01
    # every (receiver, slice) assigned exactly once
    assert len({(a.receiver, a.slice.name) for a in plan.assignments}) == 16 * 64


def test_best_link_class_wins_even_when_loaded() -> None:
    # ps0/ps1 share a host with r0..r7, ps2/ps3 with r8..r15; cross-host traffic is TCP.
    host = {"ps0": 0, "ps1": 0, "ps2": 1, "ps3": 1}

    def link(holder: str, receiver: str) -> LinkClass:
        return SHM if host[holder] == int(receiver[1:]) // 8 else TCP

    workers = list(host)
    reqs = [
        PlanRequest(receiver=f"r{r}", slice=s, holders=workers)
        for r in range(16)
        for s in _model(8, 1 << 20)
    ]
    plan = plan_transfers(reqs, link, initial_load={"ps0": 100.0})
    for a in plan.assignments:
        assert a.link is SHM, a
    # ps0 starts loaded, so its host-mate ps1 takes that host's traffic
    by = plan.by_holder()
    assert "ps0" not in by
    assert len(by["ps1"]) == 8 * 8


def test_restricted_holders_respected() -> None:
    reqs = [
        PlanRequest(receiver="r", slice=SliceRef(name="a", index=0, nbytes=10), holders=["w1"]),
        PlanRequest(
            receiver="r", slice=SliceRef(name="b", index=0, nbytes=10), holders=["w0", "w1"]
        ),
    ]
    plan = plan_transfers(reqs, uniform_link(SHM))
    got = {a.slice.name: a.holder for a in plan.assignments}
    assert got == {"a": "w1", "b": "w0"}


def test_no_holder_rejected() -> None:
    with pytest.raises(UsageError, match="no holder"):
        PlanRequest(receiver="r", slice=SliceRef(name="a", index=0, nbytes=1), holders=[])


def test_bad_link_rejected() -> None:
    with pytest.raises(UsageError, match="bandwidth"):
        LinkClass(name="x", rank=0, bandwidth_bytes_per_s=0, latency_s=0)


def _brute_force_makespan(reqs: list[PlanRequest], link) -> float:  # type: ignore[no-untyped-def]
    choices = []
    for r in reqs:
        best = min(link(h, r.receiver).rank for h in r.holders)
        choices.append([h for h in r.holders if link(h, r.receiver).rank == best])
    best_ms = float("inf")
    for combo in itertools.product(*choices):
        load: dict[str, float] = {}
        for r, h in zip(reqs, combo, strict=True):
            load[h] = load.get(h, 0.0) + link(h, r.receiver).estimate_s(r.slice.nbytes)
        best_ms = min(best_ms, max(load.values()))
    return best_ms


GREEDY_FACTOR = 4 / 3  # LPT's bound on identical machines; checked on random restricted cases


@pytest.mark.parametrize("seed", range(60))
def test_greedy_within_factor_of_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    workers = [f"w{i}" for i in range(rng.randint(2, 3))]
    n = rng.randint(3, 8)
    reqs = []
    for i in range(n):
        k = rng.randint(2, len(workers))
        reqs.append(
            PlanRequest(
                receiver=f"r{rng.randint(0, 2)}",
                slice=SliceRef(name=f"t{i}", index=0, nbytes=rng.randint(1, 100) << 20),
                holders=rng.sample(workers, k),
            )
        )
    link = uniform_link(SHM)
    plan = plan_transfers(reqs, link)
    opt = _brute_force_makespan(reqs, link)
    assert plan.makespan_s <= GREEDY_FACTOR * opt + 1e-12, (plan.makespan_s, opt)


def test_greedy_is_not_trivially_optimal_detector() -> None:
    # The classic LPT worst case for 2 machines: 3,3,2,2,2 -> greedy 7, optimum 6.
    reqs = [
        PlanRequest(
            receiver="r", slice=SliceRef(name=f"t{i}", index=0, nbytes=b), holders=["a", "b"]
        )
        for i, b in enumerate([3, 3, 2, 2, 2])
    ]
    link = uniform_link(LinkClass(name="u", rank=0, bandwidth_bytes_per_s=1, latency_s=0))
    plan = plan_transfers(reqs, link)
    assert plan.makespan_s == 7
    assert _brute_force_makespan(reqs, link) == 6
