"""GcFifo: FIFO consumption that keeps η by discarding too-stale groups (the strict-async
baselines' way), checked rule by rule and on random schedules."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_protocol import (
    GC_FIFO_FORMAT,
    Abort,
    AbortReason,
    Admission,
    BelowAbortFloor,
    ConfigError,
    CorruptState,
    FinishStatus,
    GcFifo,
    GcFifoConfig,
    GroupAborted,
    GroupState,
    TrajectoryState,
    UnboundedFifo,
    protocol_from_dict,
)


def gc(b: int = 1, n: int = 1, eta: int = 1, cap: int = 8, **kw: Any) -> GcFifo:
    return GcFifo(GcFifoConfig(batch_size=b, group_size=n, eta=eta, max_inflight_groups=cap, **kw))


def finish_group(p: GcFifo, gid: str, version: int) -> None:
    p.reserve(gid, f"{gid}/0", version)
    p.finish(f"{gid}/0")


def advance(p: GcFifo) -> None:
    """Consume a batch and publish the version its step produces."""
    p.publish(p.consume().version + 1)


def test_floor_is_next_buffer_minus_eta_minus_one() -> None:
    p = gc(eta=1)
    assert p.abort_floor == -2 and not p.must_sync(0)
    for i in range(3):
        finish_group(p, f"g{i}", p.published_version)
        advance(p)
    assert p.next_buffer == 3 and p.abort_floor == 1
    assert p.must_sync(1) and not p.must_sync(2)
    assert p.can_reserve("new", 1) is Admission.SYNC
    assert p.can_reserve("new", 2) is Admission.ADMIT
    with pytest.raises(BelowAbortFloor, match="abort floor 1") as e:
        p.reserve("new", "new/0", 1)
    assert e.value.abort_floor == 1
    assert p.stats().groups_by_state["reserved"] == 0  # nothing recorded


def test_consume_discards_what_fell_below_the_floor_in_flight_and_waiting() -> None:
    """Version-0 work, in flight or finished behind a full batch, is aborted (reason stale)
    once version 0 can no longer be trained; the rest keeps its FIFO order."""
    p = gc(b=1, eta=1)
    p.reserve("slow", "slow/0", 0)  # runs for ever
    finish_group(p, "a", 0)
    finish_group(p, "b", 0)  # waits behind a
    advance(p)  # trains a at version 0 → next 1, floor −1: nothing stale yet
    assert p.take_notices() == ()
    finish_group(p, "c", 1)
    advance(p)  # trains b (staleness 1) → next 2, floor 0: slow (v0) is stale
    assert p.take_notices() == (
        Abort(
            trajectory_id="slow/0",
            group_id="slow",
            version=0,
            reason=AbortReason.STALE.value,
            was_running=True,
        ),
        GroupAborted(group_id="slow", reason="stale"),
    )
    assert p.finish("slow/0").status is FinishStatus.ALREADY_ENDED  # it finished too late
    assert p.group("slow").state is GroupState.ABORTED
    assert p.fifo() == ("c",)
    finish_group(p, "d", 1)
    finish_group(p, "e", 2)
    batch = p.consume()  # c (v1) at version 2 → next 3, floor 1: d (v1, waiting) discarded
    assert batch.group_ids == ("c",) and batch.staleness == (1,)
    abort, closed = p.take_notices()
    assert isinstance(abort, Abort) and isinstance(closed, GroupAborted)
    assert (abort.trajectory_id, abort.was_running, closed.group_id) == ("d/0", False, "d")
    assert p.trajectory("d/0").state is TrajectoryState.ABORTED
    assert p.fifo() == ("e",)
    assert p.stats().aborts_by_reason == {"stale": 2}


def test_next_batch_groups_never_lists_what_consume_then_discards() -> None:
    """What ages out is discarded right after a consume, so between two consumes the head of
    the FIFO is exactly the next batch (the same scenario as above)."""
    p = gc(b=1, eta=1)
    finish_group(p, "a", 0)
    finish_group(p, "b", 0)
    assert p.next_batch_groups() == ("a",)
    advance(p)
    assert p.next_batch_groups() == ("b",)
    finish_group(p, "c", 1)
    finish_group(p, "d", 1)
    assert p.consume().group_ids == ("b",)
    p.publish(2)
    assert p.next_batch_groups() == ("c",)
    finish_group(p, "e", 2)
    assert p.consume().group_ids == ("c",)  # → next 3, floor 1: d discarded
    assert p.next_batch_groups() == ("e",)


def test_a_sibling_that_would_make_its_group_too_stale_is_refused() -> None:
    """A live group (first member at version 1) takes no sibling from an instance still at a
    version ≤ the floor: the group's version would drop below what can be trained."""
    p = gc(b=1, n=2, eta=1)
    for i in range(2):
        p.reserve(f"h{i}", f"h{i}/0", p.published_version)
        p.reserve(f"h{i}", f"h{i}/1", p.published_version)
        p.finish(f"h{i}/0")
        p.finish(f"h{i}/1")
        advance(p)
    assert p.next_buffer == 2 and p.abort_floor == 0
    p.reserve("g", "g/0", 1)
    assert p.can_reserve("g", 0) is Admission.SYNC
    assert p.can_reserve("g", 1) is Admission.ADMIT
    with pytest.raises(BelowAbortFloor):
        p.reserve("g", "g/1", 0)
    assert p.group("g").members == ("g/0",)


