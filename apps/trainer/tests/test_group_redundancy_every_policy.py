"""Group redundancy (``n' = n + group_redundancy`` members started per group, the first ``n``
to finish kept) under every policy: each one's admission counts whole groups of ``n'``, so
every run trains its steps. Before, the baselines' gates counted ``n`` per group: ``sync``,
``one-step`` and ``verl-async`` at ``s = 0`` admitted fewer than a batch of whole groups and
the run deadlocked."""

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
