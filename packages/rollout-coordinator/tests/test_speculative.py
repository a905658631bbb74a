"""Speculative state: commands apply immediately; bad or stale snapshots change nothing."""

from __future__ import annotations

import pytest

from rollout_coordinator import (
    FutureSnapshot,
    InconsistentSnapshot,
    InstanceSnapshot,
    InvalidSnapshot,
    Route,
    RunningEntry,
    SpeculativeState,
    StaleSnapshot,
    SyncInProgress,
    UnknownInstance,
)


def snap(iid="i0", seq=1, t=1.0, version=0, running=(), waiting=0, kv=0, cap=1000, tput=0.0):
    return InstanceSnapshot(
        instance_id=iid,
        seq=seq,
        time_s=t,
        version=version,
        running=running,
        waiting=waiting,
        kv_used_tokens=kv,
        kv_capacity_tokens=cap,
        throughput_tokens_per_s=tput,
    )


def entry(tid, p=10, g=0, v=None):
    return RunningEntry(trajectory_id=tid, prompt_tokens=p, generated_tokens=g, v_traj=v)


@pytest.fixture
def state():
    s = SpeculativeState()
    s.add_instance("i0", version=0, kv_capacity_tokens=1000)
    s.add_instance("i1", version=0, kv_capacity_tokens=1000)
    return s


def counters(st):
    return (
        st.version,
        st.target_version,
        st.syncing,
        st.n_running,
        st.kv_used,
        st.waiting,
        st.last_seq,
        sorted(e.trajectory_id for e in st.running_entries()),
    )


def test_snapshot_replaces_counters(state):
    state.apply_snapshot(
        snap(running=(entry("a", 50, 10),), kv=60, waiting=2, seq=3), now=1.0, latest_version=0
    )
    st = state.get("i0")
    assert counters(st) == (0, 0, False, 1, 60, 2, 3, ["a"])
    assert st.kv_usage == pytest.approx(0.06)


def test_route_counts_immediately_and_waits_when_full(state):
    assert state.route("i0", entry("a", 400), now=2.0) is True
    assert state.route("i0", entry("b", 500), now=2.0) is True
    # 900 + 200 > 1000: the engine would queue it
    assert state.route("i0", entry("c", 200), now=2.0) is False
    st = state.get("i0")
    assert (st.n_running, st.kv_used, st.waiting) == (2, 900, 1)
    # once waiting, even a small one waits (FIFO engine queue)
    assert state.route("i0", entry("d", 1), now=2.0) is False
    assert st.waiting == 2


def test_interrupt_removes_running_and_ignores_unknown(state):
    state.apply_snapshot(
        snap(running=(entry("a", 100), entry("b", 200)), kv=300), now=1.0, latest_version=0
    )
    state.route("i0", entry("c", 50), now=2.0)
    gone = state.interrupt("i0", ["a", "c", "zzz"], now=2.0)
    assert sorted(e.trajectory_id for e in gone) == ["a", "c"]
    st = state.get("i0")
    assert counters(st)[3:6] == (1, 200, 0)
    assert [e.trajectory_id for e in st.running_entries()] == ["b"]


@pytest.mark.parametrize("batch", [False, True], ids=["route", "route_all"])
def test_interrupted_then_routed_back_before_a_snapshot_runs_once(state, batch):
    """A trajectory the last snapshot lists, interrupted (a migration) and routed back to the
    same instance before its next snapshot, runs there once: as the new entry."""
    state.apply_snapshot(snap(running=(entry("t", 100, 10),), kv=110), now=1.0, latest_version=0)
    state.interrupt("i0", ["t"], now=2.0)
    if batch:
        r = Route(trajectory_id="t", instance_id="i0", version=0, group_id="g", new=False,
                  reserved_buffer=None, tokens=120)  # fmt: skip
        state.route_all([r], now=3.0)
    else:
        state.route("i0", entry("t", 120), now=3.0)
    st = state.get("i0")
    assert [(e.trajectory_id, e.tokens) for e in st.running_entries()] == [("t", 120)]
    assert (st.n_running, st.kv_used) == (1, 120) and st.is_running("t")
    gone = state.interrupt("i0", ["t"], now=4.0)
    assert [(e.trajectory_id, e.tokens) for e in gone] == [("t", 120)]
    assert (st.n_running, st.kv_used, list(st.running_entries())) == (0, 0, [])
    assert not st.is_running("t")


