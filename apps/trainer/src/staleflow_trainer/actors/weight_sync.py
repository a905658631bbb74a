"""A rollout instance's weights: ``sync`` interrupts its work, pulls a version from the
parameter server (PS) over NIXL and loads it in place (the engine never serves half-loaded
weights); ``check_pull`` pulls one without loading it.

:class:`WeightSync` is mixed into :class:`~staleflow_trainer.actors.rollout.RolloutActor`.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from engine_adapters import EngineAdapter


class WeightSync:
    """Mixed into the rollout actor, which sets these attributes and provides the methods below."""

    instance_id: str
    _ps: Any
    _ps_address: tuple[Any, ...] | None
    _ps_token: str | None
    _sync_lock: asyncio.Lock
    _syncs: int
    _log: Any

    if TYPE_CHECKING:  # RolloutActor's, its fault hooks' and EngineHealth's

        def _require(self) -> EngineAdapter: ...
        async def interrupt(self, trajectory_ids: Any = None, report: bool = False) -> Any: ...
        async def _maybe_hang_sync(self) -> None: ...
        async def _end_if_dead(self, engine: EngineAdapter, error: BaseException) -> None: ...

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
            await self._maybe_hang_sync()  # fault tests only
            t0 = time.perf_counter()
            interrupted = await self.interrupt(None)
            client = self._client()
            got, tensors = await asyncio.to_thread(client.pull, None, version=version)
            t_pull = time.perf_counter() - t0
            try:
                served = await engine.load_weights(int(got), tensors)
            except Exception as e:
                await self._end_if_dead(engine, e)
                raise
            self._syncs += 1
            seconds = time.perf_counter() - t0
            self._log.info("synced", version=served, interrupted=interrupted,
                           pull_s=round(t_pull, 4), seconds=round(seconds, 4))  # fmt: skip
            return {"version": int(served), "interrupted": interrupted, "pull_s": t_pull,
                    "seconds": seconds}  # fmt: skip

    async def check_pull(self, version: int | None = None) -> dict[str, Any]:
        """Pull ``version`` (None = latest) from the PS without loading it: ``{"version",
        "nbytes"}``. Fault tests use it to show a version stays pullable from a replica."""
        client = self._client()
        got, tensors = await asyncio.to_thread(client.pull, None, version=version)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"version": int(got), "nbytes": int(nbytes)}
