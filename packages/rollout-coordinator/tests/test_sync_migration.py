"""Synchronization and migration strategies on hand-built snapshots."""

from __future__ import annotations

import math

import pytest

from rollout_coordinator import CoordinatorConfig, CostModel, Route
from rollout_coordinator._speculative import InstanceState
from rollout_coordinator.policies.sync_per_instance import router_load, router_loaded
from rollout_coordinator.testing import CAP, interrupts, make, new, partial, snap, syncs

# ---- per-instance sync ----------------------------------------------------------------------


def test_stale_instance_with_admissible_work_is_not_synced():
    coord, proto, _ = make(instances=[("a", 0)], start_version=1)
    proto.reserve("gp", "p0", 0)
    cmds = coord.step([snap("a", version=0)], [partial("p0", 0)], now=0.0)
    assert syncs(cmds) == {}
    assert any(isinstance(c, Route) and c.instance_id == "a" for c in cmds)


def test_stale_instance_with_admissible_new_work_is_not_synced():
    coord, _, _ = make(instances=[("a", 0)], start_version=1)
    cmds = coord.step([snap("a", version=0)], [new("t0")], now=0.0)
    assert syncs(cmds) == {}


def test_stale_starved_idle_instance_syncs():
    coord, proto, _ = make(instances=[("a", 0)], start_version=1)
    proto.reserve("gp", "p1", 1)  # only work needs version >= 1
    cmds = coord.step([snap("a", version=0)], [partial("p1", 1)], now=0.0)
    assert syncs(cmds) == {"a": 1}
    st = coord.instances["a"]
    assert st.syncing and st.target_version == 1
    # the route to it is held until the sync is done, then released by the next cycle
    assert not any(isinstance(c, Route) for c in cmds)
    assert coord.last_cycle.held_routes == 1
    # never a second sync mid-sync
    assert syncs(coord.step([], [], now=0.5)) == {}
    coord.on_sync_done("a", 1)
    released = [c for c in coord.step([], [], now=1.0) if isinstance(c, Route)]
    assert [(r.trajectory_id, r.instance_id) for r in released] == [("p1", "a")]


