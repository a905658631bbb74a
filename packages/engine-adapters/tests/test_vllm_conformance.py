"""The vLLM backend against a real vLLM-CPU engine: vLLM-specific behaviours, then the shared
conformance suite.

One engine serves the whole module (starting one costs 20-70 s on 2 shared cores), so every
test runs in the module's event loop. The conformance suite's last test closes that engine on
purpose (closed engines must refuse work); the pool restarts it if anything runs afterwards.
Nothing here skips: if vLLM cannot start, every test errors.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest
import pytest_asyncio
import torch

from engine_adapters import (
    EngineAdapter,
    EngineError,
    FinishReason,
    GenerateRequest,
    InvalidRequest,
    PromptTooLong,
    SamplingParams,
    SnapshotDecoder,
    SnapshotEncoder,
    create_engine,
    write_profile_jsonl,
)
from engine_adapters.testing.conformance import EngineConformance, EngineFactory
from engine_adapters.testing.tiny_model import make_tiny_qwen2
from engine_adapters.vllm import VllmAdapter

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

MAX_MODEL_LEN = 512
MAX_RUNNING = 2


def perturbed_weights(model_dir: Path, version: int, scale: float) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors plus version-seeded Gaussian noise (a different model per version)."""
    from safetensors.torch import load_file

    base = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(1000 + version)
    return {
        name: t + scale * torch.randn(t.shape, generator=gen, dtype=t.dtype)
        for name, t in sorted(base.items())
    }


