"""The configurable strategy rules and their profiles: the profiles' values, routing and
synchronization, one rule per test on hand-built snapshots. Migration and preemption are in
``test_strategies_migration.py``, the VeRL-Async window in ``test_verl_window.py``."""

from __future__ import annotations

import pytest

from rollout_coordinator import (
    PROFILES,
    ConfigError,
    CoordinatorConfig,
    QueueView,
    RunningEntry,
)
from rollout_coordinator.testing import CAP, make, new, partial, routes, snap, syncs

# ---- profiles -------------------------------------------------------------------------------


def test_paper_profile_holds_the_published_runs_values():
    cfg = CoordinatorConfig.from_profile("paper")
    assert (cfg.theta, cfg.route_max_concurrency, cfg.route_kv_limit) == (0.3, 128, 1.0)
    assert (cfg.sync_kv_threshold, cfg.sync_require_starved) == (0.5, False)
    assert (cfg.migration_indicator, cfg.migration_ratio, cfg.migration_min_running) == (
        "throughput",
        5.0,
        8,
    )
    assert (cfg.migration_amount, cfg.migration_during_sync) == ("all", False)
    assert (cfg.preemption_rule, cfg.preempt_abort_waiting) == ("abort", 3)
    assert cfg.candidate_order == "reserve"
    assert CoordinatorConfig.from_profile("default") == CoordinatorConfig()
    robust = CoordinatorConfig.from_profile("robust")
    assert (robust.sync_lag_fraction, robust.partial_order) == (0.5, "gain")
    assert robust.due_first and not cfg.due_first and not CoordinatorConfig().due_first
    # the speedup test is a rule beyond the paper: on by default, off in both paper profiles
    assert CoordinatorConfig().migration_min_speedup == 1.1
    assert cfg.migration_min_speedup is None and robust.migration_min_speedup is None
    assert set(PROFILES) == {"default", "paper", "robust"}


def test_profile_in_a_mapping_and_overrides():
    cfg = CoordinatorConfig.from_dict({"profile": "paper", "theta": 0.2, "policy": "all-vanilla"})
    assert (cfg.theta, cfg.policy, cfg.route_max_concurrency) == (0.2, "all-vanilla", 128)
    assert CoordinatorConfig.from_profile("paper", sync_kv_threshold=0.7).sync_kv_threshold == 0.7
    with pytest.raises(ConfigError) as ei:
        CoordinatorConfig.from_dict({"profile": "fastest"})
    assert ei.value.field == "profile"
    with pytest.raises(ConfigError) as ei:
        CoordinatorConfig.from_profile("fastest")
    assert ei.value.field == "profile"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("route_max_concurrency", 0),
        ("theta_slack", 0.0),
        ("theta_slack", 1.5),
        ("candidate_order", "newest"),
        ("partial_order", "random"),
        ("sync_require_starved", "yes"),
        ("due_first", "yes"),
        ("sync_max_lag", 0),
        ("sync_lag_fraction", 0.0),
        ("sync_lag_fraction", 1.5),
        ("migration_amount", "most"),
        ("migration_during_sync", 1),
        ("preemption_rule", "drop"),
        ("preempt_abort_waiting", 0),
        ("verl_staleness_threshold", -0.5),
        ("verl_max_concurrent_groups_per_instance", 0),
    ],
)
def test_new_fields_out_of_range_name_the_field(field, value):
    with pytest.raises(ConfigError) as ei:
        CoordinatorConfig(**{field: value})
    assert ei.value.field == field


# ---- routing --------------------------------------------------------------------------------


def _others(n, tokens=1000):
    return tuple(
        RunningEntry(trajectory_id=f"x{k}", prompt_tokens=tokens, generated_tokens=0)
        for k in range(n)
    )


@pytest.mark.parametrize(
    ("held_v_traj", "batches", "takes"),
    [(None, 1, False), (2, 1, False), (3, 1, True), (3, 2, False), (None, 2, False)],
)
def test_theta_slack_applies_only_where_all_routed_work_has_slack(held_v_traj, batches, takes):
    """θ 0.9 refuses a 22nd trajectory; θ_slack 0.05 takes it on an instance whose routed work
    all has slack: with ``theta_slack_batches`` 1, V_traj 3 > abort floor + 1 = 2. One holding
    work that only the batch the trainer needs next can take (V_traj 2), or holding no routed
    work, keeps θ. With 2 (the default), V_traj 3 is work the next two batches need (3 ≤ 1 +
    2): its instance keeps θ too."""
    coord, proto, clock = make(
        instances=[("a", 3)],
        start_version=3,
        eta=1,
        theta=0.9,
        theta_slack=0.05,
        theta_slack_batches=batches,
    )
    assert proto.abort_floor == 1
    running = _others(20)
    if held_v_traj is not None:
        proto.reserve("gp", "p0", held_v_traj)
        assert routes(
            coord.step([snap("a", version=3)], [partial("p0", held_v_traj)], now=0.0)
        ) == {"p0": "a"}
    running += (RunningEntry(trajectory_id="p0", prompt_tokens=500, generated_tokens=100),)
    clock.t = 1.0
    cmds = coord.step([snap("a", version=3, running=running, t=1.0)], [new("t0")], now=1.0)
    assert routes(cmds) == ({"t0": "a"} if takes else {})
    # without theta_slack, theta everywhere
    coord, _, _ = make(instances=[("a", 3)], start_version=3, eta=1, theta=0.9)
    assert routes(coord.step([snap("a", version=3, running=_others(20))], [new("t0")])) == {}


