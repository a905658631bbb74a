"""Optional mechanisms: redundancy, filtering, staleness aborts, stuck buffers."""

from __future__ import annotations

import pytest
from sp_helpers import make, roundtrip, states, step

from staleness_protocol import (
    Abort,
    AbortReason,
    Admission,
    FinishStatus,
    GroupAborted,
    GroupMove,
    MechanismDisabled,
    ReplacementRequest,
)
from staleness_protocol.testing import check_invariants, layout


def test_defaults_switch_every_mechanism_off() -> None:
    p = make(batch_size=2, group_size=2, eta=1)
    cfg = p.config
    assert (cfg.batch_redundancy, cfg.group_redundancy, cfg.filtering, cfg.stuck_threshold) == (
        0,
        0,
        False,
        None,
    )
    assert cfg.slots_per_buffer == 2 and cfg.samples_per_group == 2
    with pytest.raises(MechanismDisabled) as e:
        p.resolve_stuck()
    assert e.value.field == "stuck_threshold"
    p.reserve("g", "t0", 0)
    assert p.drop_group("g", "bad prompt") is True
    # filtering off: the dropped member's notice, no replacement asked for
    assert p.take_notices() == (
        Abort(trajectory_id="t0", group_id="g", version=0, reason="bad prompt", was_running=True),
    )


def test_group_redundancy_aborts_the_rest_once_n_finish() -> None:
    p = make(batch_size=1, group_size=2, eta=0, group_redundancy=2)
    for m in range(4):
        assert p.reserve("g", f"t{m}", 0) == 0
    p.finish("t2")
    assert p.take_notices() == ()
    assert p.finish("t0").buffer == 0
    assert p.take_notices() == (
        Abort(
            trajectory_id="t1", group_id="g", version=0, reason="group_surplus", was_running=True
        ),
        Abort(
            trajectory_id="t3", group_id="g", version=0, reason="group_surplus", was_running=True
        ),
    )
    assert states(p) == {"t0": "occupied", "t2": "occupied"}
    assert p.trajectory("t1").state == "aborted" and p.trajectory("t3").reason == "group_surplus"
    # the engine finishes a surplus sample just as it is aborted: not an error
    late = p.finish("t1")
    assert (late.status, late.reason) == (FinishStatus.ALREADY_ENDED, "group_surplus")
    assert p.abort("t3", "instance lost") is False  # already ended: nothing changes
    assert p.consume().trajectory_ids == (("t2", "t0"),)
    assert p.stats().aborts_by_reason == {"group_surplus": 2}
    check_invariants(p)


def test_group_full_at_n_prime() -> None:
    from staleness_protocol import GroupFull

    p = make(batch_size=1, group_size=1, eta=0, group_redundancy=1)
    p.reserve("g", "a", 0)
    p.reserve("g", "b", 0)
    assert p.can_reserve("g", 0) is Admission.DISCARD
    with pytest.raises(GroupFull) as e:
        p.reserve("g", "c", 0)
    assert e.value.admission is Admission.DISCARD
    # an aborted member frees a place for a retry
    p.abort("a", "instance lost")
    assert p.reserve("g", "c", 0) == 0


def test_batch_redundancy_aborts_surplus_when_buffer_fills() -> None:
    p = make(batch_size=2, group_size=1, eta=1, batch_redundancy=1)
    for g in range(6):
        p.reserve(f"g{g}", f"t{g}", 0)
    # 3 slots per buffer: g0-g2 in buffer 1, g3-g5 in buffer 0
    assert layout(p) == {0: ([], ["g3", "g4", "g5"]), 1: ([], ["g0", "g1", "g2"])}
    assert p.can_reserve("g6", 0) is Admission.WAIT
    p.finish("t3")
    p.finish("t5")  # buffer 0 READY with g4 still reserved: surplus
    assert layout(p) == {0: (["g3", "g5"], []), 1: ([], ["g0", "g1", "g2"])}
    assert p.take_notices() == (
        Abort(
            trajectory_id="t4", group_id="g4", version=0, reason="batch_surplus", was_running=True
        ),
        GroupAborted(group_id="g4", reason="batch_surplus"),
    )
    assert p.group("g4").state == "aborted"
    assert p.can_reserve("g4", 0) is Admission.DISCARD  # its unadmitted siblings: discard
    assert p.drop_group("g4", "filtered") is False  # the protocol closed it first
    # a READY buffer takes no reservation even though it has a spare slot
    assert p.buffer_fill(0).free == 1
    assert p.can_reserve("g6", 0) is Admission.WAIT
    check_invariants(p)


def test_staleness_abort_when_all_reachable_buffers_are_ready() -> None:
    p = make(batch_size=1, group_size=1, eta=1, batch_redundancy=1)
    p.reserve("a", "a0", 0)  # -> 1
    p.reserve("b", "b0", 0)  # -> 1
    p.reserve("c", "c0", 0)  # -> 0
    p.reserve("d", "d0", 0)  # -> 0
    assert p.abort_floor == -2
    p.finish("c0")  # buffer 0 READY; d is surplus
    assert p.abort_floor == -1
    assert [n.reason for n in p.take_notices()] == ["batch_surplus", "batch_surplus"]
    p.finish("a0")  # buffer 1 READY: every buffer version 0 can reach is READY
    assert p.abort_floor == 0
    assert p.must_sync(0)
    assert [(type(n).__name__, n.reason) for n in p.take_notices()] == [
        ("Abort", "stale"),
        ("GroupAborted", "stale"),
    ]
    assert p.can_reserve("e", 0) is Admission.SYNC
    assert p.stats().aborts_by_reason == {"batch_surplus": 1, "stale": 1}
    step(p)
    assert p.abort_floor == 0 and p.must_sync(0) and not p.must_sync(1)
    assert p.can_reserve("e", 1) is Admission.ADMIT
    check_invariants(p)


