"""The engine conformance suite: one class of behaviours every backend must pass.

Use it like langchain's standard tests — subclass and provide an ``engine_factory`` fixture::

    from engine_adapters.testing.conformance import EngineConformance

    class TestMyConformance(EngineConformance):
        max_model_len = 512          # what the factory configures
        max_running = 2              # engine-side concurrency limit the factory configures

        @pytest.fixture
        def engine_factory(self):
            async def make():
                engine = MyAdapter(...)
                await engine.start()
                return engine
            return make

        def valid_weights(self, engine, version):  # names → tensors the model accepts
            ...

Override ``engine`` instead (e.g. module-scoped) when starting an engine is expensive; the
tests use fresh trajectory ids and read the served version before loading a new one, so one
engine can serve all of them. Name the subclass ``Test<Backend>Conformance`` so that
``pytest -k "conformance and <backend>"`` selects it. Nothing here is skipped: a backend that
cannot start fails.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import pytest

from engine_adapters._contract import (
    EngineAdapter,
    EngineSnapshot,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
)
from engine_adapters.errors import (
    EngineUnavailable,
    InvalidRequest,
    InvalidWeights,
    PromptTooLong,
    UnknownTrajectory,
)

EngineFactory = Callable[[], Awaitable[EngineAdapter]]

T = TypeVar("T")


def _tid(tag: str) -> str:
    return f"conf-{tag}-{uuid.uuid4().hex[:10]}"


class EngineConformance:
    """Behaviours of the :class:`~engine_adapters.EngineAdapter` contract (see module doc)."""

    #: max context (prompt + response) the factory's engine accepts
    max_model_len: int = 512
    #: at most this many trajectories run at once inside the engine (the rest wait)
    max_running: int = 2
    #: max_new_tokens for "long" requests that are interrupted long before they end
    long_tokens: int = 400
    #: a resumed greedy trajectory reproduces the uninterrupted one token for token
    exact_resume: bool = True
    #: seconds to wait for an engine-side condition before failing
    wait_timeout_s: float = 60.0

    # ------------------------------------------------------------------ hooks
    @pytest.fixture
    def engine_factory(self) -> EngineFactory:
        raise NotImplementedError("subclass EngineConformance and provide engine_factory")

    @pytest.fixture
    async def engine(self, engine_factory: EngineFactory) -> AsyncIterator[EngineAdapter]:
        engine = await engine_factory()
        try:
            yield engine
        finally:
            await engine.close()

    def prompt(self, n: int = 8, offset: int = 0) -> tuple[int, ...]:
        """A prompt of ``n`` valid token ids (override if the vocabulary is unusual)."""
        return tuple(17 + (offset + 5 * i) % 200 for i in range(n))

    def valid_weights(self, engine: EngineAdapter, version: int) -> Mapping[str, Any]:
        """Named tensors the engine accepts as a new version (override per backend)."""
        raise NotImplementedError("subclass must provide valid_weights")

    def broken_weights(self, good: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
        """Invalid variants of ``good``: a tensor missing, one extra, one mis-shaped."""
        names = sorted(good)
        first = good[names[0]]
        missing = {k: v for k, v in good.items() if k != names[0]}
        extra = {**good, "conformance.bogus.weight": first}
        if isinstance(first, tuple):
            wrong = (*first[:-1], first[-1] + 1)
        else:
            wrong = first[..., :-1] if first.shape[-1] > 1 else first.reshape(-1)[:0]
        misshaped = {**good, names[0]: wrong}
        return {"missing": missing, "extra": extra, "misshaped": misshaped}

    # ------------------------------------------------------------------ helpers
    def request(
        self,
        tag: str,
        *,
        max_new_tokens: int = 16,
        stop: tuple[int, ...] = (),
        prompt: tuple[int, ...] | None = None,
        resume: GenerateResult | None = None,
    ) -> GenerateRequest:
        return GenerateRequest(
            trajectory_id=resume.trajectory_id if resume is not None else _tid(tag),
            prompt_token_ids=prompt if prompt is not None else self.prompt(),
            sampling=SamplingParams(
                temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=stop, seed=1234
            ),
            generated_token_ids=resume.token_ids if resume else (),
            generated_logprobs=resume.logprobs if resume else (),
            generated_versions=resume.versions if resume else (),
        )

    async def wait_for(
        self,
        engine: EngineAdapter,
        predicate: Callable[[EngineSnapshot], bool],
        what: str,
    ) -> EngineSnapshot:
        deadline = time.monotonic() + self.wait_timeout_s
        while True:
            snap = await engine.snapshot()
            if predicate(snap):
                return snap
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; last snapshot: {snap}")
            await asyncio.sleep(0.01)

    async def within(self, aw: Awaitable[T]) -> T:
        """``await aw``, failing after ``wait_timeout_s`` (``asyncio.timeout``: on Python 3.11
        ``asyncio.wait_for`` can swallow a cancellation that lands as ``aw`` completes)."""
        async with asyncio.timeout(self.wait_timeout_s):
            return await aw

    @staticmethod
    def check_result(result: GenerateResult, request: GenerateRequest) -> None:
        n = len(result.token_ids)
        assert result.trajectory_id == request.trajectory_id
        assert len(result.logprobs) == n == len(result.versions)
        assert n <= request.sampling.max_new_tokens
        assert isinstance(result.finish_reason, FinishReason)
        assert all(lp <= 0.0 for lp in result.logprobs), result.logprobs
        prior = len(request.generated_token_ids)
        assert result.token_ids[:prior] == request.generated_token_ids
        assert result.versions[:prior] == request.generated_versions

    # ------------------------------------------------------------------ generate
    async def test_generate_returns_aligned_tokens(self, engine: EngineAdapter) -> None:
        req = self.request("basic", max_new_tokens=16)
        result = await self.within(engine.generate(req))
        self.check_result(result, req)
        # no stop ids: generation ends only at max_new_tokens (no implicit EOS)
        assert len(result.token_ids) == 16
        assert result.finish_reason is FinishReason.LENGTH
        assert set(result.versions) == {engine.version}

    @pytest.mark.parametrize("max_new", [1, 7])
    async def test_max_new_tokens_respected(self, engine: EngineAdapter, max_new: int) -> None:
        req = self.request("maxnew", max_new_tokens=max_new)
        result = await self.within(engine.generate(req))
        self.check_result(result, req)
        assert len(result.token_ids) == max_new
        assert result.finish_reason is FinishReason.LENGTH

    async def test_stop_token_respected(self, engine: EngineAdapter) -> None:
        free = await engine.generate(self.request("free", max_new_tokens=32))
        stop = free.token_ids[6]
        first = free.token_ids.index(stop)
        req = self.request("stop", max_new_tokens=32, stop=(stop,))
        result = await self.within(engine.generate(req))
        self.check_result(result, req)
        assert result.finish_reason is FinishReason.STOP
        assert result.token_ids == free.token_ids[: first + 1]
        assert result.token_ids[-1] == stop and stop not in result.token_ids[:-1]

    async def test_concurrent_generates(self, engine: EngineAdapter) -> None:
        reqs = [
            self.request(f"conc{i}", max_new_tokens=5 + i, prompt=self.prompt(6, i))
            for i in range(self.max_running + 2)
        ]
        results = await self.within(asyncio.gather(*(engine.generate(r) for r in reqs)))
        for req, res in zip(reqs, results, strict=True):
            self.check_result(res, req)
            assert len(res.token_ids) == req.sampling.max_new_tokens

    async def test_resume_returns_whole_trajectory(self, engine: EngineAdapter) -> None:
        whole = await engine.generate(self.request("whole", max_new_tokens=24))
        head = await engine.generate(self.request("head", max_new_tokens=10))
        assert head.finish_reason is FinishReason.LENGTH and len(head.token_ids) == 10
        req = self.request("resume", max_new_tokens=24, resume=head)
        result = await self.within(engine.generate(req))
        self.check_result(result, req)
        assert len(result.token_ids) == 24
        assert result.finish_reason is FinishReason.LENGTH
        assert result.logprobs[:10] == head.logprobs
        if self.exact_resume:
            assert result.token_ids == whole.token_ids

    # ------------------------------------------------------------------ interrupt
    async def test_interrupt_running_returns_partial(self, engine: EngineAdapter) -> None:
        req = self.request("int", max_new_tokens=self.long_tokens)
        task = asyncio.create_task(engine.generate(req))
        await self.wait_for(
            engine,
            lambda s: any(
                r.trajectory_id == req.trajectory_id and r.generated_tokens > 0 for r in s.running
            ),
            "the trajectory to generate tokens",
        )
        (partial,) = await engine.interrupt([req.trajectory_id])
        self.check_result(partial, req)
        assert partial.finish_reason is FinishReason.INTERRUPTED
        assert 0 < len(partial.token_ids) < self.long_tokens
        resolved = await self.within(task)
        assert resolved == partial
        snap = await engine.snapshot()
        assert req.trajectory_id not in {r.trajectory_id for r in snap.running}

    async def test_interrupt_all_includes_waiting(self, engine: EngineAdapter) -> None:
        reqs = [
            self.request(f"all{i}", max_new_tokens=self.long_tokens, prompt=self.prompt(8, i))
            for i in range(self.max_running + 2)
        ]
        tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
        await self.wait_for(
            engine,
            lambda s: s.waiting >= 1 and any(r.generated_tokens > 0 for r in s.running),
            "running trajectories with tokens and a waiting queue",
        )
        partials = await engine.interrupt(None)
        ids = [p.trajectory_id for p in partials]
        assert sorted(ids) == sorted(r.trajectory_id for r in reqs)  # each exactly once
        resolved = await self.within(asyncio.gather(*tasks))
        by_id = {p.trajectory_id: p for p in partials}
        for req, res in zip(reqs, resolved, strict=True):
            self.check_result(res, req)
            assert res.finish_reason is FinishReason.INTERRUPTED
            assert by_id[req.trajectory_id] == res
        assert any(len(p.token_ids) > 0 for p in partials)
        assert any(len(p.token_ids) == 0 for p in partials)  # the ones still waiting
        snap = await engine.snapshot()
        assert snap.running == () and snap.waiting == 0

    async def test_interrupt_one_waiting_trajectory(self, engine: EngineAdapter) -> None:
        reqs = [
            self.request(f"w{i}", max_new_tokens=self.long_tokens, prompt=self.prompt(8, i))
            for i in range(self.max_running + 1)
        ]
        tasks = {r.trajectory_id: asyncio.create_task(engine.generate(r)) for r in reqs}
        snap = await self.wait_for(
            engine, lambda s: s.waiting >= 1 and len(s.running) >= 1, "a waiting trajectory"
        )
        running = {r.trajectory_id for r in snap.running}
        waiting_id = next(r.trajectory_id for r in reqs if r.trajectory_id not in running)
        (part,) = await engine.interrupt([waiting_id])
        assert part.trajectory_id == waiting_id
        assert part.finish_reason is FinishReason.INTERRUPTED
        assert await tasks.pop(waiting_id) == part
        after = await engine.snapshot()
        assert running <= {r.trajectory_id for r in after.running}  # still running
        rest = await engine.interrupt(list(tasks))
        assert sorted(p.trajectory_id for p in rest) == sorted(tasks)
        await self.within(asyncio.gather(*tasks.values()))

    async def test_interrupt_unknown_id_stops_nothing(self, engine: EngineAdapter) -> None:
        req = self.request("unk", max_new_tokens=self.long_tokens)
        task = asyncio.create_task(engine.generate(req))
        await self.wait_for(
            engine,
            lambda s: any(r.trajectory_id == req.trajectory_id for r in s.running),
            "the trajectory to run",
        )
        with pytest.raises(UnknownTrajectory) as info:
            await engine.interrupt([req.trajectory_id, "conformance-no-such-id"])
        assert "conformance-no-such-id" in info.value.trajectory_ids
        snap = await engine.snapshot()
        assert req.trajectory_id in {r.trajectory_id for r in snap.running}
        assert not task.done()
        (partial,) = await engine.interrupt([req.trajectory_id])
        assert await task == partial

    # ------------------------------------------------------------------ weights
    async def test_load_weights_changes_version(self, engine: EngineAdapter) -> None:
        old = engine.version
        new = old + 1
        served = await self.within(engine.load_weights(new, self.valid_weights(engine, new)))
        assert served == new == engine.version
        assert (await engine.snapshot()).version == new
        result = await engine.generate(self.request("afterload", max_new_tokens=8))
        assert set(result.versions) == {new}

    async def test_versions_span_a_load_across_resume(self, engine: EngineAdapter) -> None:
        old = engine.version
        head = await engine.generate(self.request("vhead", max_new_tokens=6))
        assert set(head.versions) == {old}
        await engine.load_weights(old + 1, self.valid_weights(engine, old + 1))
        result = await engine.generate(self.request("vtail", max_new_tokens=14, resume=head))
        assert result.versions == (old,) * 6 + (old + 1,) * 8

    @pytest.mark.parametrize("kind", ["missing", "extra", "misshaped"])
    async def test_bad_weights_rejected_engine_keeps_serving(
        self, engine: EngineAdapter, kind: str
    ) -> None:
        old = engine.version
        bad = self.broken_weights(self.valid_weights(engine, old + 1))[kind]
        with pytest.raises(InvalidWeights):
            await engine.load_weights(old + 1, bad)
        assert engine.version == old
        assert (await engine.snapshot()).version == old
        result = await engine.generate(self.request("afterbad", max_new_tokens=4))
        assert len(result.token_ids) == 4 and set(result.versions) == {old}

    # ------------------------------------------------------------------ snapshot
    async def test_snapshot_fields_are_sane(self, engine: EngineAdapter) -> None:
        first = await engine.snapshot()
        req = self.request("snap", max_new_tokens=self.long_tokens)
        task = asyncio.create_task(engine.generate(req))
        snap = await self.wait_for(
            engine,
            lambda s: any(
                r.trajectory_id == req.trajectory_id and r.generated_tokens > 0 for r in s.running
            ),
            "the trajectory to generate tokens",
        )
        assert snap.instance_id == first.instance_id == engine.instance_id
        assert snap.seq > first.seq
        assert snap.time_s >= first.time_s
        assert snap.version == engine.version
        (mine,) = [r for r in snap.running if r.trajectory_id == req.trajectory_id]
        assert mine.prompt_tokens == len(req.prompt_token_ids)
        assert 0 < mine.generated_tokens < self.long_tokens
        assert snap.waiting >= 0
        assert snap.kv_capacity_tokens > 0
        assert mine.prompt_tokens <= snap.kv_used_tokens <= snap.kv_capacity_tokens
        assert 0.0 < snap.kv_usage <= 1.0
        assert snap.throughput_tokens_per_s >= 0.0
        assert snap.decode_steps >= first.decode_steps >= 0  # 0 where the engine keeps none
        await engine.interrupt([req.trajectory_id])
        await task

    # ------------------------------------------------------------------ bad input
    async def test_empty_prompt_is_rejected(self, engine: EngineAdapter) -> None:
        with pytest.raises(InvalidRequest) as info:
            GenerateRequest(trajectory_id=_tid("empty"), prompt_token_ids=())
        assert info.value.field == "prompt_token_ids"

    async def test_prompt_longer_than_context_is_rejected(self, engine: EngineAdapter) -> None:
        req = self.request("long", max_new_tokens=4, prompt=self.prompt(self.max_model_len + 1))
        with pytest.raises(PromptTooLong):
            await engine.generate(req)
        result = await engine.generate(self.request("afterlong", max_new_tokens=3))
        assert len(result.token_ids) == 3
        snap = await engine.snapshot()
        assert req.trajectory_id not in {r.trajectory_id for r in snap.running}

    async def test_a_live_engine_is_healthy(self, engine: EngineAdapter) -> None:
        await engine.check_health()  # raises if it found the engine dead

    async def test_closed_engine_is_unavailable(self, engine_factory: EngineFactory) -> None:
        engine = await engine_factory()
        await engine.close()
        with pytest.raises(EngineUnavailable):
            await engine.generate(self.request("closed", max_new_tokens=2))
        await engine.check_health()  # closed is not dead: nothing to report
