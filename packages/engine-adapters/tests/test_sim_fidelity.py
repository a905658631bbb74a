"""The sim engine's physical model: KV from geometry, chunked prefill, re-prefill, speed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine_adapters import GenerateRequest, InvalidRequest, SamplingParams
from engine_adapters.hardware import (
    GIB,
    MODELS,
    GpuSpec,
    kv_capacity_tokens,
    model_spec,
    prefill_coefficients,
)
from engine_adapters.sim import CostModel, SimConfig, SimEngineCore, draw_speed_factors

EOS = 2
COST = CostModel(name="t", k1=1e-6, k2=0.01, b=0.004, k3=1e-3, k4=0.002)


def cfg(**kw: object) -> SimConfig:
    base: dict[str, object] = dict(cost=COST, kv_capacity_tokens=100_000, max_model_len=4_096)
    base.update(kw)
    return SimConfig(**base)  # type: ignore[arg-type]


def req(tid: str, plen: int, target: int, generated: int = 0) -> GenerateRequest:
    return GenerateRequest(
        trajectory_id=tid,
        prompt_token_ids=[20] * plen,
        sampling=SamplingParams(max_new_tokens=10_000, stop_token_ids=(EOS,)),
        target_length=target,
        generated_token_ids=[30] * generated,
        generated_logprobs=[-1.0] * generated,
        generated_versions=[0] * generated,
    )


def drain(core: SimEngineCore) -> dict[str, float]:
    done = {}
    while (t := core.next_event_time()) < math.inf:
        for c in core.advance_to(t):
            done[c.trajectory_id] = c.time_s
    return done


# ---- KV capacity from geometry -------------------------------------------------------------


def test_qwen3_30b_a3b_kv_bytes_and_capacity_on_h20() -> None:
    m = model_spec("qwen3-30b-a3b")
    assert m.kv_bytes_per_token == 48 * 4 * 128 * 2 * 2 == 98_304
    assert m.weight_bytes == pytest.approx(61.06e9)
    cap = kv_capacity_tokens("qwen3-30b-a3b", "h20", gpu_memory_utilization=0.9)
    assert 218_000 <= cap <= 283_000
    # by hand: 97,871 MiB x 0.9 - 61.06 GB of weights - 4 GiB reserve, over 96 KiB per token
    assert cap == int((97_871 * 2**20 * 0.9 - 30.53e9 * 2 - 4 * GIB) // 98_304)
    # the nominal 96 GB with no reserve also lands in the published range
    nominal = GpuSpec(name="h20-nominal", memory_bytes=96 * 10**9, bf16_flops=148e12,
                      hbm_bytes_per_s=4e12)  # fmt: skip
    assert 218_000 <= kv_capacity_tokens("qwen3-30b-a3b", nominal, reserve_bytes=0) <= 283_000
    assert SimConfig().kv_capacity == cap  # the default instance is that setting


def test_capacity_moves_with_utilisation_tp_and_override() -> None:
    base = kv_capacity_tokens("qwen2.5-14b", "h20")
    assert kv_capacity_tokens("qwen2.5-14b", "h20", gpu_memory_utilization=0.8) < base
    assert kv_capacity_tokens("qwen2.5-14b", "h20", tensor_parallel_size=2) > 2 * base
    assert model_spec("qwen2.5-7b").kv_bytes_per_token == 28 * 4 * 128 * 2 * 2
    assert SimConfig(kv_capacity_tokens=123_456).kv_capacity == 123_456
    assert SimConfig(model="qwen2.5-7b").kv_capacity > SimConfig().kv_capacity


def test_bad_memory_settings_name_the_field() -> None:
    with pytest.raises(InvalidRequest) as ei:
        kv_capacity_tokens("qwen3-30b-a3b", "h20", gpu_memory_utilization=0.5)
    assert ei.value.field == "gpu_memory_utilization"
    with pytest.raises(InvalidRequest) as ei:
        SimConfig(gpu_memory_utilization=1.5)
    assert ei.value.field == "gpu_memory_utilization"
    with pytest.raises(InvalidRequest) as ei:
        SimConfig(model="gpt-9")
    assert ei.value.field == "model"
    with pytest.raises(InvalidRequest) as ei:
        SimConfig(max_model_len=300_000)  # more than the derived capacity
    assert ei.value.field == "max_model_len"
    with pytest.raises(InvalidRequest) as ei:
        SimConfig(max_running=64, max_num_batched_tokens=64)
    assert ei.value.field == "max_num_batched_tokens"


def test_prefill_coefficients_from_flops() -> None:
    lin, quad = prefill_coefficients("qwen3-30b-a3b", "h20", mfu=0.6)
    m = MODELS["qwen3-30b-a3b"]
    # 2 FLOPs per active non-embedding parameter (~2.73 B) at 60 % of 148 TFLOP/s
    assert m.body_params_active == pytest.approx(2.728e9, rel=1e-3)
    assert lin == pytest.approx(2 * 2.728e9 / (148e12 * 0.6), rel=1e-3)
    assert quad == pytest.approx(4 * 48 * 32 * 128 / (148e12 * 0.6))
    # a 4K prompt: between 10K and 20K tokens/s (SGLang measured 16.6K on one H20)
    t = SimConfig().prefill_seconds(0, 4096)
    assert 10_000 < 4096 / t < 20_000
    # explicit linear prefill means exactly that: the attention term is off unless set
    assert SimConfig(prefill_s_per_token=1e-4).prefill == (1e-4, 0.0)


# ---- chunked prefill -----------------------------------------------------------------------


def test_chunked_prefill_hand_computed() -> None:
    lin, quad = 1e-4, 1e-6
    c = cfg(
        prefill_s_per_token=lin,
        prefill_s_per_token_position=quad,
        max_num_batched_tokens=40,
        max_running=8,
    )

    def chunk(a: int, x: int) -> float:
        return lin * x + quad * (x * a + x * (x - 1) / 2)

    core = SimEngineCore(c)
    core.add(req("a", 10, target=30), now=0.0)
    # a: 10 tokens fit the budget of 40 -> joins in step 1
    t = chunk(0, 10) + COST.step_latency(1, 10)
    core.advance_to(t)
    core.add(req("b", 100, target=5), now=t)
    # b: budget 40 - 1 (a decodes) = 39 per step; 100 = 39 + 39 + 22, joining in step 3
    t += chunk(0, 39) + COST.step_latency(1, 11)
    t += chunk(39, 39) + COST.step_latency(1, 12)
    t += chunk(78, 22) + COST.step_latency(2, 13 + 100)
    b_done = t + sum(COST.step_latency(2, 14 + 101 + 2 * i) for i in range(4))
    done = drain(core)
    assert done["b"] == pytest.approx(b_done, rel=1e-12)
    assert core.prefill_tokens == 110
    assert core.prefill_seconds == pytest.approx(chunk(0, 10) + chunk(0, 100), rel=1e-12)


def test_a_step_carrying_prefill_is_slower_and_quadratic_in_context() -> None:
    def finish(plen: int, **kw: object) -> float:
        core = SimEngineCore(cfg(**kw))
        core.add(req("a", plen, target=1), now=0.0)
        return drain(core)["a"]

    flat = finish(2000, prefill_s_per_token=0.0)
    lin = finish(2000, prefill_s_per_token=1e-4)
    both = finish(2000, prefill_s_per_token=1e-4, prefill_s_per_token_position=1e-8)
    assert lin - flat == pytest.approx(0.2)
    assert both - lin == pytest.approx(1e-8 * 2000 * 1999 / 2)
    # doubling the context quadruples the attention term
    big = finish(4000, prefill_s_per_token_position=1e-8) - finish(4000, prefill_s_per_token=0.0)
    small = finish(2000, prefill_s_per_token_position=1e-8) - flat
    assert big / small == pytest.approx(4000 * 3999 / (2000 * 1999))


# ---- re-prefill on resume ------------------------------------------------------------------


def test_resumed_trajectory_reprefills_its_whole_context() -> None:
    c = cfg(prefill_s_per_token=1e-4)
    fresh = SimEngineCore(c)
    fresh.add(req("a", 100, target=60), now=0.0)
    resumed = SimEngineCore(c)
    resumed.add(req("a", 100, target=60, generated=50), now=0.0)
    t_fresh, t_resumed = drain(fresh)["a"], drain(resumed)["a"]
    # the resumed one prefills 150 tokens, then decodes 10 instead of 60
    assert t_resumed == pytest.approx(
        150e-4 + sum(COST.step_latency(1, 150 + i) for i in range(10))
    )
    assert t_fresh == pytest.approx(100e-4 + sum(COST.step_latency(1, 100 + i) for i in range(60)))


def test_preempted_trajectory_reprefills_prompt_and_generated() -> None:
    c = cfg(prefill_s_per_token=1e-3, kv_capacity_tokens=130, max_model_len=100, max_running=2)
    core = SimEngineCore(c)
    core.add(req("a", 50, target=60), now=0.0)
    core.add(req("b", 50, target=60), now=0.0)
    drain(core)
    assert core.preemptions >= 1
    # every re-admission paid for prompt + tokens generated before it was preempted
    assert core.prefill_tokens > 100


@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_weight_load_recomputes_or_keeps_the_cache(mode: str) -> None:
    c = cfg(
        prefill_s_per_token=1e-4,
        weight_bandwidth_bytes_per_s=1e6,
        weight_load_constant_s=0.0,
        kv_after_weight_load=mode,
    )
    core = SimEngineCore(c)
    core.add(req("a", 100, target=40), now=0.0)
    t10 = 100e-4 + sum(COST.step_latency(1, 100 + i) for i in range(10))
    done_at = core.load_weights(1, nbytes=100_000, now=t10)
    assert done_at == pytest.approx(t10 + 0.1)
    rest = sum(COST.step_latency(1, 110 + i) for i in range(30))
    reprefill = 110e-4 if mode == "recompute" else 0.0
    assert drain(core)["a"] == pytest.approx(done_at + reprefill + rest)


# ---- speed heterogeneity -------------------------------------------------------------------


def test_speed_factor_scales_every_time() -> None:
    def finish(speed: float) -> float:
        core = SimEngineCore(
            cfg(prefill_s_per_token=1e-4, prefill_s_per_token_position=1e-7, speed_factor=speed)
        )
        core.add(req("a", 300, target=200), now=0.0)
        core.add(req("b", 30, target=100), now=0.0)
        return max(drain(core).values())

    assert finish(1.25) == pytest.approx(finish(1.0) / 1.25)
    core = SimEngineCore(cfg(speed_factor=2.0))
    assert core.cost.step_latency(8, 1000) == pytest.approx(COST.step_latency(8, 1000) / 2)


def test_draw_speed_factors() -> None:
    fleet = draw_speed_factors(32, spread=0.1, seed=3)
    assert len(fleet) == 32 and sum(fleet) / 32 == pytest.approx(1.0)
    assert fleet == draw_speed_factors(32, spread=0.1, seed=3)
    assert fleet != draw_speed_factors(32, spread=0.1, seed=4)
    assert 0.05 < float(np.std(fleet)) < 0.2
    assert draw_speed_factors(4, spread=0.0) == (1.0, 1.0, 1.0, 1.0)
    with pytest.raises(InvalidRequest):
        draw_speed_factors(0, spread=0.1)
    with pytest.raises(InvalidRequest):
        draw_speed_factors(3, spread=-1.0)