def _loaded(iid="a"):
    # 20 running, 40K of the 100K KV tokens: a 500-token trajectory passes θ 0.3, one with a
    # 30.5K-token context has a negative marginal gain (its context slows every step)
    return snap(iid, n=20, tokens_each=2000)


@pytest.mark.parametrize("due_first", [False, True])
def test_a_long_partial_refused_by_theta_leaves_shorter_work_routable(due_first):
    """The paper's rule drops an instance θ refuses from the whole cycle, so one long partial
    at the head of the queue blocks everything behind it. With ``due_first`` the instance
    stays a candidate for shorter trajectories."""
    coord, proto, _ = make(instances=[("a", 0)], eta=2, theta=0.3, due_first=due_first)
    assert proto.reserve("gl", "L0", 0) == 2  # not the buffer the trainer takes next
    queue = [partial("L0", 0, group="gl", gen=30_000), new("t0")]
    cmds = coord.step([_loaded()], queue, now=0.0)
    assert routes(cmds) == ({"t0": "a"} if due_first else {})


def test_theta_refusals_under_due_first_are_bounded_per_cycle(monkeypatch):
    """Lengths that go up and down do not make a cycle cost one pass over the instances per
    trajectory: an instance θ refused 4 times leaves for the cycle. Partials of one version,
    as many generated tokens each (the queue's order among them is free), alternate a long
    prompt, which θ 0.1 refuses, and a short one, which it accepts but for which the instance
    lacks KV room (a skip, not a refusal): 3 returns, then it stays out. A last one would fit
    (so the router cannot tell at once that nothing fits), but by then the instance is out."""
    from rollout_coordinator.policies import routing_gain

    coord, proto, _ = make(instances=[("a", 0)], batch=16, eta=2, theta=0.1, due_first=True)
    queue = []
    for k in range(10):
        for tid, prompt in ((f"L{k}", 30_000), (f"S{k}", 5_500)):
            assert proto.reserve(f"g{tid}", tid, 0) != proto.next_buffer  # none is due
            queue.append(partial(tid, 0, group=f"g{tid}", length=prompt, gen=500))
    assert proto.reserve("gT", "T", 0) != proto.next_buffer
    queue.append(partial("T", 0, group="gT", length=100, gen=500))
    assert list(QueueView.from_unordered(queue).items) == queue  # already in queue order
    returns = []
    real = routing_gain._Group.insert
    monkeypatch.setattr(
        routing_gain._Group, "insert", lambda g, *a: (returns.append(a[1]), real(g, *a))
    )
    cmds = coord.step([snap("a", n=20, tokens_each=4250)], queue, now=0.0)  # 85 % of the KV
    assert routes(cmds) == {} and len(returns) == 3


def _due_partial(due_first):
    """A coordinator with one instance, and a queued 30.5K-token partial whose group is
    reserved in the buffer the trainer takes next."""
    coord, proto, _ = make(instances=[("a", 0)], eta=1, theta=0.3, due_first=due_first)
    for k in range(4):  # buffer 1 fills with reservations first (the latest free one)
        assert proto.reserve(f"f{k}", f"f{k}/0", 0) == 1
    assert proto.reserve("gd", "D0", 0) == proto.next_buffer == 0
    return coord, partial("D0", 0, group="gd", gen=30_000)


@pytest.mark.parametrize("due_first", [False, True])
def test_due_work_skips_theta(due_first):
    """A partial whose group is reserved in the buffer the trainer takes next goes to an
    instance with KV room under ``due_first`` although θ would refuse it there."""
    coord, due = _due_partial(due_first)
    assert routes(coord.step([_loaded()], [due], now=0.0)) == ({"D0": "a"} if due_first else {})
    # no KV room is no KV room, due or not
    coord, due = _due_partial(True)
    full = snap("a", n=20, tokens_each=4000)  # 80K: + 30.5K is over 90 %
    assert routes(coord.step([full], [due])) == {}


def test_router_concurrency_cap():
    q = [new("t0")]
    coord, _, _ = make(instances=[("a", 0)], theta=0.01, route_max_concurrency=8)
    assert routes(coord.step([snap("a", n=8, tokens_each=10)], q, now=0.0)) == {}
    coord, _, _ = make(instances=[("a", 0)], theta=0.01, route_max_concurrency=9)
    assert routes(coord.step([snap("a", n=8, tokens_each=10)], q, now=0.0)) == {"t0": "a"}


