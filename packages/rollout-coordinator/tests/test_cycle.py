"""The cycle: bad input keeps the last good state; baselines' admission; protocol aborts; config."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from rollout_coordinator import (
    ConfigError,
    Coordinator,
    CoordinatorConfig,
    Drop,
    FutureSnapshot,
    Interrupt,
    InvalidSnapshot,
    Route,
    StaleSnapshot,
    Sync,
    UnknownInstance,
    UnknownPolicy,
)
from rollout_coordinator.policies import POLICIES, build_policy
from rollout_coordinator.testing import Clock, make, new, snap
from staleness_protocol import Abort, ProtocolConfig, StalenessProtocol


def routes(cmds):
    return [c for c in cmds if isinstance(c, Route)]


# ---- bad input ------------------------------------------------------------------------------


def test_bad_snapshots_are_rejected_and_the_cycle_continues():
    coord, _, _ = make(instances=[("a", 0), ("b", 0)])
    coord.step([snap("a", n=5, t=0.0), snap("b", n=5, t=0.0)], [], now=0.0)
    seq_a = coord.instances["a"].last_seq

    class Garbage:
        instance_id = "b"

    bad = [
        snap("ghost", t=1.0),  # unknown instance
        snap("a", n=50, t=5.0),  # from the future (now = 1.0)
        Garbage(),  # not a snapshot at all
    ]
    cmds = coord.step(bad, [new("t0")], now=1.0)
    kinds = sorted(type(e).__name__ for e in coord.last_cycle.rejected)
    assert kinds == ["FutureSnapshot", "InvalidSnapshot", "UnknownInstance"]
    assert coord.instances["a"].last_seq == seq_a  # last good state kept
    assert coord.instances["a"].n_running + coord.instances["b"].n_running == 11  # 5 + 5 + route
    assert len(routes(cmds)) == 1  # the cycle still routed with the last good state
    assert isinstance(
        coord.last_cycle.rejected[0], UnknownInstance | FutureSnapshot | InvalidSnapshot
    )


def test_snapshot_older_than_routes_is_rejected():
    coord, _, _ = make(instances=[("a", 0)])
    coord.step([snap("a", t=0.0)], [new("t0")], now=1.0)  # route at t=1.0
    with capture_logs() as logs:
        coord.step([snap("a", t=0.5)], [], now=1.1)  # taken before the route
        assert [type(e) for e in coord.last_cycle.rejected] == [StaleSnapshot]
        assert coord.instances["a"].n_running == 1

        class Garbage:
            instance_id = "a"

        coord.step([Garbage()], [], now=1.3)  # not a snapshot at all
    # the stale one is the expected race with a command (info); a broken one is a warning
    said = [(e["log_level"], e["field"]) for e in logs if e["event"] == "snapshot_rejected"]
    assert [lv for lv, _ in said] == ["info", "warning"], said
    assert coord.instances["a"].n_running == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("theta", 0.0),
        ("theta", 1.5),
        ("route_kv_limit", 0.0),
        ("sync_kv_threshold", -0.1),
        ("sync_kv_threshold", 1.1),
        ("bounce_kv_threshold", 2.0),
        ("migration_ratio", 1.0),
        ("migration_ratio", float("inf")),
        ("migration_indicator", "vibes"),
        ("migration_min_running", 0),
        ("max_routes_per_cycle", 0),
        ("route_miss_limit", 1.5),
        ("bounce_waiting_threshold", True),
        ("cost_model", "qwen-7b-h20"),
    ],
)
def test_thresholds_out_of_range_name_the_field(field, value):
    with pytest.raises(ConfigError) as ei:
        CoordinatorConfig(**{field: value})
    assert ei.value.field == field
    assert field in str(ei.value)


def test_config_from_dict_resolves_cost_model_and_rejects_unknown_fields(tmp_path):
    cfg = CoordinatorConfig.from_dict(
        {"policy": "coarse-async", "cost_model": "qwen-7b-h20", "theta": 0.4}
    )
    assert cfg.cost_model.name == "qwen-7b-h20" and cfg.theta == 0.4
    with pytest.raises(ConfigError) as ei:
        CoordinatorConfig.from_dict({"thetta": 0.4})
    assert ei.value.field == "thetta"
    with pytest.raises(ConfigError) as ei:  # an unreadable file: why, kept apart
        CoordinatorConfig.from_dict({"cost_model": str(tmp_path / "none.json")})
    assert ei.value.field == "cost_model" and ei.value.value == str(tmp_path / "none.json")
    assert "none.json" in ei.value.detail and ei.value.detail in str(ei.value)


# ---- registry -------------------------------------------------------------------------------


def test_registry_builds_every_named_policy():
    assert set(POLICIES) == {
        "staleflow",
        "sync",
        "one-step",
        "coarse-async",
        "coarse-async-drop",
        "verl-async",
        "vanilla-routing",
        "vanilla-sync",
        "vanilla-migration",
        "all-vanilla",
    }
    for name in POLICIES:
        p = build_policy(name)
        assert p.name == name and p.description
    assert build_policy("sync").colocated and build_policy("sync").required_eta == 0
    assert build_policy("one-step").required_eta == 1
    assert build_policy("vanilla-routing").routing is build_policy("all-vanilla").routing
    assert build_policy("vanilla-routing").sync is build_policy("staleflow").sync
    assert {n for n in POLICIES if build_policy(n).protocol == "gc-fifo"} == {"coarse-async-drop"}
    assert {n for n in POLICIES if build_policy(n).protocol == "fifo"} == {"verl-async"}
    assert {n for n in POLICIES if not build_policy(n).keeps_eta} == {"verl-async"}


def test_a_policy_refuses_a_protocol_that_keeps_eta_another_way():
    """coarse-async-drop keeps η by dropping from a GcFifo; the buffer policies need the
    buffers. A mismatch is refused at construction, naming both."""
    from staleness_protocol import GcFifo, GcFifoConfig

    fifo = GcFifo(GcFifoConfig(batch_size=2, group_size=2, eta=1, max_inflight_groups=4))
    buffers = StalenessProtocol(ProtocolConfig(batch_size=2, group_size=2, eta=1))
    with pytest.raises(ConfigError, match="GcFifo"):
        Coordinator(CoordinatorConfig(policy="coarse-async-drop"), buffers)
    with pytest.raises(ConfigError, match="coarse-async"):
        Coordinator(CoordinatorConfig(policy="coarse-async"), fifo)
    Coordinator(CoordinatorConfig(policy="coarse-async-drop"), fifo)  # the match is accepted


def test_verl_async_needs_a_fifo_that_keeps_no_eta_and_a_window():
    """verl-async runs over an UnboundedFifo; a GcFifo or the buffers are refused, and so is
    a protocol without η when no ``verl_staleness_threshold`` says how wide its window is."""
    from staleness_protocol import GcFifo, GcFifoConfig, UnboundedConfig, UnboundedFifo

    gc = GcFifo(GcFifoConfig(batch_size=2, group_size=2, eta=1, max_inflight_groups=4))
    buffers = StalenessProtocol(ProtocolConfig(batch_size=2, group_size=2, eta=1))
    fifo = UnboundedFifo(UnboundedConfig(batch_size=2, group_size=2, max_inflight_groups=4))
    for wrong in (gc, buffers):
        with pytest.raises(ConfigError, match="UnboundedFifo") as ei:
            Coordinator(CoordinatorConfig(policy="verl-async"), wrong)
        assert ei.value.field == "protocol"
    with pytest.raises(ConfigError) as ei:
        Coordinator(CoordinatorConfig(policy="verl-async"), fifo)
    assert ei.value.field == "verl_staleness_threshold"
    Coordinator(CoordinatorConfig(policy="verl-async", verl_staleness_threshold=1.0), fifo)
    with pytest.raises(ConfigError, match="GcFifo"):  # an unbounded FIFO is not a GcFifo
        Coordinator(CoordinatorConfig(policy="coarse-async-drop"), fifo)


def test_unknown_policy():
    with pytest.raises(UnknownPolicy) as ei:
        build_policy("fastest")
    assert "staleflow" in str(ei.value)
    with pytest.raises(ConfigError):
        CoordinatorConfig(policy="fastest")


def test_baseline_refuses_mismatched_eta():
    proto = StalenessProtocol(ProtocolConfig(batch_size=2, group_size=2, eta=3))
    with pytest.raises(ConfigError) as ei:
        Coordinator(CoordinatorConfig(policy="sync"), proto, Clock())
    assert ei.value.field == "eta"


# ---- baselines' admission -------------------------------------------------------------------


def test_coarse_async_budget():
    # B=2 groups x n=2 = 4 trajectories per batch, eta=1, v=0: budget (1+0+1)*4 = 8
    coord, _, _ = make("coarse-async", instances=[("a", 0), ("b", 0)], batch=2, group=2, eta=1)
    q = [new(f"t{k}", group=f"g{k // 2}") for k in range(12)]
    cmds = coord.step([snap("a"), snap("b")], q, now=0.0)
    assert len(routes(cmds)) == 8 == coord.last_cycle.quota
    assert coord.step([], q[8:], now=0.1) == []  # budget spent
    coord.on_dropped(["t0", "t1"])  # filtered: two replacements fit in the budget
    coord.step([], q[8:], now=0.2)
    assert coord.last_cycle.quota == 2


def test_sync_baseline_generates_one_batch_per_version():
    coord, proto, _ = make("sync", instances=[("a", 0), ("b", 0)], batch=2, group=2, eta=0)
    q = [new(f"t{k}", group=f"g{k // 2}") for k in range(8)]
    first = routes(coord.step([snap("a"), snap("b")], q, now=0.0))
    assert len(first) == 4 and {r.instance_id for r in first} == {"a", "b"}
    # batch in flight: nothing more even though prompts wait
    assert routes(coord.step([], q[4:], now=0.1)) == []
    # generation done, trained, version 1 published: sync every instance, then the next batch
    for r in first:
        proto.finish(r.trajectory_id)
        coord.on_finished([r.trajectory_id])
    proto.consume()
    proto.publish(1)  # the trained weights are pullable
    cmds = coord.step([snap("a", t=0.2), snap("b", t=0.2)], q[4:], now=0.2)
    assert {c.instance_id for c in cmds if isinstance(c, Sync)} == {"a", "b"}
    assert routes(cmds) == []  # barrier: instances still syncing
    coord.on_sync_done("a", 1)
    coord.on_sync_done("b", 1)
    nxt = routes(coord.step([], q[4:], now=0.3))
    assert len(nxt) == 4 and all(r.version == 1 for r in nxt)


# ---- protocol aborts ------------------------------------------------------------------------


def test_protocol_aborts_become_interrupts_or_drops():
    coord, proto, _ = make(instances=[("a", 0)], batch=2, group=2, eta=1)
    cmds = coord.step([snap("a")], [new("t0", group="g0"), new("t1", group="g0")], now=0.0)
    assert len(routes(cmds)) == 2
    proto.reserve("gq", "queued", 0)  # reserved, but (say) back in the trajectory server
    assert proto.drop_group("g0", "filtered") is True
    proto.drop_group("gq", "filtered")
    aborts = [n for n in proto.take_notices() if isinstance(n, Abort)]
    assert len(aborts) == 3
    cmds = coord.abort(aborts)
    assert coord.step([], [], now=0.1) == []  # the coordinator never drains the protocol
    (it,) = [c for c in cmds if isinstance(c, Interrupt)]
    assert (it.instance_id, sorted(it.trajectory_ids), it.requeue, it.reason) == (
        "a",
        ["t0", "t1"],
        False,
        "filtered",
    )
    (dr,) = [c for c in cmds if isinstance(c, Drop)]
    assert dr.trajectory_ids == ("queued",)
    assert coord.instances["a"].n_running == 0
    assert (coord.last_cycle.aborted, coord.last_cycle.dropped) == (2, 1)


def test_a_released_route_aborted_before_it_is_emitted_becomes_a_drop():
    """The sync finished (the route is released) but no step emitted it yet when the
    protocol aborted the trajectory: the route is cancelled, never sent to the engine."""
    from rollout_coordinator.testing import partial

    coord, proto, _ = make(instances=[("a", 0)], start_version=1)
    proto.reserve("gp", "p1", 1)
    coord.step([snap("a", version=0)], [partial("p1", 1)], now=0.0)
    coord.on_sync_done("a", 1)  # released, to be emitted by the next step
    proto.drop_group("gp", "filtered")
    cmds = coord.abort(n for n in proto.take_notices() if isinstance(n, Abort))
    assert [type(c) for c in cmds] == [Drop] and cmds[0].trajectory_ids == ("p1",)
    assert routes(coord.step([], [], now=0.1)) == []
    assert coord.instances["a"].n_running == 0


def test_sync_failure_keeps_reservations_as_orphans():
    coord, proto, _ = make(instances=[("a", 0)], start_version=1)
    proto.reserve("gp", "p1", 1)
    from rollout_coordinator.testing import partial

    coord.step([snap("a", version=0)], [partial("p1", 1)], now=0.0)
    assert coord.instances["a"].syncing
    assert coord.on_sync_failed("a") == ["p1"]
    st = coord.instances["a"]
    assert (st.version, st.syncing) == (0, False)


def test_held_and_released_routes_are_never_routed_twice():
    """The caller's queue still lists a route held for a sync (and, the cycle after the sync
    finishes, the released route) until it executes the Route: the coordinator itself must not
    route that trajectory again, to the same or another instance."""
    from rollout_coordinator.testing import partial

    coord, proto, _ = make(instances=[("a", 0), ("b", 0)], start_version=1)
    proto.reserve("gp", "p1", 1)
    queue = [partial("p1", 1)]
    coord.step([snap("a", version=0), snap("b", version=0)], queue, now=0.0)
    assert coord.pending.trajectory_ids() == {"p1"}  # held for a's (or b's) sync
    target = next(iter(coord.pending.trajectory_ids()))
    held_on = next(i for i in ("a", "b") if coord.pending.held_for(i))
    assert target == "p1"
    # a cycle while the sync is still running: the queue view still lists p1
    cmds = coord.step([], queue, now=0.1)
    assert routes(cmds) == []
    assert len(coord.pending) == 1
    coord.on_sync_done(held_on, 1)
    # the cycle after the sync: p1 is released (one Route) and not routed again
    cmds = coord.step([], queue, now=0.2)
    rs = routes(cmds)
    assert [(r.trajectory_id, r.instance_id) for r in rs] == [("p1", held_on)]
    assert sum(i.n_running for i in coord.instances.values()) == 1


def test_a_held_route_aborted_before_the_sync_ends_becomes_a_drop_not_a_route():
    from rollout_coordinator.testing import partial

    coord, proto, _ = make(instances=[("a", 0)], start_version=1)
    proto.reserve("gp", "p1", 1)
    coord.step([snap("a", version=0)], [partial("p1", 1)], now=0.0)
    assert coord.pending.held_for("a")
    proto.drop_group("gp", "filtered")  # aborted while the route waits for a's sync
    cmds = coord.abort(n for n in proto.take_notices() if isinstance(n, Abort))
    cmds += coord.step([], [partial("p1", 1)], now=0.1)
    (dr,) = [c for c in cmds if isinstance(c, Drop)]
    assert dr.trajectory_ids == ("p1",)
    assert not [c for c in cmds if isinstance(c, Interrupt)]
    assert len(coord.pending) == 0
    assert coord.instances["a"].n_running == 0
    coord.on_sync_done("a", 1)
    assert routes(coord.step([], [], now=0.2)) == []


def test_the_admission_answers_kept_in_a_cycle_end_with_each_admission() -> None:
    """The port keeps the protocol's answer per (group, version) within a cycle, and drops
    them all whenever it admits: a fresh group admitted takes the last slot from the next."""
    from rollout_coordinator._cycle import _ProtocolPort

    coord, proto, _ = make(batch=1, group=2, eta=0, instances=[("a", 0)])
    port = _ProtocolPort(coord)
    assert port.admissible("ga", 0) and port.admissible("gb", 0)  # one slot, either may take it
    assert port.admit(new("ga/0", "ga"), 0) == 0
    assert not port.admissible("gb", 0)  # the slot is gone
    assert port.admissible("ga", 0)  # ga has room for its second member
    assert port.admit(new("ga/1", "ga"), 0) == 0
    assert not port.admissible("ga", 0)  # full now
    assert proto.buffer_fill(0).free == 0


# ---- silent instances -----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["staleflow", "all-vanilla"])
def test_a_silent_instance_is_left_out_of_the_cycle_until_it_answers(policy):
    from rollout_coordinator._state import coordinator_from_dict, coordinator_to_dict

    coord, proto, clock = make(policy, instances=[("a", 0), ("b", 0)])
    coord.step([snap("a", t=0.0), snap("b", t=0.0)], [], now=0.0)
    coord.set_silent("a")
    assert coord.silent == {"a"}
    cmds = coord.step([], [new(f"t{i}", group=f"g{i // 2}") for i in range(4)], now=1.0)
    assert {r.instance_id for r in routes(cmds)} == {"b"}, cmds
    assert coord.instances["a"].n_running == 0
    # kept across a save and restore
    twin = coordinator_from_dict(coordinator_to_dict(coord), coord.config, proto, clock)
    assert twin.silent == {"a"}
    coord.set_silent("a", False)
    cmds = coord.step([], [new(f"u{i}", group=f"h{i // 2}") for i in range(4)], now=2.0)
    assert "a" in {r.instance_id for r in routes(cmds)}, cmds
    with pytest.raises(KeyError, match="ghost"):
        coord.set_silent("ghost")
    coord.set_silent("b")
    coord.remove_instance("b")
    assert coord.silent == frozenset()


def test_routes_taken_back_unsent_leave_the_waiting_count_too():
    """A route the caller never sent (``unroute``) is taken out of the instance's speculative
    state, also where the instance had no room and it was counted as waiting."""
    coord, _, _ = make("vanilla-routing", instances=[("a", 0)])
    coord.step([snap("a", t=0.0, waiting=1, n=1)], [], now=0.0)
    cmds = coord.step([], [new("t0", group="g0"), new("t1", group="g0")], now=1.0)
    routed = [c.trajectory_id for c in routes(cmds)]
    assert routed and coord.instances["a"].waiting == 1 + len(routed)  # no room: waiting
    coord.set_silent("a")
    coord.unroute("a", routed)
    assert coord.instances["a"].waiting == 1  # the engine's own queue only
    coord.unroute("a", routed)  # not routed there any more: nothing to take back
    assert coord.instances["a"].waiting == 1
    assert coord._routed["a"] == {}  # nor remembered as routed there
