"""Closed-loop runs of every coordinator policy with sim engines, at tiny scale.

Each run composes the real staleness protocol, the real coordinator (the named policy) and
SimEngineCore instances in virtual time; the asserts are the system's promises: the steps
complete, no admitted trajectory is lost (the simulator's ledger agrees with the protocol's),
consumed staleness never exceeds η, and on a skewed, KV-constrained workload StaleFlow's
strategies beat their all-vanilla ablation.
"""

from __future__ import annotations

import functools
import statistics
from pathlib import Path

import pytest

from rollout_coordinator.policies import build_policy
from staleflow_trainer.config import POLICIES, load_config
from staleflow_trainer.control.checks import ledger_problems
from staleflow_trainer.sim import Simulation, with_policy
from staleflow_trainer.sim.testing import sim_config

pytestmark = pytest.mark.sim

# Small but skewed: a long-tailed length distribution (sigma 1.2, 3 % at the 2K cap) on
# instances whose KV cache holds only ~12 full-length trajectories, so where work goes matters.
TINY = dict(
    steps=8,
    batch_size=8,
    group_size=4,
    total_gpus=8,
    rollout_gpus=4,
    train_gpus=4,
    cost_model="qwen-7b-h20",
    max_running=64,
    kv_capacity_tokens=24_000,
    prompt_len=128,
    prompt_len_max=256,
    response_len_median=300,
    response_len_sigma=1.2,
    max_response_len=2048,
    trainer_time_a_s=0.2,
    trainer_time_b_s_per_token=2e-6,
    model_bytes=1_000_000_000,
    push_bandwidth_gb_s=20.0,
    pull_bandwidth_gb_s=20.0,
    cycle_period_s=0.1,
    warmup_steps=2,
)


def _run(policy: str, eta: int = 2, **kw: object) -> Simulation:
    sim = Simulation(with_policy(sim_config(**{**TINY, **kw}), policy, eta))
    sim.run()
    assert ledger_problems(sim.core) == []  # nothing lost or counted twice; staleness <= eta
    return sim


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_closed_loop_keeps_every_promise(policy: str) -> None:
    sim = _run(policy)
    spec = sim.spec
    assert len(sim.rec.steps) == spec.steps
    assert [r["version"] for r in sim.rec.steps] == list(range(1, spec.steps + 1))
    counts = sim.core.ledger.counts()
    assert counts["consumed"] == spec.steps * spec.batch_size * spec.group_size
    keeps = build_policy(policy).keeps_eta  # verl-async: η sets its window, not a bound
    for row in sim.rec.steps:
        assert row["max_staleness"] <= spec.eta or not keeps
        assert sum(row["staleness_hist"].values()) == spec.batch_size * spec.group_size
    stats = sim.core.protocol.stats()
    assert max(stats.staleness_histogram, default=0) <= spec.eta or not keeps
    assert sim.rec.summary()["tokens_per_s"] > 0
    if policy == "sync":
        # colocated: a batch is generated only while the trainer is idle
        assert all(r["trainer_wait_s"] > 0 for r in sim.rec.steps)


def test_verl_async_trains_past_its_window_where_staleflow_keeps_eta() -> None:
    """verl's fully-async recipe bounds how far generation runs ahead, not each trajectory:
    with the same η (its window s) and the same workload, it trains some response more than
    η versions after the response started, and staleflow keeps every trajectory within η."""
    verl, flow = _run("verl-async"), _run("staleflow")
    assert max(r["max_staleness"] for r in verl.rec.steps) > verl.spec.eta
    assert max(r["max_staleness"] for r in flow.rec.steps) <= flow.spec.eta


def test_dynamic_sampling_filters_and_still_completes() -> None:
    sim = _run("staleflow", dynamic_sampling=True, reward_mean=0.2)
    filtered = sim.core.counters["filtered"]
    assert filtered > 0
    counts = sim.core.ledger.counts()
    assert counts["dropped"] >= filtered * TINY["group_size"]
    # filtered before they occupy a slot, and a replacement prompt for each
    assert sim.core.counters["replacements"] >= filtered
    assert len(sim.rec.steps) == TINY["steps"]