def test_filtering_releases_reservation_and_requests_replacement() -> None:
    p = make(batch_size=1, group_size=2, eta=0, filtering=True)
    p.reserve("g", "t0", 0)
    p.reserve("g", "t1", 0)
    assert p.can_reserve("h", 0) is Admission.WAIT
    p.finish("t0")
    # DAPO: the caller saw all rewards equal before finishing the last member
    assert p.drop_group("g", "all rewards equal") is True
    assert p.take_notices() == (
        Abort(
            trajectory_id="t0",
            group_id="g",
            version=0,
            reason="all rewards equal",
            was_running=False,
        ),
        Abort(
            trajectory_id="t1",
            group_id="g",
            version=0,
            reason="all rewards equal",
            was_running=True,
        ),
        ReplacementRequest(request_id=0, replaces_group_id="g", reason="all rewards equal"),
    )
    assert states(p) == {}
    assert [p.trajectory(t).state for t in ("t0", "t1")] == ["dropped", "dropped"]
    assert layout(p) == {0: ([], [])}
    assert p.can_reserve("h", 0) is Admission.ADMIT
    assert p.finish("t1").status is FinishStatus.ALREADY_ENDED  # the engine was still on it
    check_invariants(p)


def test_drop_of_an_occupied_group_frees_its_slot() -> None:
    p = make(batch_size=1, group_size=1, eta=0, filtering=True)
    p.reserve("g", "t0", 0)
    p.finish("t0")
    assert p.ready()
    assert p.drop_group("g", "filtered") is True
    assert not p.ready()
    assert p.stats().pending_notices == 2
    abort, replacement = p.take_notices()
    assert isinstance(abort, Abort) and abort.was_running is False
    assert isinstance(replacement, ReplacementRequest)
    check_invariants(p)


def test_stuck_buffer_aborts_stragglers_and_moves_finished_groups_forward() -> None:
    p = make(batch_size=3, group_size=1, eta=1, stuck_threshold=1)
    for g in range(6):
        p.reserve(f"g{g}", f"t{g}", 0)
    assert layout(p) == {0: ([], ["g3", "g4", "g5"]), 1: ([], ["g0", "g1", "g2"])}
    p.finish("t3")
    p.finish("t4")
    p.finish("t0")
    assert layout(p) == {0: (["g3", "g4"], ["g5"]), 1: (["g0"], ["g1", "g2"])}
    res = p.resolve_stuck()
    assert res.resolved
    assert res.moved == (GroupMove(group_id="g0", from_buffer=1, to_buffer=0),)
    assert p.take_notices() == (
        Abort(trajectory_id="t5", group_id="g5", version=0, reason="stuck", was_running=True),
        GroupAborted(group_id="g5", reason="stuck"),
        ReplacementRequest(request_id=0, replaces_group_id="g5", reason="stuck"),
    )
    assert layout(p) == {0: (["g3", "g4", "g0"], []), 1: ([], ["g1", "g2"])}
    assert p.trajectory("t0").buffer == 0
    batch = p.consume()
    assert batch.staleness == (0, 0, 0)
    check_invariants(p)


def test_resolve_stuck_does_nothing_when_not_stuck() -> None:
    p = make(batch_size=3, group_size=1, eta=1, stuck_threshold=1)
    for g in range(6):
        p.reserve(f"g{g}", f"t{g}", 0)
    p.finish("t3")  # buffer 0 lacks 2 > threshold
    before = p.to_dict()
    assert not p.resolve_stuck().resolved
    assert p.to_dict() == before
    p.finish("t4")  # lacks 1, but no later finished group
    before = p.to_dict()
    assert not p.resolve_stuck().resolved
    assert p.to_dict() == before


def test_group_sampling_across_instances_and_versions() -> None:
    p = make(batch_size=1, group_size=3, eta=2)
    p.reserve("w", "w0", 0)
    p.reserve("w", "w1", 0)
    p.reserve("w", "w2", 0)
    for t in ("w0", "w1", "w2"):
        p.finish(t)
    step(p)  # v1
    assert p.reserve("g", "g0", 0) == 2  # old instance at 0: latest legal is 0 + 2
    assert p.reserve("g", "g1", 1) == 2  # newer instances join
    assert p.reserve("g", "g2", 1) == 2
    for t in ("g1", "g2", "g0"):
        p.finish(t)
    assert layout(p)[1] == (["g"], [])
    b = p.consume()
    assert b.trajectory_staleness == ((0, 0, 1),)
    assert b.group_versions == (0,) and b.staleness == (1,)
    roundtrip(p)


def test_reason_enum_values_are_stable() -> None:
    assert {r.value for r in AbortReason} == {
        "group_surplus",
        "batch_surplus",
        "stale",
        "stuck",
        "dropped",
    }
