"""The Megatron trainer-time model: verl's FLOPs count, recompute, bubbles, offload, presets."""

from __future__ import annotations

import pytest

from staleflow_trainer.errors import ConfigError
from staleflow_trainer.sim.trainer_model import SETUPS, MegatronSetup, setup

H20 = 148e12


def bare(**kw: object) -> MegatronSetup:
    base: dict[str, object] = dict(
        name="t",
        model="qwen3-30b-a3b",
        gpu="h20",
        num_gpus=32,
        expert_parallel=8,
        update_mfu=0.31,
        full_recompute=False,
        logprob_pass=False,
        param_offload=False,
        optimizer_offload=False,
        fixed_s=0.0,
    )
    base.update(kw)
    return MegatronSetup(**base)  # type: ignore[arg-type]


def test_flops_are_counted_as_verl_counts_them() -> None:
    s = bare()
    # verl, qwen3_moe: N = (h*topk*moe_ffn*3 + h*E + h*(q+k+v+o)) * L + 2*V*h
    n = (
        2048 * 8 * 768 * 3 + 2048 * 128 + 2048 * (4096 + 512 + 512 + 4096)
    ) * 48 + 2 * 151_936 * 2048
    assert s.model.active_params == pytest.approx(n, rel=2e-3)
    # attention: 12 * seq^2 * head_dim * heads * layers, one 1000-token sequence
    assert s.update_flops(1000, 1000**2) == pytest.approx(
        6 * s.model.active_params * 1000 + 12 * 1000**2 * 128 * 32 * 48
    )


def test_update_time_by_hand_and_recompute() -> None:
    s = bare()
    tokens, sq = 4e6, 4e6 * 5000
    flops = s.update_flops(tokens, sq)
    assert s.step_seconds(tokens, sq) == pytest.approx(flops / (32 * H20 * 0.31))
    with_recompute = bare(full_recompute=True).breakdown(tokens, sq)
    assert with_recompute.update_s == pytest.approx(flops * 4 / 3 / (32 * H20 * 0.31))
    # the log-prob pass: one forward (a third) at 0.63 of the update's efficiency
    lp = bare(logprob_pass=True).breakdown(tokens, sq).logprob_s
    assert lp == pytest.approx(flops / 3 / (32 * H20 * 0.31 * 0.63))
    # tokens alone: sequences of assumed_seq_len
    assert s.step_seconds(tokens) == pytest.approx(s.step_seconds(tokens, tokens * 4096))


def test_pipeline_bubble() -> None:
    s = bare(model="qwen2.5-14b", expert_parallel=1, pipeline_parallel=4, tensor_parallel=2)
    assert s.data_parallel == 4
    # 4 DP ranks x 22,528 tokens per micro-batch: 1.8M tokens -> 20 micro-batches
    b = s.breakdown(1.8e6, 1.8e6 * 4096)
    assert b.bubble_factor == pytest.approx((20 + 3) / 20)
    flat = bare(model="qwen2.5-14b", expert_parallel=1, tensor_parallel=8)
    assert b.update_s == pytest.approx(flat.breakdown(1.8e6, 1.8e6 * 4096).update_s * 23 / 20)


def test_offload_and_optimizer_costs() -> None:
    s = bare(param_offload=True, optimizer_offload=True)
    # dense part 1.54B on every GPU, experts 28.99B over EP 8: 8 bytes each over 25 GB/s
    per_gpu = (30.53e9 - 28.99e9) + 28.99e9 / 8
    assert s.params_per_gpu == pytest.approx(per_gpu, rel=1e-3)
    b = s.breakdown(0)
    assert b.offload_s == pytest.approx(8 * per_gpu / 25e9, rel=1e-3)
    assert b.optimizer_s == pytest.approx(30.53e9 / 32 / 0.5e9)
    assert b.update_s == 0.0


def test_paper_setups_are_slower_than_a_plain_flops_estimate() -> None:
    """The calibrated 30B-A3B step (offload, recompute, log-prob pass, verl's measured MFU) on
    the paper's batch is about twice the FLOPs-at-30%-MFU-plus-10s model's."""
    paper = setup("qwen3-30b-a3b")
    tokens, sq = 4.64e6, 4.64e6 * 7900  # 1,024 lognormal responses (median 3K, cap 20K) + 512
    step = paper.step_seconds(tokens, sq)
    plain = 8 * 3.0e9 * tokens / (32 * H20 * 0.3) + 10.0
    assert 1.8 * plain < step < 3.5 * plain
    assert 150 < step < 400
    b = paper.breakdown(tokens, sq)
    assert b.update_s > b.logprob_s > b.offload_s + b.optimizer_s + b.fixed_s
    assert set(SETUPS) == {"qwen3-30b-a3b", "qwen2.5-7b", "qwen2.5-14b"}
    # dense 7B has 2.3x the active parameters of the 3B-active MoE: more per token
    assert setup("qwen2.5-7b").step_seconds(tokens, sq) > step
    assert setup("qwen2.5-14b").step_seconds(tokens, sq) > setup("qwen2.5-7b").step_seconds(
        tokens, sq
    )


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"num_gpus": 30}, "trainer_model.expert_parallel"),
        ({"num_gpus": 32, "tensor_parallel": 3}, "trainer_model.num_gpus"),
        ({"model": "qwen2.5-7b", "expert_parallel": 2}, "trainer_model.expert_parallel"),
        ({"update_mfu": 1.5}, "trainer_model.update_mfu"),
        ({"pcie_bytes_per_s": 0}, "trainer_model.pcie_bytes_per_s"),
        ({"num_gpus": 0}, "trainer_model.num_gpus"),
    ],
)
def test_bad_setups_name_the_key(kw: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as ei:
        bare(**kw)
    assert ei.value.key == key


def test_unknown_setup_and_bad_tokens() -> None:
    with pytest.raises(ConfigError) as ei:
        setup("gpt-9")
    assert ei.value.key == "trainer_model.setup"
    with pytest.raises(ConfigError):
        bare().step_seconds(-1)
