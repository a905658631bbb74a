"""Rules for work the trainer's next batch waits for (*due* work): where a due partial is
placed (``due_placement``), and moving due work off loaded instances (``due_spread_ratio``)."""

from __future__ import annotations

from rollout_coordinator import RunningEntry
from rollout_coordinator.testing import interrupts, make, partial, routes, snap


def _due_two(**cfg):
    """Two instances and a queued partial (2K tokens) whose group is reserved in the buffer
    the trainer takes next."""
    coord, proto, _ = make(instances=[("a", 0), ("b", 0)], eta=1, theta=0.3, **cfg)
    for k in range(4):  # buffer 1 fills with reservations first (the latest free one)
        assert proto.reserve(f"f{k}", f"f{k}/0", 0) == 1
    assert proto.reserve("gd", "D0", 0) == proto.next_buffer == 0
    return coord, partial("D0", 0, group="gd", length=1000, gen=1000)


def test_due_work_goes_to_the_instance_with_the_most_kv_headroom():
    """``a`` runs 2 trajectories of 30K tokens (60 % of its KV), ``b`` 30 of 1K (30 %): the
    marginal gain prefers ``a`` (below the batch term's knee another trajectory costs it
    little), ``headroom`` the less full ``b``; and it does so with or without ``due_first``."""
    snaps = [snap("a", n=2, tokens_each=30_000), snap("b", n=30, tokens_each=1000)]
    coord, due = _due_two()
    assert routes(coord.step(snaps, [due], now=0.0)) == {"D0": "a"}
    for due_first in (False, True):
        coord, due = _due_two(due_placement="headroom", due_first=due_first)
        assert routes(coord.step(snaps, [due], now=0.0)) == {"D0": "b"}


def test_headroom_places_only_due_work_and_only_where_it_fits():
    snaps = [snap("a", n=2, tokens_each=30_000), snap("b", n=30, tokens_each=1000)]
    coord, _ = _due_two(due_placement="headroom")
    # a partial of a group reserved in a later buffer is not due: it goes by gain
    later = partial("f0/0", 0, group="f0", length=1000, gen=1000)
    assert routes(coord.step(snaps, [later], now=0.0)) == {"f0/0": "a"}
    # no instance with KV room: no route, due or not
    coord, due = _due_two(due_placement="headroom", route_kv_limit=0.5)
    full = [snap("a", n=2, tokens_each=30_000), snap("b", n=2, tokens_each=30_000)]
    assert routes(coord.step(full, [due], now=0.0)) == {}


def _running(iid, *entries, version=0):
    return snap(
        iid,
        version=version,
        running=tuple(
            RunningEntry(trajectory_id=t, prompt_tokens=p, generated_tokens=g, v_traj=v)
            for t, p, g, v in entries
        ),
    )


def _spread(**cfg):
    # the starving–loaded rule off (it would move work to the empty instance too)
    # version 1 published: the trainer takes buffer 1 next, so V_traj 0 is its last chance
    coord, proto, _ = make(
        instances=[("loaded", 1), ("light", 1)],
        eta=1,
        start_version=1,
        migration_min_running=64,
        **cfg,
    )
    return coord, proto


def test_due_work_spreads_to_a_light_instance():
    """``loaded`` runs 13 trajectories, among them ``d`` (V_traj 0 = the abort floor + 1: the
    next batch waits for it; 20K tokens); ``light`` runs none. With ``due_spread_ratio`` the
    longest due trajectory comes back to be re-routed (one, for one light instance), and
    nothing else moves; without it the rule does nothing."""
    # ``z`` is longer still, but V_traj 1: a later batch can take it, so it stays
    entries = [("d", 500, 20_000, 0), ("d2", 500, 100, 0), ("z", 500, 30_000, 1)] + [
        (f"x{k}", 500, 3_000, 0) for k in range(10)
    ]
    snaps = [_running("loaded", *entries, version=1), snap("light", version=1)]
    coord, _ = _spread()
    assert [i for i in interrupts(coord.step(snaps, [], now=0.0)) if i.reason == "migration"] == []
    coord, proto = _spread(due_spread_ratio=1.3)
    assert proto.abort_floor + 1 == 0
    (it,) = [i for i in interrupts(coord.step(snaps, [], now=0.0)) if i.reason == "migration"]
    assert (it.instance_id, it.trajectory_ids, it.requeue) == ("loaded", ("d",), True)


