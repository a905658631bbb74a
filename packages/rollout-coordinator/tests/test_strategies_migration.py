"""The strategy rules that move running work: migration between instances and preemption
(requests an engine preempted, aborted back to the queue), one rule per test on hand-built
snapshots."""

from __future__ import annotations

import pytest

from rollout_coordinator import (
    ConfigError,
    CoordinatorConfig,
    RunningEntry,
)
from rollout_coordinator.testing import CAP, interrupts, make, new, routes, snap, syncs

# ---- migration ------------------------------------------------------------------------------


def test_migration_moves_all_movable_requests():
    coord, _, _ = make(
        instances=[("idle", 0), ("busy", 0)], migration_amount="all", migration_min_speedup=None
    )
    cmds = coord.step([snap("idle"), snap("busy", n=12, tokens_each=3000)], [], now=0.0)
    (it,) = interrupts(cmds)
    assert (it.instance_id, it.reason, len(it.trajectory_ids)) == ("busy", "migration", 12)


def test_migration_only_for_a_predicted_speedup():
    """With ``migration_min_speedup`` the cost model must predict the moved trajectories a
    step that much faster on the starving instance: below the preset's knee (about 14
    running) a step takes as long whatever the load, so half of 12 stays; half of 60 moves
    (about 1.36x faster) unless more is asked; an instance at the KV limit gives work anyway.
    (The move-cost test is off here: the test below.)"""

    def moved(n, tokens_each=1000, idle_n=0, **cfg):
        cfg.setdefault("migration_move_cost_s", None)
        coord, _, _ = make(instances=[("idle", 0), ("busy", 0)], **cfg)
        busy = snap("busy", n=n, tokens_each=tokens_each)
        cmds = coord.step([snap("idle", n=idle_n, tokens_each=tokens_each), busy], [], now=0.0)
        return sum(len(i.trajectory_ids) for i in interrupts(cmds))

    assert moved(12, migration_min_speedup=None) == 6  # the paper's rule: no such test
    assert moved(60, migration_min_speedup=None) == 30
    assert moved(12) == 0  # the default: 1.1
    assert moved(12, migration_min_speedup=1.1) == 0
    assert moved(60, migration_min_speedup=1.1) == 30
    assert moved(60, migration_min_speedup=1.5) == 0
    # a loaded instance at the routing KV limit is about to preempt: its work moves anyway
    # (predicted 1.21x: the KV term; 1.5 is asked)
    assert moved(12, tokens_each=7_600, migration_min_speedup=1.5) == 6  # 91 % of the KV
    assert moved(12, tokens_each=7_500, migration_min_speedup=1.5) == 6  # 90 %: the limit
    assert moved(12, tokens_each=7_400, migration_min_speedup=1.5) == 0  # 89 %
    # the starving instance's own load counts: 100 loaded against 16 starving (50 % and 8 %
    # of the KV: ratio >= 5) balance at 42 moved, for a step 1.34x faster (1.54x if the
    # starving one's own 16 were left out), so 1.3 passes and 1.4 does not
    assert moved(100, tokens_each=500, idle_n=16, migration_min_speedup=1.3) == 42
    assert moved(100, tokens_each=500, idle_n=16, migration_min_speedup=1.4) == 0
    # judged at the balanced split whatever ``all`` moves: everything onto one instance is
    # never faster, balancing 60 is (about 1.36x)
    assert moved(60, migration_amount="all") == 60
    assert moved(12, migration_amount="all") == 0
    for bad in (0.9, float("inf"), True):
        with pytest.raises(ConfigError, match="migration_min_speedup"):
            CoordinatorConfig(migration_min_speedup=bad)


