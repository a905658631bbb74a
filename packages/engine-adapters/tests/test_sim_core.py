"""The sim core's arithmetic against hand-computed cases and a per-step reference."""

from __future__ import annotations

import math
import random

import attrs
import pytest

from engine_adapters import (
    FinishReason,
    GenerateRequest,
    InvalidRequest,
    PromptTooLong,
    SamplingParams,
    UnknownTrajectory,
)
from engine_adapters.sim import CostModel, SimConfig, SimEngineCore
from engine_adapters.testing.sim_reference import RefTraj, run_reference

EOS = 2
COST = CostModel(name="t", k1=1e-6, k2=0.01, b=0.004, k3=1e-3, k4=0.002)


def cfg(**kw: object) -> SimConfig:
    base: dict[str, object] = dict(
        cost=COST, kv_capacity_tokens=100_000, max_model_len=4_096, prefill_s_per_token=1e-4
    )
    base.update(kw)
    return SimConfig(**base)  # type: ignore[arg-type]


def req(
    tid: str, plen: int, target: int | None = None, max_new: int = 1000, **kw: object
) -> GenerateRequest:
    return GenerateRequest(
        trajectory_id=tid,
        prompt_token_ids=[20] * plen,
        sampling=SamplingParams(max_new_tokens=max_new, stop_token_ids=(EOS,)),
        target_length=target,
        **kw,  # type: ignore[arg-type]
    )


def drain(core: SimEngineCore) -> dict[str, object]:
    done = {}
    while (t := core.next_event_time()) < math.inf:
        for c in core.advance_to(t):
            done[c.trajectory_id] = c
    return done


def test_single_trajectory_finish_time_is_sum_of_step_latencies() -> None:
    c = cfg()
    core = SimEngineCore(c)
    core.add(req("a", 10, target=50), now=0.0)
    done = drain(core)
    # hand-computed: prefill of 10 tokens, then 50 steps with kv = 10, 11, ..., 59
    expected = 10 * 1e-4 + sum(0.002 + 1e-6 * (10 + i) + max(0.01, 0.004 + 1e-3) for i in range(50))
    a = done["a"]
    assert a.time_s == pytest.approx(expected, rel=1e-12)
    assert a.num_tokens == 50
    assert a.finish_reason is FinishReason.STOP
    assert core.total_generated_tokens == 50


def test_two_trajectories_hand_computed() -> None:
    c = cfg(prefill_s_per_token=0.0)
    core = SimEngineCore(c)
    core.add(req("short", 5, target=3), now=0.0)
    core.add(req("long", 7, target=6), now=0.0)
    done = drain(core)
    tau2 = [COST.step_latency(2, 12 + 2 * i) for i in range(3)]
    t_short = sum(tau2)
    tau1 = [COST.step_latency(1, 7 + 3 + i) for i in range(3)]
    assert done["short"].time_s == pytest.approx(t_short, rel=1e-12)
    assert done["long"].time_s == pytest.approx(t_short + sum(tau1), rel=1e-12)


def test_kv_accounting_matches_contexts() -> None:
    core = SimEngineCore(cfg())
    core.add(req("a", 10, target=100), now=0.0)
    core.add(req("b", 30, target=100), now=0.0)
    t = 0.3
    snap = core.snapshot(t)
    gens = {r.trajectory_id: r.generated_tokens for r in snap.running}
    assert gens["a"] == gens["b"] > 0
    assert snap.kv_used_tokens == 10 + 30 + 2 * gens["a"]
    assert snap.kv_used_tokens == core.kv_used_tokens(t)
    assert snap.throughput_tokens_per_s == pytest.approx(COST.throughput(2, snap.kv_used_tokens))