def test_redundant_rollout_keeps_every_promise() -> None:
    """StaleFlow's batch- and group-level redundancy: more is admitted than a batch needs, the
    surplus is aborted, and still exactly B x n trajectories are consumed per step."""
    sim = _run("staleflow", batch_redundancy=2, group_redundancy=1, stuck_threshold=2)
    spec = sim.spec
    assert sim.core.config.members == spec.group_size + 1
    counts = sim.core.ledger.counts()
    assert counts["consumed"] == spec.steps * spec.batch_size * spec.group_size
    assert all(r["max_staleness"] <= spec.eta for r in sim.rec.steps)
    reasons = sim.core.protocol.stats().aborts_by_reason
    assert reasons.get("group_surplus", 0) > 0, reasons
    summary = sim.rec.summary()
    assert 0 < summary["rollout_busy_frac"] <= 1.0  # token-rate utilisation, not "has work"
    assert summary["rollout_busy_frac"] <= summary["rollout_active_frac"] + 1e-9


def test_prefill_share_and_preemptions_are_the_engines_own_counts() -> None:
    # even routing onto small KV caches: the engines preempt, and re-prefill what they did
    sim = _run("all-vanilla", kv_capacity_tokens=8_000)
    rows, n = sim.rec.steps, len(sim.engines)
    engines = sim.engines.values()
    # per step, what the engines did since the previous one: the steps add up to their totals
    prefill_s = sum(r["prefill_frac"] * r["step_s"] * n for r in rows)
    assert prefill_s == pytest.approx(sum(e.prefill_seconds for e in engines), rel=1e-9)
    assert sum(r["preemptions"] for r in rows) == sum(e.preemptions for e in engines) > 0
    assert all(0 <= r["prefill_frac"] < 1 for r in rows)
    summary = sim.rec.summary()
    measured = rows[sim.spec.warmup_steps :]
    assert summary["preemptions"] == sum(r["preemptions"] for r in measured)
    assert 0 < summary["prefill_frac"] < 1


def test_compare_runs_baselines_without_staleflow_mechanisms() -> None:
    """A comparison's baselines model systems without batch redundancy or stuck-buffer
    resolution (group redundancy stays, so every policy draws the same responses)."""
    cfg = sim_config(**TINY, group_redundancy=2, batch_redundancy=2, stuck_threshold=2)
    sim = _run_cfg(with_policy(cfg, "coarse-async"))
    assert sim.core.config.members == TINY["group_size"] + 2
    assert sim.core.protocol.config.slots_per_buffer == TINY["batch_size"]
    assert sim.core.protocol.config.stuck_threshold is None
    sf = with_policy(cfg, "staleflow")
    assert (sf.protocol.batch_redundancy, sf.protocol.stuck_threshold) == (2, 2)


def _run_cfg(cfg: object) -> Simulation:
    sim = Simulation(cfg)
    sim.run()
    assert ledger_problems(sim.core) == []
    return sim


# Rollout-bound and skewed: (eta+1)*B*n = 512 admissible trajectories against ~160 that fit in
# the instances' KV, a 1.5 s weight pull and real re-prefill cost, so where work goes and when
# instances sync matter (unlike TINY at eta=1, where the protocol's slots are the bottleneck).
# Prefill is one step per context here (no chunking under a token budget): with the engines'
# chunked prefill (budget = max_model_len) the default strategies measured 1.22, 1.02, 0.90x
# all-vanilla for seeds 0-2 (the paper profile 0.99, 1.05, 1.12x), a loss the strategy work
# still has to remove; these tests keep the regime their promise was measured in.
ROLLOUT_BOUND = dict(
    batch_size=16,
    group_size=8,
    steps=10,
    model_bytes=15_000_000_000,
    pull_bandwidth_gb_s=10.0,
    prefill_s_per_token=2e-5,
    max_num_batched_tokens="off",
    theta=0.1,
)


SEEDS = range(10)


@functools.cache
def _tokens_per_s(policy: str, seed: int) -> float:
    return float(_run(policy, eta=3, seed=seed, **ROLLOUT_BOUND).rec.summary()["tokens_per_s"])


def _over_all_vanilla(policy: str) -> tuple[float, ...]:
    """``policy`` / all-vanilla tokens/s at η = 3 on ROLLOUT_BOUND, one ratio per seed of
    :data:`SEEDS` (virtual time: deterministic per seed, but a seed's ratio swings by ±15 %,
    so the promise is held on the mean, with a floor for every seed)."""
    return tuple(_tokens_per_s(policy, s) / _tokens_per_s("all-vanilla", s) for s in SEEDS)