def test_the_longest_due_trajectory_moves_wherever_it_runs():
    """The one that moves is the longest due trajectory (equal lengths: the larger id), not the
    first due one the instance lists, nor a longer one that is not due (``z``)."""
    entries = [("d2", 500, 100, 0), ("z", 500, 30_000, 1), ("c", 500, 20_000, 0)]
    entries += [("d", 500, 20_000, 0)] + [(f"x{k}", 500, 1_000, 0) for k in range(8)]
    snaps = [_running("loaded", *entries, version=1), snap("light", version=1)]
    coord, _ = _spread(due_spread_ratio=1.3)
    (it,) = [i for i in interrupts(coord.step(snaps, [], now=0.0)) if i.reason == "migration"]
    assert it.trajectory_ids == ("d",)


def test_due_spreading_needs_a_light_instance_and_a_slow_enough_step():
    entries = [(f"x{k}", 500, 6_000, 0) for k in range(12)]
    # the light instance runs 3 (> due_spread_max_running 2): nobody to take the work
    busy_light = _running("light", *[(f"y{k}", 500, 100, 0) for k in range(3)], version=1)
    coord, _ = _spread(due_spread_ratio=1.3)
    cmds = coord.step([_running("loaded", *entries, version=1), busy_light], [], now=0.0)
    assert [i for i in interrupts(cmds) if i.reason == "migration"] == []
    # a ratio the step does not reach: nothing moves
    coord, _ = _spread(due_spread_ratio=50.0)
    cmds = coord.step(
        [_running("loaded", *entries, version=1), snap("light", version=1)], [], now=0.0
    )
    assert [i for i in interrupts(cmds) if i.reason == "migration"] == []


def test_due_work_spreads_only_where_the_router_can_send_it():
    """The router tries a partial's versions oldest first: a light instance newer than the
    loaded one would not get the trajectory, which would come straight back to ``loaded`` (now
    the first instance with room at its version), re-prefill there and be moved again, every
    cycle. So with only such a light instance nothing moves; with the router placing partials
    by gain over every version (``partial_order="gain"``), with the even router (the least
    loaded instance of any version that can serve it), or with both at one version, it does."""
    entries = [("d", 500, 20_000, 0)] + [(f"x{k}", 500, 6_000, 0) for k in range(12)]

    def moved(loaded_version, light_version, policy="staleflow", **cfg):
        coord, _, _ = make(
            policy,
            instances=[("loaded", loaded_version), ("light", light_version)],
            eta=1,
            start_version=1,
            migration_min_running=64,
            due_spread_ratio=1.3,
            **cfg,
        )
        snaps = [
            _running("loaded", *entries, version=loaded_version),
            snap("light", version=light_version),
        ]
        cmds = coord.step(snaps, [], now=0.0)
        return [i.trajectory_ids for i in interrupts(cmds) if i.reason == "migration"]

    assert moved(0, 1) == []  # only a newer light instance: it would come back
    assert moved(0, 1, partial_order="gain") == [("d",)]
    assert moved(0, 1, "vanilla-routing") == [("d",)]
    assert moved(1, 1) == [("d",)]


def test_the_ratio_test_is_against_the_due_trajectory_alone():
    """The loaded instance's step against ``due_spread_ratio`` × the step of its longest due
    trajectory alone: just above it the trajectory moves, just below it nothing does. Both
    ratios are far above the step ÷ that of a trajectory of the instance's whole KV alone, so
    a rule judged by anything longer than the trajectory itself would move nothing."""
    entries = [("d", 500, 2_000, 0)] + [(f"x{k}", 500, 6_000, 1) for k in range(12)]
    loaded = _running("loaded", *entries, version=1)
    coord, _ = _spread()
    cm = coord.config.cost_model
    step = cm.step_latency(13, loaded.kv_used_tokens)
    exact = step / cm.step_latency(1, 2_500)
    assert exact > 1.0 and exact > 1.2 * step / cm.step_latency(1, loaded.kv_used_tokens)

    def moved(ratio: float) -> list[tuple[str, ...]]:
        coord, _ = _spread(due_spread_ratio=ratio)
        cmds = coord.step([loaded, snap("light", version=1)], [], now=0.0)
        return [i.trajectory_ids for i in interrupts(cmds) if i.reason == "migration"]

    assert moved(exact * (1 - 1e-9)) == [("d",)]
    assert moved(exact * (1 + 1e-9)) == []