def test_busy_stale_instance_keeps_serving():
    coord, proto, _ = make(instances=[("a", 0)], start_version=1, sync_kv_threshold=0.3)
    proto.reserve("gp", "p1", 1)
    # 40% KV busy: syncing now would interrupt useful work
    cmds = coord.step(
        [snap("a", version=0, n=40, tokens_each=CAP // 100)], [partial("p1", 1)], now=0.0
    )
    assert syncs(cmds) == {}
    # a waiting queue also blocks
    coord2, proto2, _ = make(instances=[("a", 0)], start_version=1)
    proto2.reserve("gp", "p1", 1)
    assert syncs(coord2.step([snap("a", version=0, waiting=1)], [partial("p1", 1)], now=0.0)) == {}


def test_instance_below_abort_floor_always_syncs():
    # B=1, n=1, eta=0: once buffer 1 is READY, version 1... use floor directly
    coord, proto, _ = make(instances=[("a", 0), ("b", 1)], batch=1, group=1, eta=1, start_version=1)
    proto.reserve("g", "x", 1)
    proto.finish("x")  # occupies buffer 1 -> READY; buffer 2 not created -> floor 0
    assert proto.abort_floor == 0
    cmds = coord.step(
        [snap("a", version=0, n=30, tokens_each=2000), snap("b", version=1)], [], now=0.0
    )
    assert syncs(cmds) == {"a": 1}


def test_greedy_global_sync_on_publish():
    coord, _, _ = make("vanilla-sync", instances=[("a", 0), ("b", 0)], start_version=1)
    cmds = coord.step([snap("a", version=0, n=30), snap("b", version=0)], [new("t0")], now=0.0)
    assert syncs(cmds) == {"a": 1, "b": 1}


def test_unpublished_version_is_not_synced_to():
    # the trainer consumed buffer 0 (next_buffer 1) but version 1's weights are not pushed yet
    coord, proto, _ = make("vanilla-sync", instances=[("a", 0)], batch=1, group=1)
    proto.reserve("g", "t", 0)
    proto.finish("t")
    proto.consume()
    assert (proto.next_buffer, coord.latest_version) == (1, 0)
    assert syncs(coord.step([snap("a")], [], now=0.0)) == {}
    proto.publish(1)
    assert coord.latest_version == 1
    assert syncs(coord.step([], [], now=0.1)) == {"a": 1}


# ---- migration ------------------------------------------------------------------------------
# The loads below are under the cost model's knee, where the default ``migration_min_speedup``
# refuses every move; these tests check the paper's rule, so they switch that test off.
OFF = {"migration_min_speedup": None}


def test_migration_triggers_from_loaded_to_starving():
    coord, _, _ = make(instances=[("idle", 0), ("busy", 0)], migration_ratio=5.0, **OFF)
    cmds = coord.step([snap("idle"), snap("busy", n=12, tokens_each=3000)], [], now=0.0)
    (it,) = interrupts(cmds)
    assert (it.instance_id, it.reason, it.requeue) == ("busy", "migration", True)
    assert len(it.trajectory_ids) == 6  # half the gap
    assert coord.instances["busy"].n_running == 6
    assert coord.last_cycle.migrated == 6


def test_migration_stops_below_ratio_threshold():
    # starving instance has 2 x 3000 KV; busy has 8 x 3000 = 4x < 5x -> no migration
    coord, _, _ = make(instances=[("s", 0), ("busy", 0)], migration_ratio=5.0, **OFF)
    cmds = coord.step(
        [snap("s", n=2, tokens_each=3000), snap("busy", n=8, tokens_each=3000)], [], now=0.0
    )
    assert interrupts(cmds) == []
    # at 10x it triggers
    coord, _, _ = make(instances=[("s", 0), ("busy", 0)], migration_ratio=5.0, **OFF)
    cmds = coord.step(
        [snap("s", n=1, tokens_each=3000), snap("busy", n=10, tokens_each=3000)], [], now=0.0
    )
    assert [i.instance_id for i in interrupts(cmds)] == ["busy"]


def test_migration_needs_min_running_and_no_queued_work():
    coord, _, _ = make(instances=[("idle", 0), ("busy", 0)], migration_min_running=4, **OFF)
    assert interrupts(coord.step([snap("idle"), snap("busy", n=3)], [], now=0.0)) == []
    # once the idle instance took the queue's work, the ratio (12 vs 8 trajectories) is < 5
    coord, _, _ = make(instances=[("idle", 0), ("busy", 0)], batch=8, group=8, **OFF)
    q = [new(f"t{k}") for k in range(8)]
    cmds = coord.step([snap("idle"), snap("busy", n=12)], q, now=0.0)
    assert coord.last_cycle.routes == 8
    assert coord.instances["idle"].n_running == 8
    assert interrupts(cmds) == []


def test_migration_only_moves_what_the_starving_instance_can_serve():
    # sync_kv_threshold=0 keeps s from syncing (it would then serve version 1 and get the work)
    coord, proto, _ = make(
        instances=[("s", 0), ("busy", 1)], start_version=1, sync_kv_threshold=0.0, **OFF
    )
    for k in range(10):
        proto.reserve(f"g{k}", f"busy-r{k}", 1)
    cmds = coord.step([snap("s", version=0), snap("busy", version=1, n=10)], [], now=0.0)
    # every running trajectory has V_traj 1 > the starving instance's version 0
    assert syncs(cmds) == {}
    assert not [i for i in interrupts(cmds) if i.reason == "migration"]
    # with sync allowed, s moves to version 1 and becomes a valid target in the same cycle
    coord, proto, _ = make(instances=[("s", 0), ("busy", 1)], start_version=1, **OFF)
    for k in range(10):
        proto.reserve(f"g{k}", f"busy-r{k}", 1)
    cmds = coord.step([snap("s", version=0), snap("busy", version=1, n=10)], [], now=0.0)
    assert syncs(cmds) == {"s": 1}
    assert [len(i.trajectory_ids) for i in interrupts(cmds)] == [5]


def test_migration_acts_under_the_even_router():
    """The vanilla-routing ablation replaces routing only: an instance the queue has no work
    for is starving there too, and migration moves work to it."""
    coord, _, _ = make("vanilla-routing", instances=[("idle", 0), ("busy", 0)], **OFF)
    cmds = coord.step([snap("idle"), snap("busy", n=12, tokens_each=3000)], [], now=0.0)
    (it,) = interrupts(cmds)
    assert (it.instance_id, it.reason, len(it.trajectory_ids)) == ("busy", "migration", 6)
    # not while work the router could place is cut off by its route cap
    coord, _, _ = make(
        "vanilla-routing",
        instances=[("idle", 0), ("busy", 0)],
        batch=8,
        group=2,
        max_routes_per_cycle=1,
        **OFF,
    )
    q = [new(f"t{k}", group=f"g{k // 2}") for k in range(4)]
    cmds = coord.step([snap("idle"), snap("busy", n=12, tokens_each=3000)], q, now=0.0)
    assert coord.last_cycle.routes == 1 and interrupts(cmds) == []


def test_migration_moves_nothing_the_router_would_send_straight_back():
    """The cost-model router tries a partial's versions oldest first: work moved off ``busy``
    (version 0) toward a starving instance at version 1 would go back to version 0, where
    ``busy``, just emptied, is the best place. So nothing moves; it does where partials go by
    gain over every version, and under the even router (the least-loaded instance of any
    version)."""

    def moved(policy="staleflow", **cfg):
        coord, _, _ = make(
            policy,
            instances=[("idle", 1), ("busy", 0)],
            start_version=1,
            sync_kv_threshold=0.0,  # busy keeps version 0
            **OFF,
            **cfg,
        )
        busy = snap("busy", version=0, n=12, tokens_each=3000)
        cmds = coord.step([snap("idle", version=1), busy], [], now=0.0)
        assert syncs(cmds) == {}
        return [len(i.trajectory_ids) for i in interrupts(cmds) if i.reason == "migration"]

    assert moved() == []
    assert moved(partial_order="gain") == [6]
    assert moved("vanilla-routing") == [6]
    # at one version the moved work is spread by gain: it moves
    coord, _, _ = make(instances=[("idle", 1), ("busy", 1)], start_version=1, **OFF)
    cmds = coord.step([snap("idle", version=1), snap("busy", version=1, n=12)], [], now=0.0)
    assert [len(i.trajectory_ids) for i in interrupts(cmds)] == [6]


def test_vanilla_migration_is_passive():
    coord, _, _ = make("vanilla-migration", instances=[("idle", 0), ("busy", 0)], **OFF)
    assert interrupts(coord.step([snap("idle"), snap("busy", n=40)], [], now=0.0)) == []


def test_bounce_before_preemption_into_long_queue():
    coord, _, _ = make(instances=[("a", 0)], bounce_waiting_threshold=4, bounce_kv_threshold=0.9)
    running = snap("a", n=10, tokens_each=CAP // 10, waiting=5)  # 100% KV, long queue
    cmds = coord.step([running], [], now=0.0)
    (it,) = interrupts(cmds)
    assert it.reason == "bounce" and it.requeue
    assert len(it.trajectory_ids) == 1  # one 10% trajectory brings KV to 90%
    # below the waiting threshold: nothing
    coord, _, _ = make(instances=[("a", 0)], bounce_waiting_threshold=6, bounce_kv_threshold=0.9)
    assert (
        interrupts(coord.step([snap("a", n=10, tokens_each=CAP // 10, waiting=5)], [], now=0.0))
        == []
    )


def test_removed_instance_gets_no_route_released_by_its_finished_sync():
    """A sync finished, releasing the routes held for it; the instance dies before the next
    cycle emits them: no Route to it is emitted, the trajectory stays reserved and is served
    elsewhere at its V_traj (found by the randomized sim fault test)."""
    coord, proto, _ = make(instances=[("a", 0), ("b", 1)], start_version=1)
    proto.reserve("gp", "p1", 1)
    cmds = coord.step(
        [snap("a", version=0), snap("b", version=1, n=64, tokens_each=CAP // 64)],
        [partial("p1", 1)],
        now=0.0,
    )
    assert syncs(cmds) == {"a": 1}
    coord.on_sync_done("a", 1)
    coord.remove_instance("a")
    cmds = coord.step([snap("b", version=1, t=1.0)], [partial("p1", 1)], now=1.0)
    assert not any(isinstance(c, Route) and c.instance_id == "a" for c in cmds)
    assert proto.trajectory("p1").state.value == "in_flight"


def _synced_with_route_held(instances, **kw):
    """``a`` syncs 0 -> 1 with a partial held for it; version 2 is published meanwhile."""
    coord, proto, clock = make(instances=instances, batch=1, group=1, eta=2, start_version=1,
                               **kw)  # fmt: skip
    proto.reserve("gp", "p1", 1)
    others = [snap(i, version=v, n=64, tokens_each=CAP // 64) for i, v in instances if i != "a"]
    cmds = coord.step([snap("a", version=0), *others], [partial("p1", 1)], now=0.0)
    assert syncs(cmds) == {"a": 1}
    assert [r.trajectory_id for r in coord.pending.held_for("a")] == ["p1"]
    proto.reserve("gx", "x", 1)
    proto.finish("x")
    proto.consume()
    proto.publish(2)
    coord.on_sync_done("a", 1)
    clock.t = 1.0
    return coord, proto


def test_routes_a_sync_released_are_not_sent_to_an_instance_synced_again_at_once():
    # the released route would reach the engine just before the new sync interrupts it: it is
    # not sent; the only instance syncs on, and the partial waits for that sync instead
    coord, proto = _synced_with_route_held([("a", 0)])
    cmds = coord.step([snap("a", version=1, t=1.0)], [partial("p1", 1)], now=1.0)
    assert syncs(cmds) == {"a": 2}
    assert not any(isinstance(c, Route) for c in cmds)
    assert [r.trajectory_id for r in coord.pending.held_for("a")] == ["p1"]
    coord.on_sync_done("a", 2)
    cmds = coord.step([snap("a", version=2, t=2.0)], [partial("p1", 1)], now=2.0)
    assert [(c.trajectory_id, c.instance_id, c.version) for c in cmds if isinstance(c, Route)] == [
        ("p1", "a", 1)
    ]  # V_traj kept
    assert proto.trajectory("p1").state.value == "in_flight"


def test_routes_a_sync_released_go_elsewhere_in_the_same_cycle_when_it_syncs_again():
    # another instance serves version 1 with room to spare: the partial goes there in this
    # very cycle instead of waiting for a's new sync
    coord, _ = _synced_with_route_held([("a", 0), ("b", 1)])
    light = snap("b", version=1, n=8, tokens_each=CAP // 64, t=1.0)
    cmds = coord.step([snap("a", version=1, t=1.0), light], [partial("p1", 1)], now=1.0)
    assert syncs(cmds) == {"a": 2}
    assert [(c.trajectory_id, c.instance_id) for c in cmds if isinstance(c, Route)] == [("p1", "b")]
    assert not coord.pending.held_for("a")


def test_routes_a_sync_released_are_sent_when_the_instance_is_not_synced_again():
    coord, _ = _synced_with_route_held([("a", 0)], sync_require_starved=True)
    # p0 is admissible at version 1: a is not starved, keeps version 1 and runs what it got
    cmds = coord.step(
        [snap("a", version=1, t=1.0)], [partial("p1", 1), partial("p0", 1, group="g0")], now=1.0
    )
    assert syncs(cmds) == {}
    assert ("p1", "a") in [(c.trajectory_id, c.instance_id) for c in cmds if isinstance(c, Route)]


# ---- per-instance sync: the router-load test (sync_load_threshold) ----------------------------


def _placed_one_by_one(cfg, c, cap):
    """How many trajectories of ``c`` tokens the router places on an empty instance of ``cap``
    tokens, one route at a time, by its own three tests (the scalar formulas)."""
    cm = cfg.cost_model
    theta = cfg.theta if cfg.theta_slack is None else min(cfg.theta, cfg.theta_slack)
    j = 0
    while True:
        if cfg.route_max_concurrency is not None and j >= cfg.route_max_concurrency:
            return j
        if (j + 1) * c > cfg.route_kv_limit * cap:
            return j
        if cm.marginal_gain(j, j * c, c) < theta * cm.empty_gain(c):
            return j
        j += 1


@pytest.mark.parametrize("model", ["qwen3-30b-a3b-h20", "qwen-7b-h20", "qwen-14b-h20"])
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"theta": 0.05},
        {"route_max_concurrency": 12},
        {"route_kv_limit": 0.2},
        {"theta_slack": 0.1},
    ],
)
def test_router_load_is_the_share_of_what_the_router_places(model, extra):
    cfg = CoordinatorConfig(cost_model=CostModel.resolve(model), **extra)
    for cap, n, c in [(1_270_363, 30, 4000), (274_736, 20, 6000), (298_399, 5, 900)]:
        st = InstanceState("a", 0, cap)
        st.n_running, st.kv_used = n, n * c
        m = _placed_one_by_one(cfg, c, cap)
        assert m > 0
        assert router_load(st, cfg) == pytest.approx(n / m)
    st = InstanceState("a", 0, 1000)
    assert router_load(st, cfg) == 0.0  # nothing runs
    st.n_running, st.kv_used = 1, 5000  # one trajectory larger than the KV limit
    assert router_load(st, cfg) == math.inf


def test_a_loaded_instance_far_below_the_kv_threshold_keeps_its_version():
    """On a dense model θ stops routing long before the KV fills: the KV test alone lets an
    instance that is as loaded as the router makes it sync (and interrupt it all); the load
    test keeps it serving until it runs less than half of that."""
    cap = 1_270_363  # a Qwen2.5-7B instance on an H20

    def run(n, **cfg):
        coord, proto, _ = make(
            instances=[("a", 0)],
            start_version=1,
            cost_model=CostModel.resolve("qwen-7b-h20"),
            sync_kv_threshold=0.5,
            sync_require_starved=False,
            **cfg,
        )
        proto.reserve("gp", "p1", 1)  # work at the latest version
        loaded = snap("a", version=0, n=n, tokens_each=4000, cap=cap)
        assert loaded.kv_used_tokens / cap < 0.1
        return syncs(coord.step([loaded], [partial("p1", 1)], now=0.0))

    cfg = CoordinatorConfig(cost_model=CostModel.resolve("qwen-7b-h20"))
    full = _placed_one_by_one(cfg, 4000, cap)
    assert 20 < full < 60  # θ stops routing here; 286 such trajectories fit in the KV
    assert run(full) == {"a": 1}  # the paper's rule: KV usage is low, so it syncs
    assert run(full, sync_load_threshold=0.5) == {}
    assert run(full // 2 + 1, sync_load_threshold=0.5) == {}
    assert run(full // 2 - 1, sync_load_threshold=0.5) == {"a": 1}
    assert run(0, sync_load_threshold=0.01) == {"a": 1}  # idle: nothing to interrupt


def test_router_loaded_answers_the_threshold_test_without_the_search():
    cfg = CoordinatorConfig(cost_model=CostModel.resolve("qwen-7b-h20"))
    for cap, c in [(1_270_363, 4000), (274_736, 6000), (50_000, 900)]:
        for n in range(0, 90, 3):
            st = InstanceState("a", 0, cap)
            st.n_running, st.kv_used = n, n * c
            for share in (0.05, 0.3, 0.5, 0.77, 1.0):
                assert router_loaded(st, cfg, share) == (router_load(st, cfg) >= share), (n, share)
