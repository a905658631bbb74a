"""UnboundedFifo: cap admission, FIFO consume, staleness measured (not bounded), checkpoints,
bad input — and, against the bounded protocol, what the bound prevents."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sp_helpers import make

from staleness_protocol import (
    UNBOUNDED_FORMAT,
    Abort,
    AbortReason,
    Admission,
    ConfigError,
    CorruptState,
    DuplicateTrajectory,
    FinishStatus,
    GroupClosed,
    GroupFull,
    GroupNotDroppable,
    GroupState,
    InvalidId,
    InvalidVersion,
    NoFreeSlot,
    NotAdmissible,
    NotReady,
    ProtocolError,
    ReplacementRequest,
    StalenessProtocol,
    TrajectoryNotInFlight,
    TrajectoryState,
    UnboundedConfig,
    UnboundedFifo,
    UnknownGroup,
    UnknownTrajectory,
    VersionNotPublished,
    protocol_from_dict,
)


def fifo(b: int = 2, n: int = 1, cap: int = 4, **kw: Any) -> UnboundedFifo:
    return UnboundedFifo(UnboundedConfig(batch_size=b, group_size=n, max_inflight_groups=cap, **kw))


def roundtrip(p: UnboundedFifo) -> UnboundedFifo:
    d = p.to_dict()
    q = UnboundedFifo.from_dict(json.loads(json.dumps(d)))
    assert q.to_dict() == d
    return q


def advance(p: UnboundedFifo) -> None:
    """Consume a batch and publish the version its step produces."""
    p.publish(p.consume().version + 1)


def run_group(p: UnboundedFifo, gid: str, version: int, n: int = 1) -> None:
    for i in range(n):
        p.reserve(gid, f"{gid}/{i}", version)
    for i in range(n):
        p.finish(f"{gid}/{i}")


# ----------------------------------------------------------------------------- admission


def test_admission_is_a_cap_on_groups_in_flight_not_on_versions() -> None:
    p = fifo(b=2, n=2, cap=2)
    assert p.config.eta is None and p.abort_floor == -1
    assert p.can_reserve("a", 0) is Admission.ADMIT
    p.reserve("a", "a/0", 0)
    p.reserve("b", "b/0", 0)
    assert p.inflight_groups == 2
    assert p.can_reserve("c", 0) is Admission.WAIT  # cap reached
    with pytest.raises(NoFreeSlot) as e:
        p.reserve("c", "c/0", 0)
    assert isinstance(e.value, NotAdmissible) and e.value.group_id == "c"
    assert e.value.admission is Admission.WAIT
    assert "c/0" not in p.in_flight() and p.inflight_groups == 2
    assert p.can_reserve("a", 0) is Admission.ADMIT  # siblings still join
    p.reserve("a", "a/1", 0)
    assert p.can_reserve("a", 0) is Admission.DISCARD  # n' = 2 live members
    with pytest.raises(GroupFull):
        p.reserve("a", "a/2", 0)
    p.finish("a/0")
    assert p.inflight_groups == 2  # incomplete groups still count
    p.finish("a/1")
    assert p.inflight_groups == 1 and p.queued_groups == 1
    assert p.can_reserve("c", 0) is Admission.ADMIT  # a complete group frees its place
    assert p.can_reserve("a", 0) is Admission.DISCARD  # complete: takes no member


def test_any_published_version_is_admitted_and_nothing_must_sync() -> None:
    p = fifo(b=1, cap=8)
    for k in range(5):
        run_group(p, f"g{k}", 0)
        advance(p)
    run_group(p, "g5", 0)
    p.consume()  # version 5 is being trained, not published
    assert (p.next_buffer, p.published_version) == (6, 5)
    for v in range(6):
        assert p.can_reserve(f"new{v}", v) is Admission.ADMIT
        assert not p.must_sync(v)
    with pytest.raises(VersionNotPublished, match="not published yet"):
        p.can_reserve("x", 6)  # no instance can hold weights that do not exist
    with pytest.raises(InvalidVersion):
        p.can_reserve("x", -1)


# ------------------------------------------------------------------------- FIFO consume


def test_consume_takes_the_first_b_complete_groups_whatever_their_version() -> None:
    p = fifo(b=2, cap=10)
    run_group(p, "old", 0)
    for k in range(2):  # advance the version with other data
        run_group(p, f"x{k}a", k)
        run_group(p, f"x{k}b", k)
        if k == 0:
            batch = p.consume()
            assert batch.group_ids == ("old", "x0a")
            p.publish(1)
    # FIFO order is completion order: x0b (v0) came before x1a, x1b (v1)
    assert p.fifo() == ("x0b", "x1a", "x1b")
    assert p.ready()
    b = p.consume()
    assert b.version == 1 and b.group_ids == ("x0b", "x1a")
    assert b.group_versions == (0, 1) and b.staleness == (1, 0)
    assert p.next_buffer == 2 and p.fifo() == ("x1b",)
    assert not p.ready()
    with pytest.raises(NotReady):
        p.consume()
    assert p.next_buffer == 2


def test_next_batch_groups_are_the_head_of_the_fifo_that_consume_takes() -> None:
    p = fifo(b=2, cap=10)
    assert p.next_batch_groups() == ()
    run_group(p, "a", 0)
    assert p.next_batch_groups() == ("a",)  # fewer than B: the trainer may start on it
    run_group(p, "b", 0)
    run_group(p, "c", 0)
    assert p.next_batch_groups() == ("a", "b")
    assert p.consume().group_ids == ("a", "b")
    assert p.next_batch_groups() == ("c",)
    p.drop_group("c", "filtered")  # the caller's drop is the one way out before consume
    assert p.next_batch_groups() == ()


def test_staleness_is_measured_and_can_exceed_any_eta() -> None:
    """A group generated at version 0 that completes late is consumed at a staleness the bounded
    protocol (η = 1) would never allow; the FIFO measures it."""
    p = fifo(b=1, cap=4)
    p.reserve("slow", "slow/0", 0)
    for k in range(5):
        run_group(p, f"fast{k}", k)
        advance(p)
    p.finish("slow/0")
    batch = p.consume()
    assert batch.group_ids == ("slow",)
    assert batch.staleness == (5,) and batch.trajectory_staleness == ((5,),)
    assert p.live_version("slow/0") is None  # consumed: retired from the ledger
    assert p.group("slow").state is GroupState.CONSUMED and p.group("slow").buffer == 5
    hist = p.stats().staleness_histogram
    assert hist == {0: 5, 5: 1}
    # the bounded protocol (η = 1) holds the trainer back instead: the slow group's reservation
    # keeps buffer 1 for it, so fast1 waits behind it and nothing exceeds η
    q = make(batch_size=1, group_size=1, eta=1)
    q.reserve("slow", "slow/0", 0)
    q.reserve("fast0", "fast0/0", 0)
    q.finish("fast0/0")
    q.consume()
    q.publish(1)
    q.reserve("fast1", "fast1/0", 1)
    q.finish("fast1/0")
    assert not q.ready()  # the FIFO would have trained on fast1 already
    q.finish("slow/0")
    assert q.consume().group_ids == ("slow",)
    assert q.consume().group_ids == ("fast1",)
    assert max(q.stats().staleness_histogram) == 1


def test_group_surplus_members_are_aborted_when_n_finish() -> None:
    p = fifo(b=1, n=2, cap=2, group_redundancy=1)
    for i in range(3):
        p.reserve("g", f"g/{i}", 0)
    assert p.finish("g/2").status is FinishStatus.WAITING
    assert p.finish("g/0").buffer == 0  # complete: trained at version 0
    aborts = p.take_notices()
    assert [(a.trajectory_id, a.reason) for a in aborts] == [("g/1", AbortReason.GROUP_SURPLUS)]  # type: ignore[union-attr]
    assert p.take_notices() == ()
    assert p.finish("g/1").status is FinishStatus.ALREADY_ENDED  # the engine raced the abort
    batch = p.consume()
    assert batch.trajectory_ids == (("g/2", "g/0"),)  # finish order


def test_drop_group_in_flight_or_queued_releases_it_and_asks_a_replacement() -> None:
    p = fifo(b=2, n=1, cap=2, filtering=True)
    p.reserve("a", "a/0", 0)
    run_group(p, "b", 0)
    assert p.inflight_groups == 1 and p.fifo() == ("b",)
    p.drop_group("a", "filtered: equal rewards")
    p.drop_group("b", "filtered: equal rewards")
    assert p.inflight_groups == 0 and p.fifo() == ()
    notices = p.take_notices()
    assert [type(n) for n in notices] == [Abort, ReplacementRequest] * 2
    assert {n.trajectory_id for n in notices if isinstance(n, Abort)} == {"a/0", "b/0"}
    assert [n.replaces_group_id for n in notices if isinstance(n, ReplacementRequest)] == ["a", "b"]
    assert p.group("a").state is GroupState.DROPPED
    assert p.trajectory("b/0").state is TrajectoryState.DROPPED
    with pytest.raises(GroupNotDroppable):
        p.drop_group("a", "again")
    with pytest.raises(GroupClosed):
        p.reserve("a", "a/9", 0)


def test_caller_abort_keeps_the_group_in_flight() -> None:
    p = fifo(b=1, n=1, cap=1)
    p.reserve("g", "g/0", 0)
    assert p.abort("g/0", "engine error") is True
    assert p.trajectory("g/0").state is TrajectoryState.ABORTED
    assert p.inflight_groups == 1 and p.can_reserve("h", 0) is Admission.WAIT
    p.reserve("g", "g/1", 0)  # a replacement sibling
    p.finish("g/1")
    assert p.consume().trajectory_ids == (("g/1",),)
    assert p.stats().aborts_by_reason == {"engine error": 1}


def test_can_resume_needs_v_traj_at_most_the_instance_version() -> None:
    p = fifo(b=1, cap=4)
    run_group(p, "a", 0)
    advance(p)
    p.reserve("b", "b/0", 1)
    assert p.can_resume("b/0", 1) and not p.can_resume("b/0", 0)
    assert p.live_version("b/0") == 1


def test_virtual_buffers_show_the_fifo_in_batches() -> None:
    p = fifo(b=2, cap=8)
    for k in range(3):
        run_group(p, f"g{k}", 0)
    s = p.stats()
    assert [(f.version, f.occupied, f.ready) for f in s.buffers] == [(0, 2, True), (1, 1, False)]
    assert p.buffer_fill(5).occupied == 0
    assert len(p.buffer_slots(1)) == 2
    assert p.resolve_stuck().resolved is False


# ---------------------------------------------------------------------------- checkpoint


def test_checkpoint_round_trip_mid_run_continues_identically() -> None:
    p = fifo(b=2, n=2, cap=3, group_redundancy=1, filtering=True)
    run_group(p, "a", 0, n=2)
    run_group(p, "b", 0, n=2)
    advance(p)
    p.reserve("c", "c/0", 1)
    p.reserve("c", "c/1", 0)
    p.finish("c/0")
    p.reserve("d", "d/0", 1)
    p.drop_group("d", "filtered")
    run_group(p, "e", 1, n=2)
    q = roundtrip(p)
    assert q.inflight_groups == p.inflight_groups == 1
    assert q.fifo() == p.fifo() == ("e",)
    assert q.stats().pending_notices == p.stats().pending_notices == 2  # d/0's abort, d's prompt
    for x in (p, q):
        x.finish("c/1")
        assert x.consume().staleness == (0, 1)
    assert p.to_dict() == q.to_dict()
    assert protocol_from_dict(json.loads(json.dumps(p.to_dict()))).to_dict() == p.to_dict()


def test_protocol_from_dict_dispatches_on_format() -> None:
    bounded = make(batch_size=2, group_size=1, eta=1)
    assert isinstance(protocol_from_dict(bounded.to_dict()), StalenessProtocol)
    assert isinstance(protocol_from_dict(fifo().to_dict()), UnboundedFifo)
    assert fifo().to_dict()["format"] == UNBOUNDED_FORMAT
    with pytest.raises(CorruptState, match="format"):
        protocol_from_dict({"format": "other/1"})
    with pytest.raises(CorruptState):
        UnboundedFifo.from_dict(bounded.to_dict())


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("fifo"),
        lambda d: d.__setitem__("fifo", ["nope"]),
        lambda d: d["trajectories"].append(d["trajectories"][0]),
        lambda d: d["trajectories"][0].__setitem__(2, 99),  # version not published
        lambda d: d["config"].__setitem__("max_inflight_groups", 0),
        lambda d: d["config"].__setitem__("eta", 3),
        lambda d: d["groups"][0][3].append("ghost"),
    ],
)
def test_corrupt_state_is_refused(mutate: Any) -> None:
    p = fifo(b=2, cap=4)
    run_group(p, "a", 0)
    p.reserve("b", "b/0", 0)
    d = json.loads(json.dumps(p.to_dict()))
    mutate(d)
    with pytest.raises((CorruptState, ConfigError)):
        UnboundedFifo.from_dict(d)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"batch_size": 0, "group_size": 1, "max_inflight_groups": 1}, "batch_size"),
        ({"batch_size": 1, "group_size": 0, "max_inflight_groups": 1}, "group_size"),
        ({"batch_size": 1, "group_size": 1, "max_inflight_groups": 0}, "max_inflight_groups"),
        ({"batch_size": 1, "group_size": 1, "max_inflight_groups": 2.5}, "max_inflight_groups"),
        ({"batch_size": 1, "group_size": 1, "max_inflight_groups": True}, "max_inflight_groups"),
        (
            {"batch_size": 1, "group_size": 1, "max_inflight_groups": 1, "group_redundancy": -1},
            "group_redundancy",
        ),
        (
            {"batch_size": 1, "group_size": 1, "max_inflight_groups": 1, "filtering": "yes"},
            "filtering",
        ),
    ],
)
def test_bad_config_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        UnboundedConfig(**kwargs)
    assert e.value.field == field and field in str(e.value)


def test_unknown_config_key_is_refused() -> None:
    with pytest.raises(ConfigError, match="eta"):
        UnboundedConfig.from_dict(
            {"batch_size": 1, "group_size": 1, "max_inflight_groups": 1, "eta": 2}
        )


def test_bad_calls_raise_specific_errors_and_change_nothing() -> None:
    p = fifo(b=2, n=1, cap=2)
    run_group(p, "a", 0)
    p.reserve("b", "b/0", 0)
    before = p.to_dict()
    bad: list[tuple[Any, type[ProtocolError]]] = [
        (lambda: p.reserve("c", "c/0", 1), InvalidVersion),
        (lambda: p.reserve("c", "c/0", -1), InvalidVersion),
        (lambda: p.reserve("c", "c/0", True), InvalidVersion),
        (lambda: p.reserve(1.5, "c/0", 0), InvalidId),
        (lambda: p.reserve("c", None, 0), InvalidId),
        (lambda: p.reserve("c", "a/0", 0), DuplicateTrajectory),
        (lambda: p.reserve("a", "a/9", 0), GroupClosed),
        (lambda: p.finish("a/0"), TrajectoryNotInFlight),
        (lambda: p.finish("zzz"), UnknownTrajectory),
        (lambda: p.abort("b/0", ""), InvalidId),
        (lambda: p.abort("a/0", "late"), TrajectoryNotInFlight),
        (lambda: p.drop_group("nope", "x"), UnknownGroup),
        (lambda: p.drop_group("b", 7), InvalidId),
        (lambda: p.consume(), NotReady),
        (lambda: p.can_resume("b/0", 3), InvalidVersion),
        (lambda: p.must_sync(-2), InvalidVersion),
        (lambda: p.buffer_fill(-1), InvalidVersion),
    ]
    for call, err in bad:
        with pytest.raises(err):
            call()
        assert p.to_dict() == before
    with pytest.raises(TypeError):
        UnboundedFifo({"batch_size": 1})  # type: ignore[arg-type]


# ------------------------------------------------------------------------ property test


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 9)), min_size=1, max_size=80))
def test_random_schedules_lose_nothing_and_respect_the_cap(ops: list[tuple[int, int]]) -> None:
    """Random reserve/finish/drop/consume: the cap holds, every trajectory is accounted for,
    FIFO order is completion order, and a checkpoint restores the same state."""
    p = fifo(b=2, n=2, cap=3, group_redundancy=1, filtering=True)
    serial = 0
    completed: list[str] = []
    consumed: list[str] = []
    for op, arg in ops:
        if op == 0:  # admit a new group or a sibling, at any version
            v = arg % (p.published_version + 1)
            gid = f"g{serial}"
            if p.can_reserve(gid, v) is Admission.ADMIT:
                p.reserve(gid, f"{gid}/0", v)
                p.reserve(gid, f"{gid}/1", v)
                serial += 1
        elif op == 1 and p.in_flight():  # finish an in-flight member
            tid = p.in_flight()[arg % len(p.in_flight())]
            out = p.finish(tid)
            if out.status is FinishStatus.OCCUPIED:
                completed.append(str(out.group_id))
        elif op == 2 and p.in_flight():  # drop an in-flight group
            gid = p.trajectory(p.in_flight()[arg % len(p.in_flight())]).group_id
            p.drop_group(gid, "filtered")
        elif op == 3 and p.ready():
            batch = p.consume()
            consumed.extend(str(g) for g in batch.group_ids)
            p.publish(batch.version + 1)
        elif op == 4:
            p = roundtrip(p)
        assert p.inflight_groups <= 3
        s = p.stats()
        states = s.trajectories_by_state
        assert sum(states.values()) == 2 * serial  # nothing vanishes
        assert s.groups_by_state["reserved"] == p.inflight_groups
    assert consumed == completed[: len(consumed)]  # FIFO: consumed in completion order
    assert list(p.fifo()) == [g for g in completed[len(consumed) :]]
    p.take_notices()