def test_cost_model_routing_and_migration_beat_all_vanilla_when_rollout_bound() -> None:
    """vanilla-sync (cost-model routing + migration, global sync) / all-vanilla over seeds
    0-9: measured mean 1.13, every seed 1.03-1.32 (before migration's speedup test, mean 1.13,
    1.00-1.32)."""
    r = _over_all_vanilla("vanilla-sync")
    assert statistics.fmean(r) >= 1.08 and min(r) >= 1.0, r


def test_staleflow_beats_all_vanilla_on_average_on_a_skewed_workload() -> None:
    """staleflow > all-vanilla on average on a skewed, rollout-bound workload (seeds 0-9; a
    seed's ratio swings by up to ±0.3, so single seeds may fall below 1): measured
    mean 1.08, every seed 0.89-1.34 (before migration's speedup test, mean 1.05, 0.86-1.19;
    seed 2 went from 1.11 to 0.99, seed 3 from 0.88 to 1.21). The larger margin of the
    vanilla-sync ablation above shows per-instance sync gives part of the gain back here; on
    the protocol-bound TINY workload (eta=1) every staleflow-family policy is level with
    all-vanilla (0.99-1.00x), see docs/throughput.md."""
    r = _over_all_vanilla("staleflow")
    assert statistics.fmean(r) >= 1.03 and min(r) >= 0.85, r


def test_a_partly_admitted_group_in_the_buffer_due_is_completed(tmp_path: Path) -> None:
    """The rollout-bound preset at η = 1 with θ = 0.7, seed 1: one group was admitted with 12
    of its 16 members in the buffer the trainer takes next; its other 4 were queued behind more
    than ``route_miss_limit`` trajectories of fresh groups that no buffer admitted, so the
    router never reached them and the run stopped after 13 steps ("simulation deadlocked",
    nothing left to do). Once its buffer is the next one the trainer takes, such a group's
    never-routed members now go before every fresh group (``control/ledger.py``)."""
    preset = Path(__file__).resolve().parents[2] / "examples/sim-paper-30b-a3b-rollout-bound.yaml"
    overrides = ["protocol.eta=1", "coordinator.theta=0.7", "run.seed=1", "trainer.steps=15"]
    sim = _run_cfg(load_config(preset, [*overrides, f"run.run_dir={tmp_path}"]))
    assert len(sim.rec.steps) == 15
    assert sim.core.ledger.promotions > 0  # the run still reaches the case it guards


def test_coarse_async_drop_keeps_eta_by_discarding_what_ages_out() -> None:
    """The FIFO baseline (ROLL Flash style): the first B complete groups are trained; groups
    that can no longer be trained within η are dropped — in flight and finished-but-waiting
    alike — so η holds, the ledger balances, and the waste is visible. StaleFlow on the same
    workload keeps η without dropping anything as stale."""
    drop = _run("coarse-async-drop", eta=1)
    sf = _run("staleflow", eta=1)
    reasons = drop.core.protocol.stats().aborts_by_reason
    assert reasons.get("stale", 0) > 0, reasons
    counts = drop.core.ledger.counts()
    assert counts["dropped"] >= reasons["stale"]
    assert drop.rec.summary()["tokens_wasted"] > 0
    assert all(r["max_staleness"] <= 1 for r in drop.rec.steps)
    assert sf.core.protocol.stats().aborts_by_reason.get("stale", 0) == 0


def test_the_trainer_is_timed_by_the_batch_it_trains() -> None:
    """The attention term of the step time sees every consumed sequence: the sum of squared
    lengths lies between tokens² / count (all equal) and tokens² (one sequence)."""
    cfg = with_policy(sim_config(**TINY), "staleflow", 2)
    sim = Simulation(cfg)
    seen: list[tuple[int, int, float]] = []
    measure = sim._seq_sq_sum

    def spy(train: object, streamed: object = None) -> float:
        assert streamed is None  # nothing streams here: the whole batch is measured
        total = measure(train, None)  # type: ignore[arg-type]
        seen.append((train.tokens, len(train.flat_ids), total))  # type: ignore[attr-defined]
        return total

    sim._seq_sq_sum = spy  # type: ignore[method-assign]
    sim.run()
    assert len(seen) == TINY["steps"]
    for tokens, count, total in seen:
        assert tokens**2 / count * 0.999 <= total <= tokens**2, (tokens, count, total)
