"""The simulator and the Ray deployment are two shells over one control core: driven through
the same scenario they apply the same rules and reach the same outcome.

Each scenario runs one config through both shells — the Ray deployment (sim engines in real
time, the real trajectory server, param server, reward workers and PyTorch trainer) and the
simulator (virtual time) — with group and batch redundancy, dynamic sampling on, rewards that
make some groups all-equal, and a stuck-buffer rule; under StaleFlow itself, an ablation and a
baseline that models another system. Timing differs between the shells (real against virtual
time, the reward function against the simulator's synthetic rewards), so the counts differ; the
outcome of each rule where two separate control loops once disagreed must not:

1. filtering: a group whose kept rewards are all equal is dropped whole (all ``n'`` members,
   with the filtering reason) before it takes a buffer slot, so every consumed batch is full of
   trainable groups;
2. replacement prompts: each group filtering removed asks for a replacement prompt, and every
   replacement asked for is fed (none discarded);
3. redundancy applies to every policy, baselines included: surplus members are dropped, and
   both cores run with the same batch redundancy;
4. the stuck-buffer wait and every other decision setting come from one place: both shells'
   cores run on exactly the config built from the app config.

:func:`outcome` states each rule's outcome the same way for both shells; the tests compare the
two shells' outcomes, rule by rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from tiny_setup import tiny_config

pytestmark = [pytest.mark.ray, pytest.mark.sim, pytest.mark.timeout(900)]

B, N, ETA, STEPS = 4, 4, 1, 4
N_PRIME = N + 1  # group_redundancy=1
SCENARIO = (
    f"trainer.steps={STEPS}",
    f"protocol.batch_size={B}",
    f"protocol.group_size={N}",
    f"protocol.eta={ETA}",
    "protocol.group_redundancy=1",
    "protocol.batch_redundancy=1",
    "protocol.stuck_threshold=1",
    "protocol.stuck_after_s=0.5",
    "trainer.dynamic_sampling=true",
    "reward.fn=staleflow_trainer.reward.testing:coin",
    "sim.workload.reward_mean=0.5",
    "rollout.sampling.max_new_tokens=6",
    "sim.workload.response_len_median=4",
    "sim.workload.prompt_len=8",
    "run.checkpoint_every=0",
    "run.resume=never",
)
#: StaleFlow, an ablation of it, and a baseline that models another system (with buffers, so
#: batch redundancy and stuck resolution apply to it too)
POLICIES = ("staleflow", "all-vanilla", "coarse-async")


def _run_both(cfg: Any) -> dict[str, dict[str, Any]]:
    import ray

    from staleflow_trainer.control.config import core_config
    from staleflow_trainer.runtime.wiring import Deployment
    from staleflow_trainer.sim import Simulation

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
            "staleness_histogram": dict(st.staleness_histogram),
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
        stats = {
            **ray.get(dep.coordinator.protocol_stats.remote()),
            "staleness_histogram": summary["staleness_histogram"],
        }
        out["ray"] = {
            "counters": summary["counters"],
            "stats": stats,
            "core_config": ray.get(dep.coordinator.core_config.remote()),
            "ledger": dep.ledger(),
            "expected_config": repr(core_config(cfg, rows=ray.get(dep.coordinator.rows.remote()))),
        }
    finally:
        dep.close()
    return out


def outcome(s: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each rule's outcome in one shell, in terms that do not depend on timing."""
    counters, stats, ledger = s["counters"], s["stats"], s["ledger"]
    reasons = ledger["dropped_reasons"]
    filtered = counters["filtered"]
    asked = stats["replacements_requested"]
    fed = counters["replacements"]
    surplus = reasons.get("group_surplus", 0) + sum(
        n for r, n in stats["aborts_by_reason"].items() if "surplus" in r
    )
    hist = {int(k): v for k, v in stats["staleness_histogram"].items()}
    return {
        "1 filtering": {
            "some groups filtered": filtered > 0,
            "filtered groups dropped whole": reasons.get("filtered: equal rewards", 0)
            == filtered * N_PRIME,
            "batches consumed": stats["consumed_batches"],
            "every batch full": ledger["consumed"] == STEPS * B * N,
            "staleness within eta": max(hist, default=0) <= ETA,
        },
        "2 replacements": {
            "one asked per filtered group": asked >= filtered > 0,
            # fed at the next cycle: at most the last cycle's requests are still due at the end
            "every one asked for fed": asked - filtered <= fed <= asked and fed > 0,
        },
        "3 redundancy": {"surplus members dropped": surplus > 0},
        "4 one config": {
            "core runs the app config": s["core_config"] == s["expected_config"],
            "stuck wait from the config": "stuck_after_s=0.5" in s["core_config"],
            "batch redundancy in the core": "batch_redundancy=1" in s["core_config"],
        },
    }


@pytest.fixture(scope="module", params=POLICIES)
def shells(
    request: pytest.FixtureRequest,
    ray_session: None,
    tmp_path_factory: pytest.TempPathFactory,
    engine_required: Callable[[str], None],
) -> dict[str, dict[str, Any]]:
    engine_required("sim")
    policy = request.param
    cfg = tiny_config(
        tmp_path_factory.mktemp(f"shells-{policy}"),
        *SCENARIO,
        f"coordinator.policy={policy}",
        backend="sim",
    )
    return _run_both(cfg)


@pytest.mark.parametrize("rule", ["1 filtering", "2 replacements", "3 redundancy", "4 one config"])
def test_both_shells_reach_the_same_outcome(shells: dict[str, dict[str, Any]], rule: str) -> None:
    ray_out, sim_out = outcome(shells["ray"])[rule], outcome(shells["sim"])[rule]
    assert ray_out == sim_out, (rule, {"ray": ray_out, "sim": sim_out})


@pytest.mark.parametrize("rule", ["1 filtering", "2 replacements", "3 redundancy", "4 one config"])
def test_the_outcome_is_the_rule(shells: dict[str, dict[str, Any]], rule: str) -> None:
    """Agreeing is not enough: the outcome both shells reach is the rule's."""
    got = outcome(shells["sim"])[rule]
    want = {k: (STEPS if k == "batches consumed" else True) for k in got}
    assert got == want, (rule, got, shells["sim"]["counters"], shells["sim"]["ledger"])
