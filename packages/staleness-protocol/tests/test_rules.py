"""Per-rule examples of the protocol rules (docs/design.md); each asserts the whole state (layout + ledger)."""

from __future__ import annotations

import pytest
from sp_helpers import make, roundtrip, states, step

from staleness_protocol import (
    Admission,
    Batch,
    FinishStatus,
    GroupAborted,
    SlotState,
    UnknownTrajectory,
)
from staleness_protocol.testing import check_invariants, layout


def test_reserve_goes_to_latest_buffer_and_creates_buffers_in_order() -> None:
    p = make(batch_size=2, group_size=1, eta=2)
    assert p.reserve("g0", "t0", 0) == 2
    # buffers 0..2 were created, in order, although only 2 is used
    assert layout(p) == {0: ([], []), 1: ([], []), 2: ([], ["g0"])}
    assert p.reserve("g1", "t1", 0) == 2
    assert p.reserve("g2", "t2", 0) == 1  # back-fill: 2 is full, next latest
    assert layout(p) == {0: ([], []), 1: ([], ["g2"]), 2: ([], ["g0", "g1"])}
    assert states(p) == {"t0": "in_flight", "t1": "in_flight", "t2": "in_flight"}
    assert p.buffer_slots(2) == (SlotState.RESERVED, SlotState.RESERVED)
    check_invariants(p)


def test_inadmissible_when_no_buffer_has_room() -> None:
    p = make(batch_size=1, group_size=1, eta=1)
    p.reserve("g0", "t0", 0)
    p.reserve("g1", "t1", 0)
    before = p.to_dict()
    assert p.can_reserve("g2", 0) is Admission.WAIT
    assert p.to_dict() == before


def test_can_reserve_has_no_side_effects_and_matches_reserve() -> None:
    p = make(batch_size=2, group_size=2, eta=1)
    before = p.to_dict()
    assert p.can_reserve("g0", 0) is Admission.ADMIT
    assert p.to_dict() == before  # no buffer created, nothing recorded
    assert p.reserve("g0", "t0", 0) == 1


def test_occupy_goes_to_earliest_buffer_front_filled() -> None:
    p = make(batch_size=2, group_size=2, eta=1)
    assert p.reserve("g0", "a0", 0) == 1
    assert p.reserve("g0", "a1", 0) == 1
    assert p.finish("a0").status is FinishStatus.WAITING  # group incomplete
    assert states(p)["a0"] == "finished"
    out = p.finish("a1")
    assert (out.status, out.buffer, out.group_id) == (FinishStatus.OCCUPIED, 0, "g0")
    # earlier than its reservation: staleness 0
    assert layout(p) == {0: (["g0"], []), 1: ([], [])}
    assert p.buffer_slots(0) == (SlotState.OCCUPIED, SlotState.EMPTY)
    assert p.trajectory("a1").buffer == 0
    assert states(p) == {"a0": "occupied", "a1": "occupied"}
    check_invariants(p)


def test_finished_group_never_lands_later_than_its_reservation() -> None:
    # buffer 0 is full of reservations, so g0 falls back to its own reserved buffer 1
    p = make(batch_size=2, group_size=1, eta=1)
    p.reserve("g0", "t0", 0)  # -> 1
    p.reserve("g1", "t1", 0)  # -> 1
    p.reserve("g2", "t2", 0)  # -> 0
    p.reserve("g3", "t3", 0)  # -> 0
    assert layout(p) == {0: ([], ["g2", "g3"]), 1: ([], ["g0", "g1"])}
    assert p.finish("t0").buffer == 1
    assert layout(p) == {0: ([], ["g2", "g3"]), 1: (["g0"], ["g1"])}
    # g2 finishes: its own reservation frees a slot in 0
    assert p.finish("t2").buffer == 0
    assert layout(p) == {0: (["g2"], ["g3"]), 1: (["g0"], ["g1"])}
    check_invariants(p)


def test_consume_returns_batch_and_advances_version() -> None:
    p = make(batch_size=2, group_size=2, eta=1)
    for g in ("g0", "g1"):
        p.reserve(g, f"{g}a", 0)
        p.reserve(g, f"{g}b", 0)
    for t in ("g0a", "g0b", "g1a"):
        p.finish(t)
    assert not p.ready()
    p.finish("g1b")
    assert p.ready()
    assert layout(p) == {0: (["g0", "g1"], []), 1: ([], [])}
    batch = p.consume()
    assert batch == Batch(
        version=0,
        group_ids=("g0", "g1"),
        trajectory_ids=(("g0a", "g0b"), ("g1a", "g1b")),
        group_versions=(0, 0),
        staleness=(0, 0),
        trajectory_staleness=((0, 0), (0, 0)),
    )
    assert (p.next_buffer, p.published_version) == (1, 0)  # version 1 is being trained
    assert layout(p) == {1: ([], [])}  # buffer 0 retired
    assert states(p) == {}  # consumed trajectories are retired: counted, not kept
    assert p.group("g0").state == "consumed" and p.group("g0").buffer == 0  # a tombstone
    s = p.stats()
    assert s.staleness_histogram == {0: 4}
    assert s.group_staleness_histogram == {0: 2}
    assert s.consumed_batches == 1
    assert s.trajectories_by_state["consumed"] == 4 and s.groups_by_state["consumed"] == 2
    check_invariants(p)


