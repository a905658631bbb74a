"""The VeRL-Async window: its admission budget (carry-over, whole groups of n' members), its
concurrency cap, and the FIFO it runs over; one rule per test on hand-built snapshots."""

from __future__ import annotations

from rollout_coordinator import (
    Coordinator,
    CoordinatorConfig,
    QueueView,
    SpeculativeState,
)
from rollout_coordinator.policies import CycleView, GateState
from rollout_coordinator.policies.admission import (
    admit_by_inflight_budget,
    admit_by_verl_window,
    batch_barrier,
)
from rollout_coordinator.testing import CAP, new, routes, snap
from staleness_protocol import UnboundedConfig, UnboundedFifo

# ---- the VeRL-Async window ------------------------------------------------------------------


def _view(*, latest, admitted, lost, held=0, eta=1, instances=2, redundancy=0, **cfg):
    state = SpeculativeState()
    for k in range(instances):
        inst = state.add_instance(f"i{k}", version=latest, kv_capacity_tokens=CAP)
        inst.n_running = held if k == 0 else 0
    return CycleView(
        now=0.0,
        instances=state.instances,
        queue=QueueView([]),
        latest_version=latest,
        abort_floor=-1,
        config=CoordinatorConfig(policy="verl-async", **cfg),
        batch_size=4,
        group_size=2,
        group_redundancy=redundancy,
        eta=eta,
        admitted_total=admitted,
        lost_total=lost,
    )


def test_verl_window_budget_counts_carry_over_and_whole_groups():
    # window (1 + η=1) x B=4 groups x n=2 = 16 trajectories; version 0, nothing admitted
    quota, state = admit_by_verl_window(_view(latest=0, admitted=0, lost=0), GateState())
    assert quota == 16 and state.window_version == 0
    quota, _ = admit_by_verl_window(_view(latest=0, admitted=11, lost=0), state)
    assert quota == 4  # 5 left, whole groups of 2
    # version 1 published: 8 consumed, 12 still in flight or queued -> 4 more this window
    quota, state = admit_by_verl_window(_view(latest=1, admitted=20, lost=0), state)
    assert quota == 4 and state.window_version == 1
    # losses after the window opened are not refunded until the next window
    quota, state = admit_by_verl_window(_view(latest=1, admitted=20, lost=6), state)
    assert quota == 4
    quota, state = admit_by_verl_window(_view(latest=2, admitted=20, lost=6), state)
    assert quota == 16 + 16 + 6 - 20
    # staleness_threshold is fractional, floored in groups: (1 + 0.5) x 4 = 6 groups
    quota, _ = admit_by_verl_window(
        _view(latest=0, admitted=0, lost=0, verl_staleness_threshold=0.5), GateState()
    )
    assert quota == 12


def test_the_gates_admit_whole_groups_of_n_prime_members():
    """With group redundancy a group starts n' = 3 members (n = 2 kept): the gates count
    them, or a window of B groups admits fewer than B whole groups and never fills a batch."""
    quota, state = admit_by_verl_window(
        _view(latest=0, admitted=0, lost=0, eta=0, redundancy=1), GateState()
    )
    assert quota == 4 * 3  # (1 + 0) x B=4 groups of 3
    # version 1: B x n = 8 consumed, B x (n' - n) = 4 surplus lost before the window opened
    quota, _ = admit_by_verl_window(
        _view(latest=1, admitted=12, lost=4, eta=0, redundancy=1), state
    )
    assert quota == 12
    quota, _ = admit_by_inflight_budget(
        _view(latest=1, admitted=15, lost=4, eta=0, redundancy=1), GateState()
    )
    assert quota == 12 + 8 - 11  # (eta + 1) x B x n' + 1 x B x n - (admitted - lost)
    quota, state = batch_barrier(0)(_view(latest=0, admitted=0, lost=0, redundancy=1), GateState())
    assert quota == 12 and state.remaining == 12


def test_verl_concurrency_cap():
    quota, _ = admit_by_verl_window(
        _view(latest=0, admitted=0, lost=0, held=5, verl_max_concurrent_groups_per_instance=2),
        GateState(),
    )
    assert quota == 2  # 2 groups x 2 x 2 instances = 8, 5 held -> 3, whole groups -> 2


def test_verl_async_runs_over_a_fifo_that_keeps_no_eta():
    fifo = UnboundedFifo(UnboundedConfig(batch_size=2, group_size=2, max_inflight_groups=8))
    coord = Coordinator(CoordinatorConfig(policy="verl-async", verl_staleness_threshold=1), fifo)
    coord.add_instance("a", kv_capacity_tokens=CAP)
    coord.add_instance("b", kv_capacity_tokens=CAP)
    q = [new(f"t{k}", group=f"g{k // 2}") for k in range(12)]
    cmds = coord.step([snap("a"), snap("b")], q, now=0.0)
    assert len(routes(cmds)) == 8  # (1 + s) x B = 4 groups of 2
    assert set(routes(cmds).values()) == {"a", "b"}  # even routing