def test_consumed_staleness_never_exceeds_eta_where_the_unbounded_fifo_goes_past_it() -> None:
    """The same schedule: UnboundedFifo trains an old group at staleness 3; GcFifo (η=1)
    discards it and trains only groups within the bound."""
    runs: dict[str, list[int]] = {}
    for name, p in (
        ("gc", gc(b=1, eta=1, tombstone_versions=8)),
        (
            "unbounded",
            UnboundedFifo(GcFifoConfig(batch_size=1, group_size=1, eta=1, max_inflight_groups=8)),
        ),
    ):
        p.reserve("old", "old/0", 0)
        stale: list[int] = []
        for i in range(3):
            finish_group(p, f"g{i}", p.published_version)  # type: ignore[arg-type]
            batch = p.consume()
            p.publish(batch.version + 1)
            stale.extend(batch.staleness)
        if p.finish("old/0").status is not FinishStatus.ALREADY_ENDED:
            finish_group(p, "last", p.published_version)  # type: ignore[arg-type]
            stale.extend(p.consume().staleness)
        runs[name] = stale
    assert max(runs["unbounded"]) == 3
    assert max(runs["gc"]) <= 1


def test_checkpoint_round_trip_and_format_dispatch() -> None:
    p = gc(b=2, n=1, eta=2)
    finish_group(p, "a", 0)
    p.reserve("b", "b/0", 0)
    d = p.to_dict()
    assert d["format"] == GC_FIFO_FORMAT and d["config"]["eta"] == 2
    q = protocol_from_dict(json.loads(json.dumps(d)))
    assert isinstance(q, GcFifo) and q.to_dict() == d and q.abort_floor == p.abort_floor
    with pytest.raises(CorruptState):
        UnboundedFifo.from_dict(d)  # an unbounded run cannot resume a bounded FIFO
    with pytest.raises(CorruptState):
        GcFifo.from_dict(
            UnboundedFifo(
                GcFifoConfig(batch_size=1, group_size=1, eta=0, max_inflight_groups=1)
            ).to_dict()
        )


@pytest.mark.parametrize("eta", [-1, "1", None, True])
def test_bad_eta_names_the_field(eta: Any) -> None:
    with pytest.raises(ConfigError, match="eta"):
        GcFifoConfig(batch_size=1, group_size=1, eta=eta, max_inflight_groups=1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 9)), min_size=1, max_size=80))
def test_random_schedules_keep_eta_and_lose_nothing(ops: list[tuple[int, int]]) -> None:
    """Random reserve/finish/consume/checkpoint at any admissible version: every consumed
    group is within η, every admitted trajectory is accounted for, and nothing left in the
    FIFO or in flight is below the floor after a consume."""
    eta = 1
    p = gc(b=2, n=2, eta=eta, cap=6)
    admitted = 0
    for op, arg in ops:
        if op in (0, 1):  # admit a new group at any published version above the floor
            lo = max(0, p.abort_floor + 1)
            if lo > p.published_version:
                continue
            v = lo + arg % (p.published_version - lo + 1)
            gid = f"g{admitted}"
            if p.can_reserve(gid, v) is Admission.ADMIT:
                p.reserve(gid, f"{gid}/0", v)
                p.reserve(gid, f"{gid}/1", v)
                admitted += 1
        elif op == 2 and p.in_flight():
            p.finish(p.in_flight()[arg % len(p.in_flight())])
        elif op == 3 and p.ready():
            batch = p.consume()
            p.publish(batch.version + 1)
            assert max(batch.staleness) <= eta
            floor = p.abort_floor
            for tid in p.in_flight():
                assert p.trajectory(tid).version > floor
        elif op == 4:
            d = p.to_dict()
            p = GcFifo.from_dict(json.loads(json.dumps(d)))  # type: ignore[assignment]
            assert p.to_dict() == d
        states = p.stats().trajectories_by_state
        assert sum(states.values()) == 2 * admitted
    assert all(int(k) <= eta for k in p.stats().group_staleness_histogram)
