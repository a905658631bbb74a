"""One rollout instance as an async actor: an engine adapter plus a results outbox.

The control loop talks to it with short calls only:

* ``submit(requests)`` starts one ``generate`` task per request and returns once the engine has
  registered them (so a snapshot taken afterwards already counts them);
* ``poll()`` returns every result produced since the last poll (finished *and* interrupted,
  each exactly once) together with a fresh engine snapshot — results first, so the snapshot never
  shows a trajectory whose result was already handed out as still running;
* ``interrupt(ids)`` stops trajectories; their partial results arrive through ``poll``;
* ``sync(version)`` interrupts everything, pulls the latest version from the parameter server
  over NIXL and loads it in place (the engine never serves half-loaded weights);
* ``quiesce()`` waits for a running sync, interrupts everything and polls (a replacement
  coordinator's first call);
* ``probe(prompt_ids, n)`` greedy-decodes ``n`` tokens of a fixed prompt (tests check that
  served weights really change after a sync).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from engine_adapters import (
    EngineAdapter,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    create_engine,
)
from staleflow_trainer.actors.payloads import request_from_dict, result_to_dict, snapshot_to_dict

log = structlog.get_logger(__name__)


class RolloutActor:
    """Wrap with ``ray.remote(max_concurrency=...)``; every method is async."""

    def __init__(
        self,
        *,
        instance_id: str,
        backend: str,
        engine_kwargs: Mapping[str, Any],
        ps_address: Sequence[Any] | None = None,
        ps_token: str | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.backend = backend
        self._engine_kwargs = dict(engine_kwargs)
        self._ps_address = tuple(ps_address) if ps_address else None
        self._ps_token = ps_token or None
        self._ps: Any = None
        self._engine: EngineAdapter | None = None
        self._tasks: dict[str, asyncio.Task[GenerateResult]] = {}
        self._outbox: list[dict[str, Any]] = []
        self._errors: list[dict[str, Any]] = []
        self._sync_lock = asyncio.Lock()
        self._syncs = 0
        self._log = log.bind(instance=instance_id)

    def _require(self) -> EngineAdapter:
        if self._engine is None:
            raise RuntimeError(f"rollout instance {self.instance_id!r} is not started")
        return self._engine

    async def start(self) -> dict[str, Any]:
        """Create and start the engine; returns ``instance_id``, ``version``, KV capacity."""
        if self._engine is None:
            t0 = time.perf_counter()
            engine = create_engine(
                self.backend, instance_id=self.instance_id, **self._engine_kwargs
            )
            await engine.start()
            self._engine = engine
            self._log.info("rollout_started", seconds=round(time.perf_counter() - t0, 2))
        snap = await self._require().snapshot()
        return {
            "instance_id": self.instance_id,
            "version": snap.version,
            "kv_capacity_tokens": snap.kv_capacity_tokens,
        }

    # ------------------------------------------------------------------------------- generation

    async def submit(self, requests: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Start generating; returns one ``{"trajectory_id", "ok", "error"}`` per request."""
        engine = self._require()
        out = []
        for d in requests:
            tid = str(d.get("trajectory_id", ""))
            try:
                req = request_from_dict(d)
                if tid in self._tasks:
                    raise ValueError(f"trajectory {tid!r} is already running here")
            except Exception as e:  # a bad request is reported, never crashes the instance
                out.append({"trajectory_id": tid, "ok": False, "error": repr(e)})
                continue
            task = asyncio.get_running_loop().create_task(self._run(engine, req))
            self._tasks[tid] = task
            out.append({"trajectory_id": tid, "ok": True, "error": None})
        await asyncio.sleep(0)  # let each task register with the engine before we return
        return out

    async def _run(self, engine: EngineAdapter, req: GenerateRequest) -> GenerateResult:
        tid = req.trajectory_id
        try:
            result = await engine.generate(req)
        except Exception as e:
            # The engine refused or failed: report a zero-progress interruption so the
            # trajectory goes back to the queue with what it had; log the cause.
            self._log.warning("generate_failed", trajectory_id=tid, error=repr(e))
            self._errors.append({"trajectory_id": tid, "error": repr(e)})
            result = GenerateResult(
                trajectory_id=tid,
                token_ids=req.generated_token_ids,
                logprobs=req.generated_logprobs,
                versions=req.generated_versions,
                finish_reason=FinishReason.INTERRUPTED,
            )
        finally:
            self._tasks.pop(tid, None)
        self._outbox.append(result_to_dict(result))
        return result

    async def poll(self) -> dict[str, Any]:
        """Results since the last poll (each exactly once) and a snapshot taken after them."""
        engine = self._require()
        results, self._outbox = self._outbox, []
        errors, self._errors = self._errors, []
        snap = await engine.snapshot()
        return {
            "results": results,
            "errors": errors,
            "snapshot": snapshot_to_dict(snap),
            "syncing": self._sync_lock.locked(),
        }

    async def interrupt(self, trajectory_ids: Sequence[str] | None = None) -> int:
        """Stop these trajectories (None = all); partial results arrive through ``poll``.
        Ids that already finished are skipped (their results are in the outbox)."""
        engine = self._require()
        ids = (
            list(self._tasks)
            if trajectory_ids is None
            else [t for t in trajectory_ids if t in self._tasks]
        )
        if not ids:
            return 0
        live = [t for t in ids if t in self._tasks]
        try:
            await engine.interrupt(live)
        except Exception as e:  # e.g. one finished between the check and the call
            self._log.warning("interrupt_retry_each", error=repr(e))
            for t in live:
                if t in self._tasks:
                    try:
                        await engine.interrupt([t])
                    except Exception as e2:  # already gone
                        self._log.debug("interrupt_skipped", trajectory_id=t, error=repr(e2))
        tasks = [self._tasks[t] for t in live if t in self._tasks]
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        return len(live)

    async def quiesce(self) -> dict[str, Any]:
        """For a replacement coordinator: wait out a sync in progress (so the version it
        reports is final), stop everything, and :meth:`poll` — every result so far, each once."""
        async with self._sync_lock:
            await self.interrupt(None)
        return await self.poll()

    # ---------------------------------------------------------------------------------- weights

    def _client(self) -> Any:
        if self._ps is None:
            if self._ps_address is None:
                raise RuntimeError(f"{self.instance_id!r} has no parameter-server address")
            from param_server import ParamServerClient

            self._ps = ParamServerClient(
                self._ps_address, token=self._ps_token, name=f"rollout-{self.instance_id}"
            )
        return self._ps

    async def sync(self, version: int | None = None) -> dict[str, Any]:
        """Interrupt all work, pull ``version`` (None = latest) from the PS, load it in place."""
        engine = self._require()
        async with self._sync_lock:
            t0 = time.perf_counter()
            interrupted = await self.interrupt(None)
            client = self._client()
            got, tensors = await asyncio.to_thread(client.pull, None, version=version)
            t_pull = time.perf_counter() - t0
            served = await engine.load_weights(int(got), tensors)
            self._syncs += 1
            seconds = time.perf_counter() - t0
            self._log.info(
                "synced",
                version=served,
                interrupted=interrupted,
                pull_s=round(t_pull, 4),
                seconds=round(seconds, 4),
            )
            return {
                "version": int(served),
                "interrupted": interrupted,
                "pull_s": t_pull,
                "seconds": seconds,
            }

    async def check_pull(self, version: int | None = None) -> dict[str, Any]:
        """Pull ``version`` (None = latest) from the PS without loading it: ``{"version",
        "nbytes"}``. Fault tests use it to show a version stays pullable from a replica."""
        client = self._client()
        got, tensors = await asyncio.to_thread(client.pull, None, version=version)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"version": int(got), "nbytes": int(nbytes)}

    async def probe(
        self, prompt_token_ids: Sequence[int], max_new_tokens: int = 4
    ) -> dict[str, Any]:
        """Greedy-decode a fixed prompt: ``{"version", "token_ids", "logprobs"}``."""
        engine = self._require()
        req = GenerateRequest(
            trajectory_id=f"probe-{self.instance_id}-{time.monotonic_ns()}",
            prompt_token_ids=list(prompt_token_ids),
            sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens),
        )
        r = await engine.generate(req)
        return {
            "version": engine.version,
            "token_ids": list(r.token_ids),
            "logprobs": list(r.logprobs),
        }

    async def stats(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "running": len(self._tasks), "syncs": self._syncs}

    async def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            await engine.close()
        if self._ps is not None:
            self._ps.close()
            self._ps = None