class EnginePool:
    """One shared adapter for the module, (re)started on demand."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.adapter: VllmAdapter | None = None
        self.starts = 0

    async def get(self) -> VllmAdapter:
        if self.adapter is None or self.adapter._closed:
            adapter = create_engine(
                "vllm",
                model_path=self.model_dir,
                instance_id="vllm-test",
                max_model_len=MAX_MODEL_LEN,
                max_num_seqs=MAX_RUNNING,
                num_gpu_blocks_override=64,
            )
            assert isinstance(adapter, VllmAdapter)
            await adapter.start()
            self.adapter = adapter
            self.starts += 1
        return self.adapter

    async def close(self) -> None:
        if self.adapter is not None:
            await self.adapter.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(model_dir: Path) -> AsyncIterator[EnginePool]:
    pool = EnginePool(model_dir)
    yield pool
    await pool.close()


@pytest_asyncio.fixture(loop_scope="module")
async def vllm(pool: EnginePool) -> VllmAdapter:
    adapter = await pool.get()
    assert not adapter._active, "a previous test left trajectories in flight"
    return adapter


def req(tid: str, prompt: tuple[int, ...] = (5, 6, 7, 8), **sampling: Any) -> GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    return GenerateRequest(
        trajectory_id=tid, prompt_token_ids=prompt, sampling=SamplingParams(**sampling)
    )


def hf_greedy(model_dir: Path, weights: Mapping[str, torch.Tensor], prompt: list[int], n: int):
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.load_state_dict(dict(weights), strict=True)
    ids = list(prompt)
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            lp = torch.log_softmax(logits.double(), dim=-1)
            tok = int(torch.argmax(logits))
            tokens.append(tok)
            logprobs.append(float(lp[tok]))
            ids.append(tok)
    return tokens, logprobs


class TestVllmBackend:
    """Behaviours specific to the vLLM adapter (beyond the shared contract)."""

    async def test_load_weights_matches_hf_greedy(self, vllm: VllmAdapter, model_dir: Path) -> None:
        version = vllm.version + 1
        weights = perturbed_weights(model_dir, version, scale=0.5)
        before = await vllm.generate(req("hf-before", max_new_tokens=12))
        assert await vllm.load_weights(version, weights) == version
        after = await vllm.generate(req("hf-after", max_new_tokens=12))
        assert after.token_ids != before.token_ids
        assert set(after.versions) == {version}
        tokens, logprobs = hf_greedy(model_dir, weights, [5, 6, 7, 8], 12)
        assert list(after.token_ids) == tokens
        assert max(abs(a - b) for a, b in zip(after.logprobs, logprobs, strict=True)) < 1e-3

    async def test_keep_mode_load_mid_generation_versions_tokens(
        self, vllm: VllmAdapter, model_dir: Path
    ) -> None:
        old = vllm.version
        task = asyncio.create_task(vllm.generate(req("keep", max_new_tokens=400)))
        while not any(r.generated_tokens >= 5 for r in (await vllm.snapshot()).running):
            await asyncio.sleep(0.01)
        await vllm.load_weights(old + 1, perturbed_weights(model_dir, old + 1, 0.1))
        while not any(r.generated_tokens >= 40 for r in (await vllm.snapshot()).running):
            await asyncio.sleep(0.01)
        (partial,) = await vllm.interrupt(["keep"])
        assert await task == partial
        assert partial.finish_reason is FinishReason.INTERRUPTED
        k = partial.versions.index(old + 1)  # first token made by the new weights
        assert k >= 5
        assert partial.versions == (old,) * k + (old + 1,) * (len(partial.versions) - k)

    async def test_abort_mode_load_interrupts_in_flight(
        self, vllm: VllmAdapter, model_dir: Path
    ) -> None:
        old = vllm.version
        tasks = [
            asyncio.create_task(vllm.generate(req(f"abort{i}", (9, 10 + i), max_new_tokens=400)))
            for i in range(MAX_RUNNING + 1)
        ]
        while not any(r.generated_tokens > 0 for r in (await vllm.snapshot()).running):
            await asyncio.sleep(0.01)
        await vllm.load_weights(old + 1, perturbed_weights(model_dir, old + 1, 0.1), mode="abort")
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert all(r.finish_reason is FinishReason.INTERRUPTED for r in results)
        assert all(set(r.versions) <= {old} for r in results)
        assert any(r.token_ids for r in results)
        snap = await vllm.snapshot()
        assert snap.running == () and snap.waiting == 0 and snap.version == old + 1

    async def test_engine_scheduler_stats_are_captured(self, vllm: VllmAdapter) -> None:
        task = asyncio.create_task(vllm.generate(req("stats", max_new_tokens=400)))
        while vllm.scheduler_stats().num_running < 1:
            await asyncio.sleep(0.01)
        stats = vllm.scheduler_stats()
        assert 0.0 < stats.kv_cache_usage <= 1.0
        snap = await vllm.snapshot()
        assert snap.kv_capacity_tokens == vllm.kv_capacity_tokens > 0
        assert snap.kv_used_tokens >= 4
        await vllm.interrupt(["stats"])
        await task
        assert (await vllm.snapshot()).throughput_tokens_per_s > 0.0

    async def test_snapshot_deltas_rebuild_the_snapshot(self, vllm: VllmAdapter) -> None:
        """Polled through the snapshot codec while two trajectories decode and a third waits
        for a slot: every decoded snapshot equals the adapter's; a trajectory that decodes
        steadily follows ``decode_steps``, so few entries are sent per poll."""
        enc, dec = SnapshotEncoder(), SnapshotDecoder(vllm.instance_id)
        tasks = {
            f"delta{i}": asyncio.create_task(
                vllm.generate(req(f"delta{i}", (5, 6 + i), max_new_tokens=60 + 40 * i))
            )
            for i in range(MAX_RUNNING + 1)
        }
        steps0 = (await vllm.snapshot()).decode_steps
        reported: set[str] = set()
        added = polled = 0
        while len(reported) < len(tasks):
            await asyncio.sleep(0.02)
            ended = {t for t, task in tasks.items() if task.done()} - reported
            reported |= ended
            snap = await vllm.snapshot()
            delta = enc.encode(snap, **dec.request(), ended=ended)
            got = dec.decode(delta, time_s=snap.time_s, ended=ended)
            # every field but the order of running and seq (the receiver numbers its own)
            assert got is not None and attrs.evolve(got, running=(), seq=0) == attrs.evolve(
                snap, running=(), seq=0
            )
            assert {r.trajectory_id: r for r in got.running} == {
                r.trajectory_id: r for r in snap.running
            }
            added += sum(len(g) - 3 for g in delta.get("add", ())) if delta else 0
            polled += len(snap.running)
        results = await asyncio.gather(*tasks.values())
        assert [len(r.token_ids) for r in results] == [60, 100, 140]
        steps = (await vllm.snapshot()).decode_steps - steps0
        assert steps >= 140  # one step per token of the longest at least
        # one entry per trajectory when it starts (measured on vLLM-CPU: 3 entries over 33 and
        # over 538 running trajectories polled); a count that lags the step counter is resent
        assert polled > 20 and added <= len(tasks) + 4, (added, polled)

    async def test_duplicate_and_out_of_vocab_requests_rejected(self, vllm: VllmAdapter) -> None:
        task = asyncio.create_task(vllm.generate(req("dup", max_new_tokens=400)))
        await asyncio.sleep(0)
        with pytest.raises(InvalidRequest) as info:
            await vllm.generate(req("dup", max_new_tokens=4))
        assert info.value.field == "trajectory_id"
        await vllm.interrupt(["dup"])
        await task
        with pytest.raises(InvalidRequest) as info:
            await vllm.generate(req("oov", (5, 100_000), max_new_tokens=4))
        assert info.value.field == "prompt_token_ids"
        with pytest.raises(InvalidRequest) as info:
            await vllm.load_weights(-1, {})
        assert info.value.field == "version"

    async def test_resumed_prompt_counts_toward_context(self, vllm: VllmAdapter) -> None:
        generated = tuple(range(20, 20 + 300))
        request = GenerateRequest(
            trajectory_id="ctx",
            prompt_token_ids=tuple(range(10, 10 + 250)),
            sampling=SamplingParams(temperature=0.0, max_new_tokens=400),
            generated_token_ids=generated,
            generated_logprobs=(-1.0,) * 300,
            generated_versions=(0,) * 300,
        )
        with pytest.raises(PromptTooLong) as info:
            await vllm.generate(request)
        assert "ctx" in str(info.value) and "550" in str(info.value)

    async def test_profile_points(self, vllm: VllmAdapter, tmp_path: Path) -> None:
        points = await vllm.profile([(1, 64), (2, 512)], steps=6)
        assert [(p.running, p.kv_tokens) for p in points] == [(1, 64), (2, 512)]
        assert all(0.0 < p.step_latency_s < 5.0 and p.backend == "vllm" for p in points)
        out = tmp_path / "profile.jsonl"
        assert write_profile_jsonl(points, out) == 2
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert rows[1]["running"] == 2 and rows[1]["kv_tokens"] == 512
        with pytest.raises(InvalidRequest) as info:
            await vllm.profile([(1, 64), (MAX_RUNNING + 1, 256)])
        assert info.value.field == "points"
        with pytest.raises(InvalidRequest):
            await vllm.profile([(1, MAX_MODEL_LEN * 4)])

    async def test_profile_decodes_with_the_rollouts_sampling(
        self, vllm: VllmAdapter, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The profile's requests are built as generate's (one log-probability a token, the
        rollout's temperature, top-p and seed), stop tokens left out: it times the rollout's
        own decode steps."""
        import engine_adapters.vllm._adapter as adapter_module

        seen: list[Any] = []
        real = adapter_module.measure_points

        async def spy(engine: Any, points: Any, **kw: Any) -> Any:
            seen.append(kw["params"])
            return await real(engine, points, **kw)

        monkeypatch.setattr(adapter_module, "measure_points", spy)
        sampling = SamplingParams(temperature=0.7, top_p=0.9, seed=5, stop_token_ids=(3,))
        points = await vllm.profile([(2, 64)], steps=6, sampling=sampling)
        assert len(points) == 1 and points[0].step_latency_s > 0
        (params,) = seen
        rollout = vllm._sampling_params(
            GenerateRequest(trajectory_id="x", prompt_token_ids=(5,), sampling=sampling)
        )
        assert (params.temperature, params.top_p, params.seed) == (0.7, 0.9, 5)
        assert params.logprobs == rollout.logprobs == 1
        assert params.output_kind == rollout.output_kind and params.ignore_eos
        assert params.max_tokens == 7 and not params.stop_token_ids
        assert list(rollout.stop_token_ids) == [3]

    async def test_profile_refuses_busy_engine(self, vllm: VllmAdapter) -> None:
        task = asyncio.create_task(vllm.generate(req("busy", max_new_tokens=400)))
        await asyncio.sleep(0)
        with pytest.raises(EngineError):
            await vllm.profile([(1, 64)])
        await vllm.interrupt(["busy"])
        await task

    async def test_unknown_engine_argument_is_named(self, model_dir: Path) -> None:
        adapter = VllmAdapter.from_config(model_path=model_dir, max_num_seqz=4)
        with pytest.raises(InvalidRequest) as info:
            await adapter.start()
        assert info.value.field == "max_num_seqz"


class TestVllmConformance(EngineConformance):
    max_model_len = MAX_MODEL_LEN
    max_running = MAX_RUNNING
    long_tokens = 400
    wait_timeout_s = 60.0

    @pytest.fixture
    def engine_factory(self, pool: EnginePool) -> EngineFactory:
        async def make() -> EngineAdapter:
            return await pool.get()

        return make

    @pytest_asyncio.fixture(loop_scope="module")
    async def engine(self, vllm: VllmAdapter) -> VllmAdapter:  # shared, not closed per test
        return vllm

    def valid_weights(self, engine: EngineAdapter, version: int) -> Mapping[str, Any]:
        assert isinstance(engine, VllmAdapter)
        return perturbed_weights(engine.config.model_path, version, scale=0.1)
