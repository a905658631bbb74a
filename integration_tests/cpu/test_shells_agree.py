"""The simulator and the Ray deployment are two shells over one control core: driven through
the same scenario they apply the same rules.

One config runs through both shells — the Ray deployment (sim engines in real time, the real
trajectory server, param server, reward workers and PyTorch trainer) and the simulator (virtual
time): a baseline policy (``all-vanilla``) with group redundancy, dynamic sampling on, rewards
that make some groups all-equal, and a stuck-buffer rule. For each rule where two separate
control loops once disagreed, both shells must show the same outcome:

1. filtering: groups whose kept rewards are all equal are dropped before they take a buffer
   slot, so every consumed batch is full of trainable groups and each filtered group was
   dropped with the filtering reason;
2. replacement prompts: each group filtering removed asks for a replacement prompt, and every
   replacement asked for was fed (none discarded);
3. redundancy applies to every policy, baselines included: surplus members were dropped;
4. the stuck-buffer wait and every other decision setting come from one place: both shells'
   cores run on exactly the config built from the app config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from tiny_setup import tiny_config

pytestmark = [pytest.mark.ray, pytest.mark.sim, pytest.mark.timeout(900)]

B, N, ETA, STEPS = 4, 4, 1, 4
SCENARIO = (
    f"trainer.steps={STEPS}",
    f"protocol.batch_size={B}",
    f"protocol.group_size={N}",
    f"protocol.eta={ETA}",
    "protocol.group_redundancy=1",
    "protocol.stuck_threshold=1",
    "protocol.stuck_after_s=0.5",
    "coordinator.policy=all-vanilla",
    "trainer.dynamic_sampling=true",
    "reward.fn=staleflow_trainer.reward.testing:coin",
    "sim.workload.reward_mean=0.5",
    "rollout.sampling.max_new_tokens=6",
    "sim.workload.response_len_median=4",
    "sim.workload.prompt_len=8",
    "run.checkpoint_every=0",
    "run.resume=never",
)


@pytest.fixture(scope="module")
def shells(
    ray_session: None,
    tmp_path_factory: pytest.TempPathFactory,
    engine_required: Callable[[str], None],
) -> dict[str, dict[str, Any]]:
    engine_required("sim")
    import ray

    from staleflow_trainer.control.config import core_config
    from staleflow_trainer.runtime.wiring import Deployment
    from staleflow_trainer.sim import Simulation

    cfg = tiny_config(tmp_path_factory.mktemp("shells"), *SCENARIO, backend="sim")
    out: dict[str, dict[str, Any]] = {}
    sim = Simulation(cfg)
    sim.run()
    st = sim.core.protocol.stats()
    out["sim"] = {
        "counters": dict(sim.core.counters),
        "stats": {
            "aborts_by_reason": dict(st.aborts_by_reason),
            "replacements_requested": st.replacements_requested,
            "consumed_batches": st.consumed_batches,
        },
        "core_config": repr(sim.core.config),
        "ledger": {
            **sim.core.ledger.counts(),
            "dropped_reasons": dict(sim.core.ledger.dropped_reasons),
        },
        "expected_config": repr(core_config(cfg, rows=None)),
    }
    dep = Deployment(cfg).start()
    try:
        summary = dep.run()
        out["ray"] = {
            "counters": summary["counters"],
            "stats": ray.get(dep.coordinator.protocol_stats.remote()),
            "core_config": ray.get(dep.coordinator.core_config.remote()),
            "ledger": dep.ledger(),
            "expected_config": repr(core_config(cfg, rows=ray.get(dep.coordinator.rows.remote()))),
        }
    finally:
        dep.close()
    return out


@pytest.mark.parametrize("shell", ["ray", "sim"])
def test_rule1_filtering_drops_equal_reward_groups_before_they_take_a_slot(
    shells: dict[str, dict[str, Any]], shell: str
) -> None:
    s = shells[shell]
    assert s["counters"]["filtered"] > 0, s["counters"]
    assert s["stats"]["consumed_batches"] == STEPS
    assert s["ledger"]["consumed"] == STEPS * B * N  # every batch full of trainable groups
    assert s["ledger"]["dropped_reasons"].get("filtered: equal rewards", 0) > 0


@pytest.mark.parametrize("shell", ["ray", "sim"])
def test_rule2_every_replacement_prompt_asked_for_is_fed(
    shells: dict[str, dict[str, Any]], shell: str
) -> None:
    s = shells[shell]
    asked = s["stats"]["replacements_requested"]
    assert asked >= s["counters"]["filtered"] > 0
    # fed at the next cycle: at most the last cycle's requests are still due at the end
    assert s["counters"]["replacements"] >= asked - s["counters"]["filtered"]
    assert s["counters"]["replacements"] > 0


@pytest.mark.parametrize("shell", ["ray", "sim"])
def test_rule3_redundancy_applies_to_baseline_policies(
    shells: dict[str, dict[str, Any]], shell: str
) -> None:
    s = shells[shell]
    surplus = s["ledger"]["dropped_reasons"].get("group_surplus", 0) + sum(
        n for r, n in s["stats"]["aborts_by_reason"].items() if "surplus" in r
    )
    assert surplus > 0, (s["ledger"]["dropped_reasons"], s["stats"]["aborts_by_reason"])


def test_rule4_both_cores_run_on_the_one_config(shells: dict[str, dict[str, Any]]) -> None:
    """The stuck-buffer wait (and every decision setting) reaches both cores unchanged."""
    for name, s in shells.items():
        assert s["core_config"] == s["expected_config"], name
        assert "stuck_after_s=0.5" in s["core_config"], name