def test_kv_limit_one_fills_the_cache():
    coord, _, _ = make(instances=[("a", 0)], theta=0.01, route_kv_limit=1.0)
    cmds = coord.step([snap("a", n=1, tokens_each=CAP - 600)], [new("t0", length=500)], now=0.0)
    assert routes(cmds) == {"t0": "a"}


@pytest.mark.parametrize(("order", "expected"), [("oldest", "old"), ("reserve", "fresh")])
def test_candidate_order_for_new_groups(order, expected):
    coord, _, _ = make(
        instances=[("old", 0), ("fresh", 1)], start_version=1, eta=3, candidate_order=order
    )
    cmds = coord.step([snap("old"), snap("fresh", version=1)], [new("t0")], now=0.0)
    assert routes(cmds) == {"t0": expected}


@pytest.mark.parametrize(("order", "expected"), [("version", "old"), ("gain", "fresh")])
def test_partial_order(order, expected):
    coord, proto, _ = make(
        instances=[("old", 0), ("fresh", 1)], start_version=1, eta=3, partial_order=order
    )
    proto.reserve("gp", "p0", 0)
    # old is busy but still above θ; fresh is empty: only "gain" looks past the version
    cmds = coord.step(
        [snap("old", n=20, tokens_each=200), snap("fresh", version=1)],
        [partial("p0", 0)],
        now=0.0,
    )
    assert routes(cmds) == {"p0": expected}


def test_partial_by_gain_never_goes_below_its_version_nor_when_aborted():
    coord, proto, _ = make(
        instances=[("v0", 0), ("v1", 1), ("v2", 2)], start_version=2, eta=3, partial_order="gain"
    )
    proto.reserve("gp", "p1", 1)
    cmds = coord.step(
        [snap("v0", n=40), snap("v1", version=1, n=30), snap("v2", version=2, n=10)],
        [partial("p1", 1), partial("ghost", 1)],  # ghost: unknown to the protocol
        now=0.0,
    )
    assert syncs(cmds) == {}  # v0 is busy, and the only version that cannot serve p1
    assert routes(cmds) == {"p1": "v2"}


# ---- synchronization ------------------------------------------------------------------------


def test_lag_bound_forces_a_busy_instance_with_work_to_sync():
    def run(**cfg):
        coord, _, _ = make(instances=[("a", 0)], start_version=2, eta=4, **cfg)
        busy = snap("a", n=60, tokens_each=1000)  # 60 % KV, admissible new work at v0
        return syncs(coord.step([busy], [new("t0")], now=0.0))

    assert run() == {}
    assert run(sync_max_lag=3) == {}  # lags by 2 < 3
    assert run(sync_max_lag=2) == {"a": 2}
    assert run(sync_max_lag=1) == {"a": 2}  # = greedy global sync


@pytest.mark.parametrize(
    ("eta", "fraction", "lag", "syncs_now"),
    [(8, 0.5, 3, False), (8, 0.5, 4, True), (3, 0.5, 2, True), (1, 0.5, 1, True)],
)
def test_lag_bound_relative_to_eta(eta, fraction, lag, syncs_now):
    coord, _, _ = make(instances=[("a", 0)], start_version=lag, eta=eta, sync_lag_fraction=fraction)
    busy = snap("a", n=60, tokens_each=1000)
    assert bool(syncs(coord.step([busy], [new("t0")], now=0.0))) is syncs_now
    # with both bounds, the tighter applies
    coord, _, _ = make(
        instances=[("a", 0)], start_version=2, eta=8, sync_lag_fraction=0.5, sync_max_lag=2
    )
    assert syncs(coord.step([busy], [new("t0")], now=0.0)) == {"a": 2}


def test_without_require_starved_a_light_instance_syncs_despite_work_at_its_version():
    def run(**cfg):
        coord, _, _ = make(instances=[("a", 0)], start_version=1, sync_kv_threshold=0.5, **cfg)
        light = snap("a", n=4, tokens_each=10_000)  # 40 % KV, admissible new work at v0
        return syncs(coord.step([light], [new("t0")], now=0.0))

    assert run() == {}
    assert run(sync_require_starved=False) == {"a": 1}
    # a waiting queue still blocks it (syncing would interrupt queued work)
    coord, _, _ = make(instances=[("a", 0)], start_version=1, sync_require_starved=False)
    assert syncs(coord.step([snap("a", waiting=1)], [new("t0")], now=0.0)) == {}


def test_lag_bound_spreads_versions_no_herd_at_the_floor():
    """Every instance riding version 0 until the floor makes them all pull at once; with the
    lag bound they pull as they fall behind, before the floor."""
    coord, proto, _ = make(
        instances=[(f"i{k}", 0) for k in range(4)], start_version=3, eta=8, sync_max_lag=3
    )
    assert proto.abort_floor < 0  # far from the floor
    busy = [snap(f"i{k}", n=50, tokens_each=1000) for k in range(4)]
    assert syncs(coord.step(busy, [new("t0")], now=0.0)) == {f"i{k}": 3 for k in range(4)}