def test_staleness_counts_queue_time() -> None:
    p = make(batch_size=1, group_size=1, eta=2)
    p.reserve("g0", "t0", 0)  # -> 2
    p.reserve("g1", "t1", 0)  # -> 1
    p.reserve("g2", "t2", 0)  # -> 0
    p.finish("t2")
    p.consume()  # version 1
    p.finish("t1")
    p.consume()  # version 2
    p.finish("t0")
    b = p.consume()
    assert (b.version, b.staleness, b.group_versions) == (2, (2,), (0,))
    assert p.stats().staleness_histogram == {0: 1, 1: 1, 2: 1}
    assert b.staleness_of("g0") == 2


def test_sibling_join_rule_across_versions() -> None:
    p = make(batch_size=2, group_size=2, eta=1)
    p.reserve("x", "x0", 0)
    p.reserve("x", "x1", 0)
    p.finish("x0")
    p.finish("x1")
    p.reserve("y", "y0", 0)
    p.reserve("y", "y1", 0)
    p.finish("y0")
    p.finish("y1")
    step(p)  # version 1 trained and published
    # g: first member at version 1 -> buffer 2 (latest of [1, 2])
    assert p.reserve("g", "g0", 1) == 2
    # a sibling on an old instance at version 0 cannot join (0 + 1 < 2)
    assert p.can_reserve("g", 0) is Admission.SYNC
    # ... but one at version 1 can
    assert p.reserve("g", "g1", 1) == 2
    assert p.group("g").members == ("g0", "g1")
    check_invariants(p)


def test_group_occupies_within_bound_of_oldest_member() -> None:
    p = make(batch_size=1, group_size=2, eta=1)
    p.reserve("a", "a0", 0)
    p.reserve("a", "a1", 0)
    p.finish("a0")
    p.finish("a1")
    step(p)  # v1
    p.reserve("g", "g0", 1)  # -> buffer 2
    p.reserve("g", "g1", 1)
    p.reserve("h", "h0", 0)  # V=0: only buffer 1 is legal
    assert layout(p) == {1: ([], ["h"]), 2: ([], ["g"])}
    p.finish("g0")
    p.finish("g1")
    assert layout(p)[2] == (["g"], [])  # buffer 1 is fully reserved by h
    assert p.trajectory("h0").buffer == 1


def test_partial_rollout_keeps_v_traj_and_reservation() -> None:
    p = make(batch_size=1, group_size=1, eta=2)
    p.reserve("g", "t", 0)
    rec = p.trajectory("t")
    # interrupted and migrated: no protocol call; it can resume on any instance >= V_traj
    assert p.can_resume("t", 0)
    p.reserve("o", "o0", 0)
    p.reserve("o2", "o1", 0)
    p.finish("o1")
    p.consume()
    assert p.can_resume("t", 0)  # version 1 is not published yet: no instance is there
    p.publish(1)
    assert p.can_resume("t", 1)
    assert p.trajectory("t") == rec  # V_traj and reservation unchanged
    p.finish("t")
    assert p.trajectory("t").version == 0


def test_ledger_query_for_every_trajectory_state() -> None:
    p = make(batch_size=2, group_size=1, eta=1)
    p.reserve("g0", "t0", 0)
    p.reserve("g1", "t1", 0)
    p.reserve("g2", "t2", 0)
    p.abort("t1", "engine died")
    p.drop_group("g2", "all rewards equal")
    assert p.trajectory("t0").state == "in_flight"
    assert (p.trajectory("t1").state, p.trajectory("t1").reason) == ("aborted", "engine died")
    assert (p.trajectory("t2").state, p.trajectory("t2").reason) == ("dropped", "all rewards equal")
    assert p.group("g2").state == "dropped"
    q = roundtrip(p)
    assert q.trajectory("t1") == p.trajectory("t1")


def test_settled_entries_are_retired_and_tombstones_expire() -> None:
    """Consumed trajectories leave the ledger at once; ended ones stay tombstones for
    tombstone_versions consumes, then are forgotten: the state is the size of what is live."""
    p = make(batch_size=1, group_size=1, eta=0, batch_redundancy=1, tombstone_versions=2)
    p.reserve("x", "x0", 0)
    assert p.abort("x0", "engine died") is True  # x keeps its reservation, with no member
    p.reserve("g0", "t0", 0)
    p.finish("t0")  # buffer 0 READY: x's empty reservation is aborted (batch surplus)
    assert p.take_notices() == (GroupAborted(group_id="x", reason="batch_surplus"),)
    step(p)
    for k in (1, 2):
        assert p.trajectory("x0").state == "aborted"  # stamp 0: kept while next_buffer <= 2
        assert p.group("x").state == "aborted"
        p.reserve(f"g{k}", f"t{k}", k)
        p.finish(f"t{k}")
        step(p)
        assert p.to_dict()["trajectories"] == []
    with pytest.raises(UnknownTrajectory, match="tombstone_versions=2"):
        p.trajectory("x0")  # next_buffer 3 > 0 + 2: forgotten
    assert [row[1] for row in p.to_dict()["tombstones"]] == ["g0", "g1", "g2"]
    assert p.stats().trajectories_by_state == {
        "in_flight": 0, "finished": 0, "occupied": 0, "consumed": 3, "dropped": 0, "aborted": 1,
    }  # fmt: skip
    assert p.stats().groups_by_state["aborted"] == 1
    check_invariants(p)


def test_checkpoint_restore_continues_identically() -> None:
    p = make(batch_size=2, group_size=2, eta=2, batch_redundancy=1, group_redundancy=1)
    for g in range(3):
        for m in range(3):
            p.reserve(f"g{g}", f"g{g}m{m}", 0)
    p.finish("g0m0")
    q = roundtrip(p)
    for proto in (p, q):
        proto.finish("g0m1")
        proto.finish("g1m2")
        proto.finish("g1m0")
    assert p.to_dict() == q.to_dict()
    assert p.take_notices() == q.take_notices()
