"""Per-operation examples for the store; each asserts the whole resulting state."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine_adapters import InvalidRequest
from trajectory_server import (
    Completion,
    EventKind,
    FinishReason,
    LocationState,
    QueueEntry,
    SamplingParams,
    Segment,
    Trajectory,
    TrajectoryStore,
)
from trajectory_server.errors import (
    DuplicateTrajectory,
    InvalidRecord,
    NotQueued,
    SegmentMismatch,
    StaleVersion,
    UnknownGroup,
    UnknownTrajectory,
    WrongOwner,
    WrongState,
)


def state(store: TrajectoryStore) -> dict[str, Any]:
    """Everything observable, compactly: where each id is, queue order, per-instance holdings."""
    store.check_invariants()
    return {
        "where": {
            tid: (loc.state.value, loc.instance_id or loc.reason)
            for tid, loc in sorted(store.ledger().items())
        },
        "queue": [(e.trajectory_id, e.v_traj, e.generated_len) for e in store.queue_view()],
        "levels": store.level_counts(),
        "held": {i: store.held_by(i) for i in store.instances()},
    }


def seg(tid: str, start: int, tokens: list[int], version: int = 0, lp: float = -0.5) -> Segment:
    n = len(tokens)
    return Segment(
        trajectory_id=tid,
        start=start,
        token_ids=tokens,
        logprobs=[lp] * n,
        versions=[version] * n,
    )


def done(
    tid: str, start: int, tokens: list[int], version: int = 0, reason: str = "stop"
) -> Completion:
    n = len(tokens)
    return Completion(
        trajectory_id=tid,
        start=start,
        token_ids=tokens,
        logprobs=[-0.25] * n,
        versions=[version] * n,
        finish_reason=reason,
    )


@pytest.fixture
def store() -> TrajectoryStore:
    s = TrajectoryStore()
    s.submit_group("a", [1, 2, 3], 2, sampling=SamplingParams(max_new_tokens=8, seed=10))
    s.submit_group("b", [4, 5], 1, sampling=SamplingParams(max_new_tokens=8))
    return s


def test_submit_group_expands_members_in_fifo_order(store: TrajectoryStore) -> None:
    assert state(store) == {
        "where": {
            "a/0": ("queued", None),
            "a/1": ("queued", None),
            "b/0": ("queued", None),
        },
        "queue": [("a/0", None, 0), ("a/1", None, 0), ("b/0", None, 0)],
        "levels": {None: 3},
        "held": {},
    }
    assert store.get("a/0").sampling.seed == 10
    assert store.get("a/1").sampling.seed == 11  # members of a seeded group must differ
    assert store.group("a") == ("a/0", "a/1")
    assert [e.kind for e in store.history("a/1")] == [EventKind.SUBMITTED]


def test_submit_rejects_duplicates_and_non_fresh_without_change(store: TrajectoryStore) -> None:
    before = store.to_dict()
    with pytest.raises(DuplicateTrajectory) as err:
        store.submit_group("a", [1], 1)
    assert err.value.trajectory_id == "a/0"
    fresh = Trajectory(trajectory_id="c/0", group_id="c", prompt_token_ids=[1])
    with pytest.raises(DuplicateTrajectory):
        store.submit([fresh, fresh])
    with pytest.raises(InvalidRecord) as err2:
        store.submit(
            [Trajectory(trajectory_id="d/0", group_id="d", prompt_token_ids=[1], v_traj=2)]
        )
    assert err2.value.field == "v_traj"
    with pytest.raises(InvalidRecord) as err3:
        store.submit_group("e", [1], 0)
    assert err3.value.field == "n"
    assert store.to_dict() == before


def test_route_binds_v_traj_and_moves_ownership(store: TrajectoryStore) -> None:
    out = store.route("i0", ["a/1", "b/0"], 3)
    assert [t.trajectory_id for t in out] == ["a/1", "b/0"]
    assert [t.v_traj for t in out] == [3, 3]
    assert state(store) == {
        "where": {
            "a/0": ("queued", None),
            "a/1": ("running", "i0"),
            "b/0": ("running", "i0"),
        },
        "queue": [("a/0", None, 0)],
        "levels": {None: 1},
        "held": {"i0": ("a/1", "b/0")},
    }
    assert store.history("a/1")[-1].kind is EventKind.ROUTED
    assert store.history("a/1")[-1].version == 3


def test_route_is_all_or_nothing(store: TrajectoryStore) -> None:
    store.route("i0", ["a/0"], 1)
    before = store.to_dict()
    with pytest.raises(NotQueued) as err:
        store.route("i1", ["a/1", "a/0"], 1)
    assert (err.value.trajectory_id, err.value.state, err.value.owner) == ("a/0", "running", "i0")
    with pytest.raises(UnknownTrajectory):
        store.route("i1", ["a/1", "zzz"], 1)
    with pytest.raises(InvalidRecord) as dup:
        store.route("i1", ["a/1", "a/1"], 1)
    assert dup.value.field == "trajectory_ids"
    with pytest.raises(InvalidRecord) as ver:
        store.route("i1", ["a/1"], -1)
    assert ver.value.field == "version"
    assert store.to_dict() == before


def test_return_partial_appends_and_requeues_at_v_traj(store: TrajectoryStore) -> None:
    store.route("i0", ["a/0", "a/1"], 2)
    back = store.return_partial("i0", [seg("a/1", 0, [7, 8, 9], version=2)])
    assert back == (
        QueueEntry(
            trajectory_id="a/1",
            group_id="a",
            v_traj=2,
            prompt_len=3,
            generated_len=3,
            interruptions=1,
        ),
    )
    assert store.get("a/1").generated_token_ids.tolist() == [7, 8, 9]
    assert state(store) == {
        "where": {
            "a/0": ("running", "i0"),
            "a/1": ("queued", None),
            "b/0": ("queued", None),
        },
        "queue": [("a/1", 2, 3), ("b/0", None, 0)],
        "levels": {2: 1, None: 1},
        "held": {"i0": ("a/0",)},
    }
    # resume on a newer instance; the engine reports the whole response so far (start=0)
    store.route("i1", ["a/1"], 4)
    assert store.get("a/1").v_traj == 2  # V_traj never changes after the first route
    whole = Segment(
        trajectory_id="a/1",
        start=0,
        token_ids=[7, 8, 9, 10],
        logprobs=[-0.5, -0.5, -0.5, -0.75],
        versions=[2, 2, 2, 4],
    )
    store.return_partial("i1", [whole])
    t = store.get("a/1")
    assert t.generated_token_ids.tolist() == [7, 8, 9, 10]
    assert t.generated_versions.tolist() == [2, 2, 2, 4]
    assert t.generated_logprobs.tolist() == [-0.5, -0.5, -0.5, -0.75]
    assert t.interruptions == 2


def test_queue_order_older_levels_first_longer_partials_first(store: TrajectoryStore) -> None:
    store.submit_group("c", [1], 2, sampling=SamplingParams(max_new_tokens=8))
    store.route("i0", ["a/0", "a/1"], 5)
    store.route("i1", ["b/0", "c/0"], 3)
    store.return_partial("i0", [seg("a/0", 0, [1], 5), seg("a/1", 0, [1, 2, 3], 5)])
    store.return_partial("i1", [seg("b/0", 0, [1, 2], 3), seg("c/0", 0, [], 3)])
    assert state(store)["queue"] == [
        ("b/0", 3, 2),
        ("c/0", 3, 0),
        ("a/1", 5, 3),
        ("a/0", 5, 1),
        ("c/1", None, 0),
    ]
    assert store.level_counts() == {3: 2, 5: 2, None: 1}
    assert [e.trajectory_id for e in store.queue_view(2)] == ["b/0", "c/0"]
    assert [e.trajectory_id for e in store.queue_view(level=5)] == ["a/1", "a/0"]
    assert [e.trajectory_id for e in store.queue_view(level=None)] == ["c/1"]


def test_never_routed_members_of_a_routed_group_come_before_fresh_groups() -> None:
    store = TrajectoryStore()
    for gid in ("a", "b", "c"):
        store.submit_group(gid, [1], 3, sampling=SamplingParams(max_new_tokens=8))
    store.route("i0", ["c/1"], 0)  # c admitted in part, behind two fresh groups
    queued = [e.trajectory_id for e in store.queue_view()]
    assert queued == ["c/0", "c/2", "a/0", "a/1", "a/2", "b/0", "b/1", "b/2"]
    store.route("i0", ["b/2"], 0)  # promoted members keep the order they were queued in
    assert [e.trajectory_id for e in store.queue_view(level=None)][:4] == [
        "b/0",
        "b/1",
        "c/0",
        "c/2",
    ]
    assert store.level_counts() == {None: 7}  # one level for every never-routed prompt
    # a member that ran goes back at its version; one added to the group later is promoted
    store.return_partial("i0", [seg("c/1", 0, [5], 0)])
    store.submit(
        [
            Trajectory(
                trajectory_id="c/3",
                group_id="c",
                prompt_token_ids=[1],
                sampling=SamplingParams(max_new_tokens=8),
            )
        ]
    )
    order = [e.trajectory_id for e in store.queue_view()]
    assert order == ["c/1", "b/0", "b/1", "c/0", "c/2", "c/3", "a/0", "a/1", "a/2"]
    # the order survives a checkpoint (rebuilt from the routes in the trajectories' history)
    again = TrajectoryStore.from_dict(json.loads(json.dumps(store.to_dict())))
    assert again.queue_view() == store.queue_view()
    again.route("i1", ["a/0"], 1)
    assert [e.trajectory_id for e in again.queue_view(level=None)] == [
        "a/1",
        "a/2",
        "b/0",
        "b/1",
        "c/0",
        "c/2",
        "c/3",
    ]


def test_stale_route_and_stale_output_rejected(store: TrajectoryStore) -> None:
    store.route("i0", ["a/0"], 4)
    store.return_partial("i0", [seg("a/0", 0, [1], 4)])
    before = store.to_dict()
    with pytest.raises(StaleVersion) as err:
        store.route("old", ["a/0"], 3)
    assert (err.value.v_traj, err.value.version) == (4, 3)
    assert store.to_dict() == before
    store.route("i0", ["a/0"], 4)
    before = store.to_dict()
    with pytest.raises(StaleVersion):
        store.return_partial("i0", [seg("a/0", 1, [2], version=3)])
    assert store.to_dict() == before


def test_out_of_order_and_conflicting_segments_rejected(store: TrajectoryStore) -> None:
    store.route("i0", ["a/0"], 0)
    store.return_partial("i0", [seg("a/0", 0, [1, 2])])
    store.route("i0", ["a/0"], 0)
    before = store.to_dict()
    with pytest.raises(SegmentMismatch) as gap:
        store.return_partial("i0", [seg("a/0", 3, [4])])
    assert (gap.value.start, gap.value.held) == (3, 2)
    with pytest.raises(SegmentMismatch):  # overlap disagrees with what is held
        store.return_partial("i0", [seg("a/0", 0, [1, 9, 3])])
    with pytest.raises(SegmentMismatch):  # ends before what is held (a replayed old message)
        store.return_partial("i0", [seg("a/0", 0, [1])])
    assert store.to_dict() == before
    # a replay of the exact held prefix plus new tokens is fine
    store.return_partial("i0", [seg("a/0", 1, [2, 3])])
    t = store.get("a/0")
    assert t.generated_token_ids.tolist() == [1, 2, 3]


def test_output_from_wrong_instance_rejected(store: TrajectoryStore) -> None:
    store.route("i0", ["a/0"], 0)
    before = store.to_dict()
    with pytest.raises(WrongOwner) as err:
        store.return_partial("i1", [seg("a/0", 0, [1])])
    assert (err.value.instance_id, err.value.owner) == ("i1", "i0")
    with pytest.raises(WrongOwner):
        store.finish("i1", [done("a/0", 0, [1])])
    with pytest.raises(WrongOwner):  # queued, not running anywhere
        store.return_partial("i0", [seg("a/1", 0, [1])])
    with pytest.raises(InvalidRecord):  # a Completion where a plain Segment is expected
        store.return_partial("i0", [done("a/0", 0, [1])])
    assert store.to_dict() == before


def test_partial_reaching_max_new_tokens_must_be_finished(store: TrajectoryStore) -> None:
    store.route("i0", ["a/0"], 0)
    before = store.to_dict()
    with pytest.raises(InvalidRecord) as err:
        store.return_partial("i0", [seg("a/0", 0, list(range(8)))])
    assert err.value.field == "token_ids"
    with pytest.raises(InvalidRecord):
        store.finish("i0", [done("a/0", 0, list(range(9)), reason="length")])
    assert store.to_dict() == before
    f = store.finish("i0", [done("a/0", 0, list(range(8)), reason="length")])[0]
    assert f.finish_reason is FinishReason.LENGTH


def test_finish_then_release(store: TrajectoryStore) -> None:
    store.route("i0", ["a/0", "b/0"], 1)
    fin = store.finish("i0", [done("a/0", 0, [5, 6], version=1)])
    assert fin[0].trajectory.generated_token_ids.tolist() == [5, 6]
    assert fin[0].instance_id == "i0"
    assert state(store) == {
        "where": {
            "a/0": ("finished", None),
            "a/1": ("queued", None),
            "b/0": ("running", "i0"),
        },
        "queue": [("a/1", None, 0)],
        "levels": {None: 1},
        "held": {"i0": ("b/0",)},
    }
    assert store.finished() == fin
    assert store.finished_ids() == ("a/0",)
    assert store.release(["a/0"]) == fin
    assert store.finished_ids() == ()
    assert store.finished() == ()
    assert store.location("a/0").state is LocationState.FINISHED
    with pytest.raises(UnknownTrajectory):
        store.get("a/0")  # payload freed
    with pytest.raises(WrongState):
        store.release(["a/0"])
    assert store.stats().released == 1


def test_free_does_what_release_does_without_the_payloads(store: TrajectoryStore) -> None:
    store.route("i0", ["a/0", "a/1", "b/0"], 1)
    store.finish("i0", [done("a/0", 0, [5, 6], version=1), done("a/1", 0, [7], version=1)])
    twin = TrajectoryStore.from_dict(store.to_dict())
    before = store.to_dict()
    with pytest.raises(WrongState) as ei:  # all or nothing: b/0 is still running
        store.free(["a/0", "b/0"])
    assert ei.value.trajectory_id == "b/0" and store.to_dict() == before
    assert store.free(["a/0", "a/1"]) == 2
    twin.release(["a/0", "a/1"])
    assert store.to_dict() == twin.to_dict()  # the same ledger, the same events
    assert store.location("a/0").state is LocationState.FINISHED
    assert store.finished() == () and store.stats().released == 2
    with pytest.raises(WrongState) as again:
        store.free(["a/1"])
    assert "already released" in str(again.value)
    with pytest.raises(InvalidRecord):
        store.free(["a/0", "a/0"])


def test_drop_from_every_place(store: TrajectoryStore) -> None:
    store.submit_group("c", [1], 1)
    store.route("i0", ["a/0", "a/1"], 0)
    store.finish("i0", [done("a/1", 0, [1])])
    store.drop(["a/0", "a/1", "b/0"], "group-redundancy")
    assert state(store) == {
        "where": {
            "a/0": ("dropped", "group-redundancy"),
            "a/1": ("dropped", "group-redundancy"),
            "b/0": ("dropped", "group-redundancy"),
            "c/0": ("queued", None),
        },
        "queue": [("c/0", None, 0)],
        "levels": {None: 1},
        "held": {},
    }
    before = store.to_dict()
    with pytest.raises(WrongState):
        store.drop(["c/0", "a/0"], "again")
    with pytest.raises(InvalidRecord) as err:
        store.drop(["c/0"], "")
    assert err.value.field == "reason"
    assert store.to_dict() == before
    # the late output of a dropped running trajectory is refused, not resurrected
    with pytest.raises(WrongOwner):
        store.return_partial("i0", [seg("a/0", 0, [1])])


def test_drop_group(store: TrajectoryStore) -> None:
    store.route("i0", ["a/0"], 0)
    store.drop(["a/1"], "first")
    assert store.drop_group("a", "filtered") == ("a/0",)
    assert store.location("a/0").reason == "filtered"
    assert store.location("a/1").reason == "first"
    with pytest.raises(UnknownGroup):
        store.drop_group("nope", "x")


def test_instance_lost_returns_everything_it_held(store: TrajectoryStore) -> None:
    store.route("i0", ["a/0", "b/0"], 2)
    store.return_partial("i0", [seg("a/0", 0, [1, 2], 2)])
    store.route("i0", ["a/0"], 2)
    store.route("i1", ["a/1"], 2)
    assert store.instance_lost("i0") == ("b/0", "a/0")
    assert state(store) == {
        "where": {
            "a/0": ("queued", None),
            "a/1": ("running", "i1"),
            "b/0": ("queued", None),
        },
        "queue": [("a/0", 2, 2), ("b/0", 2, 0)],
        "levels": {2: 2},
        "held": {"i1": ("a/1",)},
    }
    assert store.get("a/0").generated_token_ids.tolist() == [1, 2]  # last returned output kept
    assert store.history("b/0")[-1].kind is EventKind.LOST
    assert store.instance_lost("i0") == ()  # idempotent
    with pytest.raises(WrongOwner):  # a zombie instance's late output is refused
        store.return_partial("i0", [seg("a/0", 2, [3], 2)])


def test_stats_and_history(store: TrajectoryStore) -> None:
    store.route("i0", ["a/0"], 1)
    store.finish("i0", [done("a/0", 0, [1, 2], 1)])
    store.route("i1", ["a/1"], 1)
    store.drop(["b/0"], "filtered")
    st = store.stats()
    assert (st.queued, st.running, st.finished, st.dropped, st.released) == (0, 1, 1, 0 + 1, 0)
    assert st.total == 3
    assert st.running_by_instance == {"i1": 1}
    assert st.queued_by_level == {}
    assert st.tokens_held == (3 + 2) + 3
    kinds = [(e.kind, e.instance_id) for e in store.history("a/0")]
    assert kinds == [
        (EventKind.SUBMITTED, None),
        (EventKind.ROUTED, "i0"),
        (EventKind.FINISHED, "i0"),
    ]
    seqs = [e.seq for tid in store.ledger() for e in store.history(tid)]
    assert len(set(seqs)) == len(seqs)


def test_to_dict_round_trip_is_exact_and_json(store: TrajectoryStore) -> None:
    store.submit_group(
        "m", [9] * 5, 3, metadata={"ground_truth": "42", "data_source": "gsm8k", "k": [1, 2.5]}
    )
    store.route("i0", ["a/0", "m/1"], 1)
    store.return_partial("i0", [seg("a/0", 0, [1, 2], 1, lp=-1e-300)])
    store.route("i1", ["a/0"], 2)
    store.finish("i0", [done("m/1", 0, [3], 1)])
    store.route("i0", ["m/0"], 2)
    store.drop(["b/0"], "filtered")
    d = store.to_dict()
    text = json.dumps(d)
    again = TrajectoryStore.from_dict(json.loads(text))
    assert again.to_dict() == d
    assert state(again) == state(store)
    assert again.get("a/0") == store.get("a/0")
    assert again.get("m/0").metadata == {
        "ground_truth": "42",
        "data_source": "gsm8k",
        "k": [1, 2.5],
    }
    assert again.finished() == store.finished()
    assert [again.history(t) for t in again.ledger()] == [store.history(t) for t in store.ledger()]
    # the restored store keeps working identically
    for s in (store, again):
        s.instance_lost("i1")
        s.submit_group("z", [1], 1)
    assert again.to_dict() == store.to_dict()


def test_records_validate_fields() -> None:
    with pytest.raises(InvalidRecord) as e1:
        Trajectory(trajectory_id="x", group_id="g", prompt_token_ids=[])
    assert e1.value.field == "prompt_token_ids"
    with pytest.raises(InvalidRequest) as e2:  # the engine's record, the engine's error
        SamplingParams(top_p=0.0)
    assert e2.value.field == "top_p"
    with pytest.raises(InvalidRecord) as e3:
        Trajectory(trajectory_id="x", group_id="g", prompt_token_ids=[1], metadata={"f": object()})
    assert e3.value.field == "metadata.f"
    with pytest.raises(InvalidRecord) as e4:
        Segment(trajectory_id="x", start=0, token_ids=[1, 2], logprobs=[0.0], versions=[0, 0])
    assert e4.value.field == "logprobs"
    with pytest.raises(InvalidRecord):
        Trajectory(trajectory_id="x", group_id="g", prompt_token_ids=[2**40])
    with pytest.raises(InvalidRecord) as e5:
        Trajectory(
            trajectory_id="x",
            group_id="g",
            prompt_token_ids=[1],
            v_traj=3,
            generated_token_ids=[1],
            generated_logprobs=[0.0],
            generated_versions=[2],
        )
    assert e5.value.field == "generated_versions"
