"""The vLLM backend: one V1 ``AsyncLLM`` per rollout instance.

Theory of operation
-------------------
* **Process layout.** ``AsyncLLM`` always runs its EngineCore in a spawned child process (the
  ``VLLM_ENABLE_V1_MULTIPROCESSING`` switch only makes the *synchronous* ``LLM`` in-process).
  We set it to 0 on CPU anyway, because vLLM's CPU platform otherwise turns the ``uni`` executor
  into ``mp`` and adds a third process; with ``uni`` the model worker lives inside the
  EngineCore process. Scripts that start an adapter need an ``if __name__ == "__main__":``
  guard (spawn re-imports the main module).
* **Generate.** Each call becomes one vLLM request (id ``<trajectory>@<n>``) with
  ``ignore_eos=True`` and explicit ``stop_token_ids``, so generation stops only at the caller's
  stop tokens or ``max_new_tokens``. Outputs stream as DELTAs (vLLM merges deltas if we fall
  behind, so none are lost); ``logprobs=1`` gives the sampled token's log-prob. A resumed
  trajectory is a fresh request whose prompt is prompt + already generated tokens and whose
  budget is what remains of ``max_new_tokens``; the result covers the whole trajectory.
* **Versions.** The EngineCore stamps each step's outputs with its weight version, which we set
  to ``str(version)`` while generation is paused for a load; vLLM returns per-token version spans
  with the final output. So tokens produced before a load carry the old version, after it the
  new one, with no race on our side.
* **Interrupt.** ``AsyncLLM.abort`` makes the output processor emit a final ``abort`` output
  carrying every token not yet delivered, for running and waiting requests alike; the pending
  ``generate`` resolves with it and ``interrupt`` returns the same result objects.
* **Load weights.** Validate names/shapes against the checkpoint schema first; then pause
  (``keep``: in-flight requests freeze and continue on the new weights; ``abort``: they are
  interrupted), reload through the worker extension, set the engine's weight version, reset the
  prefix cache, resume. Requests carry ``cache_salt=v<version>`` so a prefix computed under old
  weights is never reused by a request submitted under new ones even when the reset is refused
  (vLLM refuses it while requests hold blocks). If the reload itself fails after validation the
  engine stays paused and the adapter refuses further work: half-loaded weights never serve.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import structlog

from engine_adapters._contract import (
    EngineAdapter,
    EngineSnapshot,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    ProfilePoint,
    RunningTrajectory,
    SamplingParams,
)
from engine_adapters.errors import (
    BackendNotInstalled,
    EngineDead,
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    PromptTooLong,
    UnknownTrajectory,
)
from engine_adapters.vllm._config import DEFAULT_ENVIRONMENT, LOAD_MODES, VllmConfig
from engine_adapters.vllm._inflight import InFlight
from engine_adapters.vllm._profile import measure_points
from engine_adapters.vllm._sampling import vllm_sampling_params
from engine_adapters.vllm._stats import EngineStats, SchedulerView, stat_logger_factory
from engine_adapters.vllm._weights import WeightSchema
from engine_adapters.vllm._worker import encode_tensors

log = structlog.get_logger("engine_adapters.vllm")

_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.INTERRUPTED,
}


def _import_vllm() -> Any:
    try:
        import vllm
        from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401
    except ImportError as e:
        raise BackendNotInstalled("vllm", "vllm", e) from e
    return vllm


class VllmAdapter(EngineAdapter):
    """:class:`EngineAdapter` over vLLM's V1 ``AsyncLLM`` (see the module docstring)."""

    backend = "vllm"

    def __init__(self, config: VllmConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._version = config.initial_version
        self._engine: Any = None
        self._closed = False
        self._broken: str | None = None
        self._schema: WeightSchema | None = None
        self._vocab_size = 0
        self._kv_capacity = 0
        self._stats = EngineStats(window_s=config.throughput_window_s, clock=clock)
        self._active: dict[str, InFlight] = {}
        self._ids = itertools.count()
        self._seq = itertools.count()
        self._load_lock = asyncio.Lock()
        self._serving: asyncio.Event | None = None  # cleared while weights load
        self._log = log.bind(instance=config.instance_id)

    @classmethod
    def from_config(
        cls,
        *,
        model_path: str | os.PathLike[str],
        instance_id: str = "vllm-0",
        max_model_len: int = 1024,
        gpu_memory_utilization: float = 0.9,
        seed: int = 0,
        **engine_kwargs: Any,
    ) -> VllmAdapter:
        """Build from flat keyword config; keys that are :class:`VllmConfig` fields
        (``max_num_seqs``, ``cpu_kv_cache_gib``, ``load_mode``, ``dtype``, …) set those fields,
        everything else goes to ``vllm.AsyncEngineArgs``."""
        fields = {a.name for a in attrs.fields(VllmConfig)}
        own = {k: engine_kwargs.pop(k) for k in list(engine_kwargs) if k in fields}
        extra = dict(own.pop("engine_kwargs", {}) or {})
        extra.update(engine_kwargs)
        config = VllmConfig(
            model_path=model_path,
            instance_id=instance_id,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            engine_kwargs=extra,
            **own,
        )
        return cls(config)

    # ----------------------------------------------------------------- properties

    @property
    def instance_id(self) -> str:
        return self._config.instance_id

    @property
    def version(self) -> int:
        return self._version

    @property
    def config(self) -> VllmConfig:
        return self._config

    @property
    def engine(self) -> Any:
        """The underlying ``AsyncLLM`` (for benchmarks and diagnostics)."""
        return self._require_engine()

    @property
    def kv_capacity_tokens(self) -> int:
        return self._kv_capacity

    def scheduler_stats(self) -> SchedulerView:
        """The latest scheduler numbers vLLM reported (running, waiting, KV usage)."""
        return self._stats.scheduler

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self._engine is not None:
            return
        if self._closed:
            raise EngineUnavailable(f"adapter {self.instance_id!r} is closed")
        _import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        try:
            self._schema = WeightSchema.from_model_dir(self._config.model_path)
        except (OSError, ValueError) as e:
            raise InvalidRequest(
                f"model_path {str(self._config.model_path)!r} is not a local Hugging Face model "
                f"directory with *.safetensors weights: {e}",
                field="model_path",
            ) from e
        # Inherited by the EngineCore child process.
        os.environ.update(self._config.environment())
        for key, value in DEFAULT_ENVIRONMENT.items():
            os.environ.setdefault(key, value)
        engine_args = self._config.engine_args()
        known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise InvalidRequest(
                f"unknown vLLM engine argument(s) {unknown}; see vllm.AsyncEngineArgs",
                field=unknown[0],
            )
        args = AsyncEngineArgs(**engine_args)
        t0 = time.perf_counter()
        try:
            engine = AsyncLLM.from_engine_args(
                args, stat_loggers=[stat_logger_factory(self._stats)]
            )
        except Exception as e:
            raise EngineUnavailable(f"vLLM engine {self.instance_id!r} failed to start: {e}") from e
        self._engine = engine
        self._serving = asyncio.Event()
        self._serving.set()
        await engine.update_weight_version(str(self._version))
        cache = engine.vllm_config.cache_config
        self._kv_capacity = int(cache.num_gpu_blocks or 0) * int(cache.block_size or 0)
        self._vocab_size = int(engine.model_config.get_vocab_size())
        self._log.info(
            "vllm_started",
            model=str(self._config.model_path),
            seconds=round(time.perf_counter() - t0, 2),
            kv_capacity_tokens=self._kv_capacity,
            version=self._version,
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        engine = self._engine
        if engine is None:
            return
        if self._active and self._broken is None and not engine.errored:
            try:
                await self._abort_and_collect(list(self._active.values()))
            except EngineError:  # pragma: no cover - best effort on shutdown
                self._log.warning("close_abort_failed")
        for traj in list(self._active.values()):  # anything still pending (dead engine)
            self._resolve(traj, FinishReason.INTERRUPTED, spans=None)
        engine.shutdown()
        # AsyncLLM.__del__ calls shutdown() again; if the object lives until interpreter exit
        # (a traceback frame holding it, say) that second call fails on torn-down globals.
        # It is already shut down, so make any later call a no-op.
        engine.shutdown = lambda *args, **kwargs: None
        self._engine = None
        self._log.info("vllm_closed")

    async def __aenter__(self) -> VllmAdapter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _require_engine(self) -> Any:
        if self._closed:
            raise EngineUnavailable(f"adapter {self.instance_id!r} is closed")
        if self._engine is None:
            raise EngineUnavailable(f"adapter {self.instance_id!r} is not started; call start()")
        if self._engine.errored:
            raise self._dead()
        if self._broken is not None:
            raise EngineUnavailable(
                f"adapter {self.instance_id!r} stopped serving after a failed weight load: "
                f"{self._broken}"
            )
        return self._engine

    def _dead(self) -> EngineDead:
        return EngineDead(f"vLLM engine {self.instance_id!r} is dead: its EngineCore stopped")

    async def check_health(self) -> None:
        if self._engine is None or self._closed:
            return
        if self._engine.errored:
            raise self._dead()
        if self._broken is not None:  # paused for good: half-loaded weights never serve
            raise EngineDead(f"vLLM engine {self.instance_id!r} can never serve again: "
                             f"{self._broken}; it stays paused")  # fmt: skip

    # ----------------------------------------------------------------- generate

    def _check_request(self, request: GenerateRequest) -> None:
        tid = request.trajectory_id
        if tid in self._active:
            raise InvalidRequest(
                f"trajectory {tid!r} is already generating on {self.instance_id!r}",
                field="trajectory_id",
            )
        prefix = len(request.prompt_token_ids) + len(request.generated_token_ids)
        limit = self._config.max_model_len
        if prefix >= limit:
            raise PromptTooLong(
                f"trajectory {tid!r}: prompt ({len(request.prompt_token_ids)}) + generated "
                f"({len(request.generated_token_ids)}) = {prefix} tokens leaves no room under "
                f"max_model_len={limit}",
                field="prompt_token_ids",
            )
        for field, ids in (
            ("prompt_token_ids", request.prompt_token_ids),
            ("generated_token_ids", request.generated_token_ids),
            ("stop_token_ids", request.sampling.stop_token_ids),
        ):
            bad = [t for t in ids if not 0 <= t < self._vocab_size]
            if bad:
                raise InvalidRequest(
                    f"trajectory {tid!r}: {field} contains ids outside [0, {self._vocab_size}): "
                    f"{bad[:5]}",
                    field=field,
                )

    def _sampling_params(self, request: GenerateRequest) -> Any:
        return vllm_sampling_params(
            request.sampling,
            max_tokens=request.sampling.max_new_tokens - len(request.generated_token_ids),
        )

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        engine = self._require_engine()
        self._check_request(request)
        from vllm.inputs import TokensPrompt

        tid = request.trajectory_id
        traj = InFlight(request, f"{tid}@{next(self._ids)}", self._version)
        self._active[tid] = traj
        try:
            assert self._serving is not None
            await self._serving.wait()  # submitted requests never straddle a weight load
            if traj.interrupt_requested:
                return self._resolve(traj, FinishReason.INTERRUPTED, spans=None)
            engine = self._require_engine()
            traj.submit_version = self._version
            prompt = TokensPrompt(
                prompt_token_ids=[*request.prompt_token_ids, *request.generated_token_ids],
                cache_salt=f"v{self._version}",
            )
            try:
                queue = await engine.add_request(
                    traj.request_id, prompt, self._sampling_params(request)
                )
            except (ValueError, TypeError) as e:
                raise InvalidRequest(f"trajectory {tid!r} rejected by vLLM: {e}") from e
            traj.added = True
            traj.queue = queue
            if traj.interrupt_requested:  # interrupt() arrived while we were adding
                await engine.abort(traj.request_id)
            while True:
                out = queue.get_nowait() or await queue.get()
                result = self._consume(traj, out)
                if result is not None:
                    return result
        except asyncio.CancelledError:
            # Abort even if add_request had not returned: it may have registered the request.
            if self._engine is not None:
                await self._engine.abort(traj.request_id, internal=False)
            self._resolve(traj, FinishReason.INTERRUPTED, spans=None)
            raise
        except EngineError as e:
            await self._fail(traj, e)
            raise
        except Exception as e:
            err = EngineUnavailable(f"vLLM engine {self.instance_id!r} failed: {e!r}")
            if self._engine is not None and self._engine.errored:
                err = self._dead()
            await self._fail(traj, err)
            raise err from e

    async def _fail(self, traj: InFlight, err: BaseException) -> None:
        """A generate call failed: stop its request and fail anyone waiting in interrupt()."""
        self._discard(traj)
        if traj.added and self._engine is not None:
            try:
                await self._engine.abort(traj.request_id, internal=False)
            except Exception:  # the engine may be dead; the original error matters
                self._log.warning("abort_after_failure_failed", request=traj.request_id)
        if not traj.done.done():
            traj.done.set_exception(err)
            traj.done.exception()  # mark retrieved: generate() already raises it

    def _consume(self, traj: InFlight, out: Any) -> GenerateResult | None:
        comp = out.outputs[0]
        new_ids = list(comp.token_ids)
        if new_ids:
            lps = comp.logprobs
            if lps is None or len(lps) != len(new_ids):
                raise EngineError(f"vLLM returned no per-token logprobs for {traj.request_id}")
            for i, tok in enumerate(new_ids):
                traj.logprobs.append(float(lps[i][tok].logprob))
            traj.token_ids.extend(new_ids)
            traj.seen_versions.extend([self._version] * len(new_ids))
            self._stats.record_tokens(len(new_ids))
        if not out.finished:
            return None
        reason = _FINISH.get(str(comp.finish_reason))
        if reason is None:
            raise EngineError(
                f"vLLM finished {traj.request_id} with unexpected reason {comp.finish_reason!r}"
            )
        return self._resolve(traj, reason, spans=comp.weight_versions)

    def _segment_versions(self, traj: InFlight, spans: Any) -> list[int]:
        n = len(traj.token_ids)
        if spans:
            versions: list[int] = []
            try:
                for span in spans:
                    versions.extend([int(span.version)] * (span.end - span.start))
            except ValueError:
                versions = []
            if len(versions) == n:
                return versions
        return traj.seen_versions[:n] if len(traj.seen_versions) >= n else [traj.submit_version] * n

    def _resolve(self, traj: InFlight, reason: FinishReason, *, spans: Any) -> GenerateResult:
        req = traj.request
        result = GenerateResult(
            trajectory_id=req.trajectory_id,
            token_ids=(*req.generated_token_ids, *traj.token_ids),
            logprobs=(*req.generated_logprobs, *traj.logprobs),
            versions=(*req.generated_versions, *self._segment_versions(traj, spans)),
            finish_reason=reason,
        )
        self._discard(traj)
        if not traj.done.done():
            traj.done.set_result(result)
        return result

    def _discard(self, traj: InFlight) -> None:
        if self._active.get(traj.request.trajectory_id) is traj:
            del self._active[traj.request.trajectory_id]

    # ----------------------------------------------------------------- interrupt

    async def interrupt(self, trajectory_ids: Sequence[str] | None = None) -> list[GenerateResult]:
        self._require_engine()
        if trajectory_ids is None:
            targets = list(self._active.values())
        else:
            ids = list(trajectory_ids)
            unknown = [t for t in ids if t not in self._active]
            if unknown:
                raise UnknownTrajectory(unknown)
            targets = [self._active[t] for t in dict.fromkeys(ids)]
        results = await self._abort_and_collect(targets)
        self._log.info("interrupted", trajectories=len(results))
        return results

    async def _abort_and_collect(self, targets: list[InFlight]) -> list[GenerateResult]:
        for traj in targets:
            traj.interrupt_requested = True
        added = [t.request_id for t in targets if t.added]
        if added:
            await self._engine.abort(added, internal=False)
        # Each pending generate() resolves from the abort output; share its result.
        return list(await asyncio.gather(*(asyncio.shield(t.done) for t in targets)))

    # ----------------------------------------------------------------- weights

    async def load_weights(
        self, version: int, named_tensors: Mapping[str, Any], *, mode: str | None = None
    ) -> int:
        """Load ``version`` in place (see the module docstring); ``mode`` overrides the
        configured ``load_mode`` (``"keep"`` or ``"abort"``) for this call."""
        engine = self._require_engine()
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise InvalidRequest(f"version must be an int >= 0, got {version!r}", field="version")
        mode = self._config.load_mode if mode is None else mode
        if mode not in LOAD_MODES:
            raise InvalidRequest(f"mode must be one of {LOAD_MODES}, got {mode!r}", field="mode")
        assert self._schema is not None and self._serving is not None
        names, tensors = self._schema.validate(named_tensors)  # before anything is touched
        async with self._load_lock:
            t0 = time.perf_counter()
            self._serving.clear()
            try:
                await engine.pause_generation(mode=mode, clear_cache=mode == "abort")
                try:
                    await self._send_weights(engine, names, tensors)
                except Exception as e:
                    if engine.errored:
                        raise  # dead, not broken: the handler below says so
                    self._broken = f"reload of version {version} failed: {e}"
                    self._log.error("weight_load_failed", version=version, error=str(e))
                    raise EngineUnavailable(
                        f"{self.instance_id!r}: weight load of version {version} failed after "
                        f"validation; the engine stays paused: {e}"
                    ) from e
                await engine.update_weight_version(str(version))
                previous, self._version = self._version, version
                cache_reset = await engine.reset_prefix_cache()
            except Exception as e:
                if engine.errored:  # died in the pause or the version update
                    raise self._dead() from e
                raise
            finally:
                if self._broken is None and not engine.errored:
                    await engine.resume_generation()
                self._serving.set()
            self._log.info(
                "weights_loaded",
                version=version,
                previous=previous,
                tensors=len(names),
                mode=mode,
                prefix_cache_reset=bool(cache_reset),
                seconds=round(time.perf_counter() - t0, 4),
            )
        return self._version

    async def _send_weights(self, engine: Any, names: list[str], tensors: list[Any]) -> None:
        # Raw bytes: tensors inside collective_rpc arguments do not survive vLLM's utility-call
        # msgpack (they arrive as nested lists) nor the mp executor's pickled broadcast.
        dtypes, shapes, buffers = encode_tensors(tensors)
        await engine.collective_rpc(
            "staleflow_reload_weights_bytes",
            kwargs={"names": names, "dtypes": dtypes, "shapes": shapes, "buffers": buffers},
        )

    # ----------------------------------------------------------------- snapshot

    async def snapshot(self) -> EngineSnapshot:
        self._require_engine()
        # Let the generate tasks take the outputs delivered to their collectors (``output``),
        # so counts and decode_steps describe one step (a lagging count is only resent).
        for _ in range(8):
            await asyncio.sleep(0)
            if not any(getattr(t.queue, "output", None) is not None for t in self._active.values()):
                break
        running = tuple(
            RunningTrajectory(
                trajectory_id=t.request.trajectory_id,
                prompt_tokens=len(t.request.prompt_token_ids),
                generated_tokens=len(t.request.generated_token_ids) + len(t.token_ids),
            )
            for t in self._active.values()
            if t.started
        )
        sched = self._stats.scheduler
        # KV usage comes from the engine; with nothing in flight it is 0 whatever the last
        # (pre-completion) stats said.
        usage = sched.kv_cache_usage if self._active else 0.0
        return EngineSnapshot(
            instance_id=self.instance_id,
            seq=next(self._seq),
            time_s=self._clock(),
            version=self._version,
            running=running,
            waiting=len(self._active) - len(running),
            kv_used_tokens=round(usage * self._kv_capacity),
            kv_capacity_tokens=self._kv_capacity,
            throughput_tokens_per_s=self._stats.throughput(),
            decode_steps=self._stats.steps,
        )

    # ----------------------------------------------------------------- profile

    async def profile(
        self,
        points: Sequence[tuple[int, int]],
        *,
        steps: int = 8,
        sampling: SamplingParams | None = None,
    ) -> list[ProfilePoint]:
        """Per-step decode latency at each (running, KV tokens) point; needs an idle engine
        (how it is measured: :func:`engine_adapters.vllm._profile.measure_points`). The
        requests decode with ``sampling`` (default ``SamplingParams()``) as ``generate``
        would, stop tokens left out."""
        engine = self._require_engine()
        if self._active:
            raise EngineError(
                f"profile needs an idle engine; {len(self._active)} trajectories are in flight"
            )
        if steps < 2:
            raise InvalidRequest(f"steps must be >= 2, got {steps!r}", field="steps")
        return await measure_points(
            engine,
            points,
            steps=steps,
            max_model_len=self._config.max_model_len,
            max_num_seqs=self._config.max_num_seqs,
            kv_capacity=self._kv_capacity,
            vocab_size=self._vocab_size,
            seed=self._config.seed,
            backend=self.backend,
            params=vllm_sampling_params(
                sampling or SamplingParams(), max_tokens=steps + 1, stop=False
            ),
        )
