"""Seeded requests whose prompts together exceed a step's token budget, on a real vLLM-CPU
engine. vLLM-CPU's model runner rewinds a seeded request's generator after a prefill chunk
that is not the last, which a CPU generator cannot do ("CPU Generator does not use offset"),
and the EngineCore dies; every rollout request is seeded, so in training this happened when
many interrupted trajectories came back at once. The adapter prefills prompts whole on CPU
(``VllmConfig.engine_args``): here four 100-token prompts share a 128-token budget, which
vLLM's chunked prefill split, and all of them finish on a live engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine_adapters import GenerateRequest, SamplingParams, create_engine
from engine_adapters.testing.tiny_model import make_tiny_qwen2

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


async def test_seeded_prompts_over_a_steps_budget_all_finish(tmp_path: Path) -> None:
    adapter = create_engine(
        "vllm",
        model_path=make_tiny_qwen2(tmp_path / "model"),
        instance_id="vllm-seeded",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=128,
    )
    await adapter.start()
    try:
        requests = [
            GenerateRequest(
                trajectory_id=f"seeded-{i}",
                # distinct prompts: no prefix-cache hit shortens a prefill
                prompt_token_ids=tuple(range(10 + i, 110 + i)),
                sampling=SamplingParams(temperature=1.0, max_new_tokens=8, seed=i),
            )
            for i in range(4)
        ]
        results = await asyncio.gather(*(adapter.generate(r) for r in requests))
        assert [len(r.token_ids) for r in results] == [8, 8, 8, 8]
        await adapter.check_health()  # the engine lives
    finally:
        await adapter.close()