def test_preemption_takes_the_latest_admitted_first() -> None:
    # Three trajectories fit at first, then KV runs out; the last admitted is preempted,
    # goes to the front of the waiting queue, and is recomputed later.
    c = cfg(kv_capacity_tokens=120, max_model_len=100, prefill_s_per_token=0.0)
    core = SimEngineCore(c)
    for tid in ("a", "b", "c"):
        core.add(req(tid, 20, target=60), now=0.0)
    core.add(req("d", 20, target=5), now=0.0)  # waits: 3×20 + 20 + 4 > 120? no: admitted
    snap = core.snapshot(0.0)
    admitted = [r.trajectory_id for r in snap.running]
    assert admitted == ["a", "b", "c", "d"]
    # run until the first preemption happens
    order = []
    while core.preemptions == 0:
        core.advance_to(core.next_event_time())
    snap = core.snapshot(core.now)
    running = [r.trajectory_id for r in snap.running]
    order.append(running)
    assert "c" not in running  # "d" finished early; then "c" (latest admitted) is preempted
    assert running == ["a", "b"]
    assert snap.waiting == 1
    assert snap.kv_used_tokens + len(running) <= 120
    done = drain(core)
    assert set(done) == {"a", "b", "c"}
    assert all(d.num_tokens == 60 for d in done.values())


def test_interrupt_mid_step_keeps_completed_steps_only() -> None:
    c = cfg(prefill_s_per_token=0.0)
    core = SimEngineCore(c)
    core.add(req("a", 10, target=1000), now=0.0)
    t3 = sum(COST.step_latency(1, 10 + i) for i in range(3))
    t4 = t3 + COST.step_latency(1, 13)
    (part,) = core.interrupt(["a"], now=(t3 + t4) / 2)
    assert part.num_tokens == 3
    assert part.finish_reason is FinishReason.INTERRUPTED
    assert not core.holds("a")
    assert core.next_event_time() == pytest.approx(t4)  # the step in flight still completes


def test_interrupt_waiting_and_unknown() -> None:
    core = SimEngineCore(cfg(max_running=1))
    core.add(req("a", 10, target=100), now=0.0)
    core.add(req("b", 10, target=100), now=0.0)
    with pytest.raises(UnknownTrajectory):
        core.interrupt(["b", "nope"], now=0.01)
    assert core.holds("a") and core.holds("b")
    (b,) = core.interrupt(["b"], now=0.02)
    assert b.num_tokens == 0 and b.version_segments == ()
    assert b.to_result().token_ids == ()
    parts = core.interrupt(None, now=0.03)
    assert [p.trajectory_id for p in parts] == ["a"]
    assert core.num_running == core.num_waiting == 0


def test_resume_continues_the_same_stream() -> None:
    whole = SimEngineCore(cfg())
    whole.add(req("a", 10, target=200), now=0.0)
    full = drain(whole)["a"].to_result()

    core = SimEngineCore(cfg())
    core.add(req("a", 10, target=200), now=0.0)
    (part,) = core.interrupt(["a"], now=0.5)
    p = part.to_result()
    assert 0 < len(p.token_ids) < 200
    other = SimEngineCore(cfg(), instance_id="other")
    other.add(
        req(
            "a",
            10,
            target=200,
            generated_token_ids=p.token_ids,
            generated_logprobs=p.logprobs,
            generated_versions=p.versions,
        ),
        now=1.0,
    )
    resumed = drain(other)["a"].to_result()
    assert resumed.token_ids == full.token_ids
    assert resumed.logprobs == full.logprobs
    assert resumed.token_ids[-1] == EOS and EOS not in resumed.token_ids[:-1]


def test_weight_load_pauses_and_switches_versions_mid_trajectory() -> None:
    c = cfg(prefill_s_per_token=0.0, weight_bandwidth_bytes_per_s=1e6, weight_load_constant_s=0.1)
    core = SimEngineCore(c)
    core.add(req("a", 10, target=100), now=0.0)
    t5 = sum(COST.step_latency(1, 10 + i) for i in range(5))
    done_at = core.load_weights(1, nbytes=200_000, now=t5)  # exactly at a boundary
    assert done_at == pytest.approx(t5 + 0.2 + 0.1)
    assert core.version == 0 and core.loading
    (a,) = drain(core).values()
    assert core.version == 1
    assert a.version_segments == ((0, 0), (5, 1))
    rest = sum(COST.step_latency(1, 15 + i) for i in range(95))
    assert a.time_s == pytest.approx(done_at + rest)
    r = a.to_result()
    assert r.versions == (0,) * 5 + (1,) * 95