def test_snapshot_older_than_local_update_is_rejected_and_state_kept(state):
    state.route("i0", entry("a", 100), now=5.0)
    before = counters(state.get("i0"))
    with pytest.raises(StaleSnapshot) as ei:
        state.apply_snapshot(snap(t=4.9, seq=1), now=5.0, latest_version=0)
    assert ei.value.field == "time_s" and ei.value.instance_id == "i0"
    assert counters(state.get("i0")) == before
    state.apply_snapshot(
        snap(t=5.0, seq=1, running=(entry("a", 100),), kv=100), now=5.0, latest_version=0
    )
    assert counters(state.get("i0"))[3:5] == (1, 100)


def test_seq_regression_and_duplicate_rejected(state):
    state.apply_snapshot(snap(seq=5, t=1.0), now=1.0, latest_version=0)
    for bad_seq in (5, 4):
        with pytest.raises(StaleSnapshot) as ei:
            state.apply_snapshot(snap(seq=bad_seq, t=2.0, kv=7), now=2.0, latest_version=0)
        assert ei.value.field == "seq"
    assert state.get("i0").kv_used == 0


def test_future_snapshot_rejected(state):
    with pytest.raises(FutureSnapshot) as ei:
        state.apply_snapshot(snap(t=10.0), now=9.0, latest_version=0)
    assert ei.value.field == "time_s"
    assert state.get("i0").last_seq == -1


def test_unknown_instance_rejected(state):
    with pytest.raises(UnknownInstance) as ei:
        state.apply_snapshot(snap(iid="ghost"), now=1.0, latest_version=0)
    assert ei.value.instance_id == "ghost"
    assert "ghost" in str(ei.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"waiting": -1}, "waiting"),
        ({"kv": -5}, "kv_used_tokens"),
        ({"version": -1}, "version"),
        ({"seq": -1}, "seq"),
        ({"kv": 2000, "cap": 1000}, "kv_used_tokens"),
        ({"cap": 0}, "kv_capacity_tokens"),
        ({"tput": float("nan")}, "throughput_tokens_per_s"),
        (
            {"running": (RunningEntry(trajectory_id="a", prompt_tokens=-1, generated_tokens=0),)},
            "running",
        ),
        ({"running": (entry("a"), entry("a"))}, "running"),
    ],
)
def test_invalid_snapshot_fields(kwargs, field):
    with pytest.raises(InvalidSnapshot) as ei:
        snap(**kwargs)
    assert ei.value.field == field


def test_version_rules(state):
    state.apply_snapshot(snap(version=1, seq=1), now=1.0, latest_version=2)  # first defines it
    with pytest.raises(InconsistentSnapshot):  # never published
        state.apply_snapshot(snap(version=3, seq=2, t=1.0), now=1.0, latest_version=2)
    with pytest.raises(InconsistentSnapshot):  # regression
        state.apply_snapshot(snap(version=0, seq=2, t=1.0), now=1.0, latest_version=2)
    with pytest.raises(InconsistentSnapshot):  # nobody synced it
        state.apply_snapshot(snap(version=2, seq=2, t=1.0), now=1.0, latest_version=2)
    assert state.get("i0").version == 1
    state.begin_sync("i0", 2, now=2.0)
    state.apply_snapshot(snap(version=2, seq=2, t=2.0), now=2.0, latest_version=2)
    st = state.get("i0")
    assert (st.version, st.target_version, st.syncing) == (2, 2, False)


def test_sync_clears_work_and_never_twice(state):
    state.route("i0", entry("a", 100), now=1.0)
    gone = state.begin_sync("i0", 1, now=1.0)
    assert [e.trajectory_id for e in gone] == ["a"]
    st = state.get("i0")
    assert counters(st)[:6] == (0, 1, True, 0, 0, 0)
    with pytest.raises(SyncInProgress) as ei:
        state.begin_sync("i0", 2, now=1.5)
    assert ei.value.to_version == 1
    assert st.target_version == 1
    # a route held for a syncing instance will run once the sync is done
    assert state.route("i0", entry("b", 10), now=1.5) is True
    assert (st.n_running, st.kv_used) == (1, 10)
    state.finish_sync("i0", 1, now=2.0)
    assert counters(st)[:3] == (1, 1, False)


def test_fail_sync_reverts_target(state):
    state.begin_sync("i0", 3, now=1.0)
    state.fail_sync("i0", now=2.0)
    st = state.get("i0")
    assert (st.version, st.target_version, st.syncing) == (0, 0, False)
