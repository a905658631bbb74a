"""Decode-step latency measurement at chosen (running trajectories, KV tokens) points.

The cost model ``τ(n, kv)`` in the coordinator is fitted on these points. For a point
``(n, kv)`` we launch ``n`` requests whose prompts make the batch hold about ``kv`` KV tokens in
the middle of the measured window, let them decode ``steps`` tokens together, and time the
decode phase only: from the moment the last request received its first token (all prefills
done) to the last token, divided by the number of decode steps in between.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Sequence
from typing import Any

from engine_adapters._contract import ProfilePoint
from engine_adapters.errors import InvalidRequest


def _check_point(
    n: int, kv: int, *, steps: int, max_model_len: int, max_num_seqs: int, kv_capacity: int
) -> int:
    """Validate one point; return the prompt length to use."""
    if n < 1 or n > max_num_seqs:
        raise InvalidRequest(
            f"profile point ({n}, {kv}): running must be in [1, max_num_seqs={max_num_seqs}]",
            field="points",
        )
    if kv_capacity and kv > kv_capacity:
        raise InvalidRequest(
            f"profile point ({n}, {kv}): kv_tokens exceeds the KV capacity {kv_capacity}",
            field="points",
        )
    prompt_len = kv // n - steps // 2
    if prompt_len < 1 or prompt_len + steps + 1 > max_model_len:
        lo, hi = n * (1 + steps // 2), n * (max_model_len - steps - 1 + steps // 2)
        raise InvalidRequest(
            f"profile point ({n}, {kv}): with {n} running and steps={steps}, kv_tokens must "
            f"be in [{lo}, {hi}] (max_model_len={max_model_len})",
            field="points",
        )
    return prompt_len


async def _run_one(
    engine: Any,
    n: int,
    prompt_len: int,
    *,
    steps: int,
    vocab_size: int,
    rng: random.Random,
    params: Any,
) -> float:
    from vllm.inputs import TokensPrompt

    salt = uuid.uuid4().hex  # no prefix-cache hits from earlier points
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(n)]

    async def one(i: int) -> None:
        prompt = TokensPrompt(
            prompt_token_ids=[rng.randrange(vocab_size) for _ in range(prompt_len)],
            cache_salt=salt,
        )
        async for out in engine.generate(prompt, params, f"profile-{salt}-{i}"):
            k = len(out.outputs[0].token_ids)
            if k:
                arrivals[i].append((time.perf_counter(), k))

    await asyncio.gather(*(one(i) for i in range(n)))
    t_start = max(a[0][0] for a in arrivals)
    t_end = max(a[-1][0] for a in arrivals)
    decode_steps = max(sum(k for t, k in a if t > t_start) for a in arrivals)
    if decode_steps == 0:
        raise InvalidRequest(
            f"profile point with {n} running measured no decode step", field="steps"
        )
    return (t_end - t_start) / decode_steps


async def measure_points(
    engine: Any,
    points: Sequence[tuple[int, int]],
    *,
    steps: int,
    max_model_len: int,
    max_num_seqs: int,
    kv_capacity: int,
    vocab_size: int,
    seed: int,
    backend: str,
    params: Any,
) -> list[ProfilePoint]:
    """For each point, ``running`` requests with random prompts of ``kv/running - steps/2``
    tokens decode ``steps`` tokens together; the latency is the time from the moment all of
    them have their first token to the last token, divided by the decode steps in between.
    ``params`` are vLLM's sampling parameters for each request (the rollout's, through
    :func:`engine_adapters.vllm._sampling.vllm_sampling_params`, ``steps + 1`` new tokens)."""
    plan = [
        (
            int(n),
            int(kv),
            _check_point(
                int(n),
                int(kv),
                steps=steps,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                kv_capacity=kv_capacity,
            ),
        )
        for n, kv in points
    ]  # validate every point before running any
    rng = random.Random(seed)
    results = []
    for n, kv, prompt_len in plan:
        latency = await _run_one(
            engine, n, prompt_len, steps=steps, vocab_size=vocab_size, rng=rng, params=params
        )
        results.append(
            ProfilePoint(running=n, kv_tokens=kv, step_latency_s=latency, backend=backend)
        )
    return results