def test_load_weights_rejects_older_version_and_concurrent_load() -> None:
    core = SimEngineCore(cfg(), version=3)
    with pytest.raises(InvalidRequest):
        core.load_weights(2, 10, now=0.0)
    core.load_weights(4, 10, now=0.0)
    with pytest.raises(InvalidRequest):
        core.load_weights(5, 10, now=0.0)
    drain(core)
    assert core.version == 4


def test_stop_token_and_length() -> None:
    core = SimEngineCore(cfg())
    probe = GenerateRequest(
        trajectory_id="probe", prompt_token_ids=[20] * 4, sampling=SamplingParams(max_new_tokens=64)
    )
    core.add(probe, now=0.0)
    r = drain(core)["probe"].to_result()
    assert len(r.token_ids) == 64 and r.finish_reason is FinishReason.LENGTH
    stop = r.token_ids[20]
    first = r.token_ids.index(stop)
    core.add(
        GenerateRequest(
            trajectory_id="s",
            prompt_token_ids=[20] * 4,
            sampling=SamplingParams(max_new_tokens=64, stop_token_ids=(stop,)),
        ),
        now=core.now,
    )
    s = drain(core)["s"].to_result()
    assert s.finish_reason is FinishReason.STOP
    assert s.token_ids == r.token_ids[: first + 1]


def test_eos_without_stop_ids_does_not_stop() -> None:
    core = SimEngineCore(cfg())
    core.add(
        GenerateRequest(
            trajectory_id="a",
            prompt_token_ids=[20] * 4,
            sampling=SamplingParams(max_new_tokens=30),
            target_length=10,
        ),
        now=0.0,
    )
    r = drain(core)["a"].to_result()
    assert r.finish_reason is FinishReason.LENGTH and len(r.token_ids) == 30
    assert r.token_ids[9] == EOS


def test_bad_input_leaves_state_unchanged() -> None:
    core = SimEngineCore(cfg(max_model_len=64, kv_capacity_tokens=1000))
    core.add(req("a", 10, target=20), now=0.0)
    with pytest.raises(PromptTooLong):
        core.add(req("long", 64), now=0.0)
    with pytest.raises(InvalidRequest):
        core.add(req("a", 5), now=0.0)  # duplicate id
    with pytest.raises(InvalidRequest):
        core.add(
            GenerateRequest(trajectory_id="v", prompt_token_ids=[10**6]), now=0.0
        )  # outside vocab
    assert core.num_running + core.num_waiting == 1
    core.advance_to(0.1)
    with pytest.raises(InvalidRequest):
        core.advance_to(0.05)


def test_context_limit_gives_length() -> None:
    core = SimEngineCore(cfg(max_model_len=64, kv_capacity_tokens=1000))
    core.add(req("a", 60, target=None, max_new=100), now=0.0)
    (a,) = drain(core).values()
    assert a.num_tokens == 4 and a.finish_reason is FinishReason.LENGTH


