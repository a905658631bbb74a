"""Runs with redundancy train all their steps (liveness: nothing deadlocks).

Group redundancy (``n' = n + group_redundancy`` members started per group, the first ``n`` to
finish kept) under every policy: each one's admission counts whole groups of ``n'``. Before,
the baselines' gates counted ``n`` per group: ``sync``, ``one-step`` and ``verl-async`` at
``s = 0`` admitted fewer than a batch of whole groups and the run deadlocked. And a new group
settled before any member ran leaves the prompt feed's stock of fresh groups."""

from __future__ import annotations

import pytest

from staleflow_trainer.config import FIXED_ETA, POLICIES
from staleflow_trainer.control.checks import ledger_problems
from staleflow_trainer.sim import Simulation
from staleflow_trainer.sim.testing import sim_config


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_trains_its_steps_with_group_redundancy(policy: str) -> None:
    eta = FIXED_ETA.get(policy, 0)  # the tightest window: no slack to hide a short count
    cfg = sim_config(steps=3, batch_size=4, group_size=2, response_len_median=40, prompt_len=32,
                     max_response_len=96, kv_capacity_tokens=20_000, policy=policy, eta=eta,
                     total_gpus=4, rollout_gpus=2)  # fmt: skip
    cfg = cfg.evolve("protocol.group_redundancy=1", "protocol.stuck_threshold=0")
    sim = Simulation(cfg)
    sim.run()
    assert sim.core.steps_done == 3
    assert sim.core.counters["aborts"] > 0  # surplus members were started, then let go
    assert ledger_problems(sim.core) == []


def test_a_fresh_group_settled_before_it_ran_leaves_the_feeds_stock() -> None:
    """One group per batch, spare slots and members, long-tailed groups: a new group whose
    routes wait for a sync and are then aborted as stale is settled without ever running. It
    must leave the feed's stock of fresh groups (else the feed, counting it, never feeds
    another and the run stalls after a few steps)."""
    from pathlib import Path

    from staleflow_trainer.config import load_config

    example = Path(__file__).resolve().parents[3] / "examples" / "sim-tiny.yaml"
    cfg = load_config(example, [
        "protocol.batch_size=1", "protocol.eta=1", "protocol.batch_redundancy=2",
        "protocol.group_redundancy=1", "rollout.num_instances=2", "rollout.max_running=4",
        "sim.workload.response_len_median=200", "sim.workload.reward_mean=0",
        "sim.workload.group_correlation=0.9", "trainer.steps=6", "trainer.mini_batches=1",
    ])  # fmt: skip
    sim = Simulation(cfg)
    sim.run()
    assert sim.core.steps_done == 6 and sim.core.counters["aborts"] > 0
    assert ledger_problems(sim.core) == []