def test_migration_only_where_the_time_saved_pays_for_the_move():
    """``migration_move_cost_s``: the step saved on the moved trajectories (60 running, each
    1,000 tokens, against an idle instance: 22.5 ms -> 16.6 ms, 5.93 ms saved), times the tokens
    each is expected to generate still (as many as it has: ``generated``), must be at least
    the move's cost: 0.1 s needs 17 generated tokens, 0.2 s needs 34."""

    def moved(generated, **cfg):
        coord, _, _ = make(instances=[("idle", 0), ("busy", 0)], **cfg)
        running = tuple(
            RunningEntry(
                trajectory_id=f"busy-r{k}",
                prompt_tokens=1000 - generated,
                generated_tokens=generated,
            )
            for k in range(60)
        )
        cmds = coord.step([snap("idle"), snap("busy", running=running)], [], now=0.0)
        return sum(len(i.trajectory_ids) for i in interrupts(cmds))

    assert CoordinatorConfig().migration_move_cost_s == 0.1  # the default profile's
    assert moved(20) == 30  # 20 x 5.93 ms = 0.119 s >= 0.1 s
    assert moved(16) == 0  # 0.095 s: the move costs more than it saves
    assert moved(0) == 0  # just started: nothing to save yet
    assert moved(0, migration_move_cost_s=None) == 30  # the speedup test alone
    assert moved(0, migration_move_cost_s=0.0) == 30
    assert moved(20, migration_move_cost_s=0.2) == 0
    assert moved(40, migration_move_cost_s=0.2) == 30  # 0.237 s
    # only with the speedup test: the paper's rule has neither
    assert moved(0, migration_min_speedup=None) == 30
    # a loaded instance at the routing KV limit is about to preempt: it gives work anyway
    assert moved(0, route_kv_limit=0.5) == 30
    assert CoordinatorConfig.from_profile("paper").migration_move_cost_s is None
    for bad in (-0.1, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ConfigError, match="migration_move_cost_s"):
            CoordinatorConfig(migration_move_cost_s=bad)


def test_migration_by_throughput_with_min_running():
    coord, _, _ = make(
        instances=[("slow", 0), ("busy", 0)],
        migration_indicator="throughput",
        migration_min_running=8,
        migration_min_speedup=None,
    )
    cmds = coord.step([snap("slow", tput=100.0), snap("busy", n=7, tput=900.0)], [], now=0.0)
    assert interrupts(cmds) == []  # 7 < 8 running
    coord, _, _ = make(
        instances=[("slow", 0), ("busy", 0)],
        migration_indicator="throughput",
        migration_min_running=8,
        migration_min_speedup=None,
    )
    cmds = coord.step([snap("slow", tput=100.0), snap("busy", n=8, tput=600.0)], [], now=0.0)
    assert [i.instance_id for i in interrupts(cmds)] == ["busy"]
    coord, _, _ = make(instances=[("slow", 0), ("busy", 0)], migration_indicator="throughput")
    cmds = coord.step([snap("slow", tput=200.0), snap("busy", n=8, tput=900.0)], [], now=0.0)
    assert interrupts(cmds) == []  # 4.5x < 5x


def test_no_migration_while_a_sync_is_issued_or_in_flight():
    def run(during_sync):
        coord, _, _ = make(
            instances=[("idle", 0), ("busy", 1), ("stale", 0)],
            start_version=1,
            migration_during_sync=during_sync,
            migration_min_speedup=None,
        )
        return coord.step(
            [snap("idle", version=1), snap("busy", version=1, n=12), snap("stale")], [], now=0.0
        )

    cmds = run(True)
    assert syncs(cmds) and [i.reason for i in interrupts(cmds)] == ["migration"]
    cmds = run(False)
    assert syncs(cmds) and interrupts(cmds) == []


# ---- preemption -----------------------------------------------------------------------------