def _random_case(
    rng: random.Random,
    *,
    budgets: tuple[int, ...],
    speeds: tuple[float, ...],
    zeros: int,
    most: int,
) -> tuple[SimConfig, list[RefTraj]]:
    """A random engine config (``budgets``: token budgets above ``max_running``, beside None
    and 64) and 1 to ``most`` trajectories, each arriving at 0 with ``zeros`` chances in
    ``zeros + 1``."""
    max_running = rng.choice([2, 4, 16])
    c = cfg(
        kv_capacity_tokens=rng.choice([400, 800, 5_000]),
        max_model_len=300,
        max_running=max_running,
        prefill_s_per_token=rng.choice([0.0, 1e-4]),
        prefill_s_per_token_position=rng.choice([0.0, 3e-7]),
        max_num_batched_tokens=rng.choice([None, *(max_running + k for k in budgets), 64]),
        speed_factor=rng.choice(speeds),
    )
    trajs = [
        RefTraj(
            tid=f"t{i}",
            arrive=rng.choice([0.0] * zeros + [rng.uniform(0, 0.5)]),
            prompt_len=rng.randint(1, 60),
            stop_len=rng.randint(1, 200),
        )
        for i in range(rng.randint(1, most))
    ]
    return c, trajs


def _replay(
    c: SimConfig, events: list[tuple[float, RefTraj | float]]
) -> tuple[SimEngineCore, dict]:
    """Drive a core through ``events`` in order (a trajectory arrives, or the pace changes),
    then to the end; the core and every completion by trajectory id."""
    core = SimEngineCore(c)
    got = {}
    for at, what in events:
        while core.next_event_time() <= at:
            for d in core.advance_to(core.next_event_time()):
                got[d.trajectory_id] = d
        for d in core.advance_to(at):
            got[d.trajectory_id] = d
        if isinstance(what, RefTraj):
            core.add(req(what.tid, what.prompt_len, target=what.stop_len), now=at)
        else:
            core.set_pace(what, now=at)
    got.update(drain(core))
    return core, got


def _assert_matches(
    core: SimEngineCore, got: dict, expected: dict[str, float], preemptions: int
) -> None:
    assert set(got) == set(expected)
    for tid, t in expected.items():
        assert got[tid].time_s == pytest.approx(t, rel=1e-9, abs=1e-12), tid
    assert core.preemptions == preemptions


@pytest.mark.parametrize("seed", range(40))
def test_closed_form_matches_per_step_reference(seed: int) -> None:
    rng = random.Random(seed)
    c, trajs = _random_case(rng, budgets=(1, 7), speeds=(1.0, 0.7, 1.3), zeros=2, most=25)
    expected, preemptions = run_reference(c, [attrs.evolve(t) for t in trajs])
    arrivals = sorted(trajs, key=lambda t: t.arrive)
    core, got = _replay(c, [(t.arrive, t) for t in arrivals])
    _assert_matches(core, got, expected, preemptions)


@pytest.mark.parametrize("seed", range(30))
def test_pace_changes_match_per_step_reference(seed: int) -> None:
    """``set_pace`` mid-run: the step in progress keeps its pace, every later step runs at the
    new one (prefill included), exactly as the per-step reference."""
    rng = random.Random(1000 + seed)
    c, trajs = _random_case(rng, budgets=(7,), speeds=(1.0, 0.7), zeros=1, most=20)
    # changes at random times, and at arrivals (a boundary where trajectories join)
    times = {rng.choice([rng.uniform(0, 1.5), rng.choice(trajs).arrive]) for _ in range(6)}
    paces = sorted((at, rng.choice([1.0, 0.5, 0.25, 0.8])) for at in times)
    expected, preemptions = run_reference(c, [attrs.evolve(t) for t in trajs], paces)
    # arrivals in their order; a change at an arrival's time before or after them
    events = [(t.arrive, 0, i, t) for i, t in enumerate(trajs)]
    events += [(at, rng.choice([-1, 1]), 0, p) for at, p in paces]
    ordered = sorted(events, key=lambda e: (e[0], e[1], e[2]))
    core, got = _replay(c, [(at, what) for at, _, _, what in ordered])
    _assert_matches(core, got, expected, preemptions)


def test_set_pace_rejects_a_pace_outside_zero_to_one() -> None:
    core = SimEngineCore(cfg())
    for bad in (0.0, -0.5, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(InvalidRequest, match="pace"):
            core.set_pace(bad, now=0.0)
    assert core.pace == 1.0