def _entries(ids, tokens=CAP // 6):
    return tuple(
        RunningEntry(trajectory_id=t, prompt_tokens=tokens, generated_tokens=0) for t in ids
    )


def test_preempted_requests_beyond_the_allowed_queue_are_aborted_back():
    coord, _, clock = make(
        instances=[("a", 0)], batch=8, group=2, theta=0.01, preemption_rule="abort"
    )
    q = [new(f"t{k}", group=f"g{k // 2}") for k in range(10)]
    cmds = coord.step([snap("a")], q, now=0.0)
    assert len(routes(cmds)) == 10
    # the engine runs t0..t9 a while, then preempts t0..t3 (KV full): 4 waiting
    ran = _entries((f"t{k}" for k in range(10)), CAP // 10)
    coord.step([snap("a", running=ran, t=0.5)], [], now=0.5)
    running = _entries(f"t{k}" for k in range(4, 10))
    clock.t = 1.0
    cmds = coord.step([snap("a", running=running, waiting=4, t=1.0)], [], now=1.0)
    (it,) = interrupts(cmds)
    assert (it.reason, it.requeue) == ("bounce", True)
    assert it.trajectory_ids == ("t0",)  # 4 waiting, 3 allowed: the oldest route goes back
    assert coord.instances["a"].waiting == 3
    # not issued twice before the next snapshot
    assert interrupts(coord.step([], [], now=1.5)) == []
    # the default bounce rule acts on running work instead, and only with nearly full KV
    coord, _, _ = make(instances=[("a", 0)], bounce_waiting_threshold=4)
    assert interrupts(coord.step([snap("a", n=2, waiting=4)], [], now=0.0)) == []


def test_abort_rule_leaves_work_queued_behind_a_full_engine_alone():
    """Vanilla routing hands work to an engine whatever its load; what it routes to a full
    engine waits there as intended, and aborting it would only send it back to the same full
    engines cycle after cycle (a route/abort ping-pong). Preempted work still goes back."""
    coord, _, clock = make(
        "vanilla-routing",
        instances=[("a", 0), ("b", 0)],
        batch=8,
        group=2,
        preemption_rule="abort",
    )
    full = {i: _entries([f"{i}-r{k}" for k in range(4)], CAP // 4) for i in ("a", "b")}
    q = [new(f"t{k}", group=f"g{k // 2}") for k in range(8)]
    sent = routes(coord.step([snap(i, running=full[i]) for i in full], q, now=0.0))
    assert len(sent) == 8
    on = {i: [t for t, j in sent.items() if j == i] for i in full}
    # each engine is still full and queues the 4 it got: nothing was preempted
    clock.t = 1.0
    snaps = [snap(i, running=full[i], waiting=4, t=1.0) for i in full]
    assert interrupts(coord.step(snaps, [], now=1.0)) == []
    assert coord.instances["a"].waiting == 4
    # one finished: the engine admits the first queued one, then preempts it (KV full again)
    clock.t = 2.0
    snaps = [snap(i, running=(*full[i][1:], *_entries(on[i][:1])), waiting=3, t=2.0) for i in full]
    assert interrupts(coord.step(snaps, [], now=2.0)) == []
    clock.t = 3.0
    snaps = [snap(i, running=full[i][1:], waiting=4, t=3.0) for i in full]
    cmds = coord.step(snaps, [], now=3.0)
    assert sorted(it.trajectory_ids for it in interrupts(cmds)) == [(on["a"][0],), (on["b"][0],)]


def test_abort_rule_keeps_work_waiting_for_its_prefill_and_returns_what_no_longer_fits():
    """Routed into room and never shown running: while the instance has room for it — half
    the router's KV limit less what the instance holds (its running work will about double
    that) — it waits for its turn to prefill (the engine prefills under a token budget a step)
    and stays; once the instance has filled, the ones past that room, in route order, go back.
    The record survives a save and restore; a state written before it kept the routed-into-room
    ones counts them as preempted."""
    from rollout_coordinator._state import coordinator_from_dict, coordinator_to_dict

    coord, proto, clock = make(
        instances=[("a", 0)], batch=8, group=2, theta=0.01, preemption_rule="abort"
    )
    q = [new(f"t{k}", group=f"g{k // 2}") for k in range(10)]
    assert len(routes(coord.step([snap("a")], q, now=0.0))) == 10
    clock.t = 1.0  # two prefilled and running (33K of KV), eight waiting their turn (4K)
    cmds = coord.step([snap("a", running=_entries(["t0", "t1"]), waiting=8, t=1.0)], [], now=1.0)
    assert interrupts(cmds) == []
    state = coordinator_to_dict(coord)
    assert state["routed_into_room"] == {"a": [[f"t{k}", 500] for k in range(2, 10)]}
    twin = coordinator_from_dict(state, coord.config, proto, clock)
    # the two running ones grew to 42K of KV: room for six of 500 tokens under 0.9 / 2
    clock.t = 2.0
    grown = _entries(["t0", "t1"], 21_000)
    for c in (coord, twin):
        (it,) = interrupts(c.step([snap("a", running=grown, waiting=8, t=2.0)], [], now=2.0))
        assert it.trajectory_ids == ("t8", "t9")
    old = dict(state, meant_to_run={"a": [f"t{k}" for k in range(2, 10)]})
    del old["routed_into_room"]
    clock.t = 1.5
    before = coordinator_from_dict(old, coord.config, proto, clock)
    snaps = [snap("a", running=_entries(["t0", "t1"]), waiting=8, t=1.5)]
    (it,) = interrupts(before.step(snaps, [], now=1.5))
    assert it.trajectory_ids == ("t2", "t3", "t4", "t5", "t6")  # 8 waiting, 3 allowed


def test_preemption_rule_off():
    coord, _, _ = make(instances=[("a", 0)], preemption_rule="off", bounce_waiting_threshold=1)
    full = snap("a", n=10, tokens_each=CAP // 10, waiting=9)
    assert interrupts(coord.step([full], [], now=0.0)) == []
