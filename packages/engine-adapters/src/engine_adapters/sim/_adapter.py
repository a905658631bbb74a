"""The async :class:`EngineAdapter` over :class:`SimEngineCore`, reading an injectable clock."""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import structlog

from engine_adapters._contract import (
    EngineAdapter,
    EngineSnapshot,
    GenerateRequest,
    GenerateResult,
    ProfilePoint,
    SamplingParams,
)
from engine_adapters.errors import (
    EngineDead,
    EngineUnavailable,
    InvalidRequest,
    InvalidWeights,
    UnknownTrajectory,
)
from engine_adapters.sim._clock import Clock, RealClock
from engine_adapters.sim._completion import SimCompletion
from engine_adapters.sim._config import SimConfig
from engine_adapters.sim._core import SimEngineCore

log = structlog.get_logger(__name__)

_RECENT_LIMIT = 100_000


def _shape_of(name: str, value: Any) -> tuple[int, ...]:
    shape = getattr(value, "shape", value)
    try:
        return tuple(int(d) for d in shape)
    except TypeError:
        raise InvalidWeights(
            f"weight {name!r} must be a tensor/array or a shape tuple, got {type(value).__name__}",
            field="named_tensors",
        ) from None


def weights_nbytes(
    named_tensors: Mapping[str, Any],
    expected: Mapping[str, tuple[int, ...]] | None,
    dtype_bytes: int,
) -> int:
    """Validate ``named_tensors`` against ``expected`` names→shapes and return their size.

    Values may be tensors/arrays (their ``nbytes`` is used) or bare shapes (``dtype_bytes``
    per element). Raises :class:`InvalidWeights` naming missing, extra and mis-shaped entries.
    """
    shapes = {name: _shape_of(name, v) for name, v in named_tensors.items()}
    if not shapes:
        raise InvalidWeights("load_weights got no tensors", field="named_tensors")
    if expected is not None:
        missing = sorted(set(expected) - set(shapes))
        extra = sorted(set(shapes) - set(expected))
        misshaped = {
            n: (shapes[n], expected[n])
            for n in expected
            if n in shapes and shapes[n] != expected[n]
        }
        if missing or extra or misshaped:
            raise InvalidWeights(
                f"weights do not match the model: missing={missing}, extra={extra}, "
                f"mis-shaped (got, expected)={misshaped}",
                field="named_tensors",
            )
    total = 0
    for name, value in named_tensors.items():
        nbytes = getattr(value, "nbytes", None)
        total += int(nbytes) if nbytes is not None else math.prod(shapes[name]) * dtype_bytes
    return total


class SimAdapter(EngineAdapter):
    """A simulated rollout instance behind the async engine contract.

    Time comes from ``clock`` (default: :class:`RealClock` at ``speed``); a background task
    sleeps until the core's next event and resolves ``generate`` calls as trajectories finish.
    ``load_weights`` accepts real tensors or a names→shapes spec; when
    ``config.weight_shapes`` is set it is validated against it.
    """

    backend = "sim"

    def __init__(
        self,
        config: SimConfig | None = None,
        *,
        instance_id: str = "sim-0",
        clock: Clock | None = None,
        speed: float = 1.0,
        version: int = 0,
        profile_noise: float = 0.0,
    ) -> None:
        self.config = config if config is not None else SimConfig()
        self.core = SimEngineCore(self.config, instance_id=instance_id, version=version)
        self.clock: Clock = clock if clock is not None else RealClock(speed)
        self.profile_noise = profile_noise
        self._futures: dict[str, asyncio.Future[GenerateResult]] = {}
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._load_waiters: list[tuple[int, asyncio.Future[int]]] = []
        self._wake = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None
        self._closed = False
        self._closing: asyncio.Future[None] | None = None  # close()'s work, once it started
        self._dead: str | None = None  # why it died (kill)
        self._log = log.bind(instance=instance_id, backend="sim")

    # ------------------------------------------------------------------ lifecycle
    @property
    def instance_id(self) -> str:
        return self.core.instance_id

    @property
    def version(self) -> int:
        return self.core.version

    async def start(self) -> None:
        if self._dead is not None:
            raise EngineDead(self._dead)
        if self._closed:
            raise EngineUnavailable(f"sim instance {self.instance_id!r} is closed")
        if self._driver is None:
            self._driver = asyncio.get_running_loop().create_task(self._drive())
            self._log.info("sim_started", config_cost=self.config.cost.name)

    async def close(self) -> None:
        """Interrupt what runs (each ``generate`` returns its partial output), fail waiting
        weight loads and stop the driver; calls from here on fail (:class:`EngineUnavailable`,
        or :class:`EngineDead` after :meth:`kill`). The closing runs to its end even if this
        call is cancelled, and every call returns once it has."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        self._closed = True  # refused from here: nothing new reaches the core after the interrupt
        try:
            if self._driver is not None:
                if self._dead is None:
                    self._sync()
                    self._finish(self.core.interrupt(None, self._now()))
                self._driver.cancel()
                (ended,) = await asyncio.gather(self._driver, return_exceptions=True)
                if not isinstance(ended, asyncio.CancelledError | type(None)):
                    self._log.warning("sim_driver_failed", error=repr(ended)[:300])
        finally:
            for _, fut in self._load_waiters:
                if not fut.done():
                    fut.set_exception(
                        EngineUnavailable(f"sim instance {self.instance_id!r} closed")
                    )
            self._load_waiters.clear()
            self._log.info("sim_closed")

    def kill(self) -> None:
        """Fault injection: the engine dies as a crashed engine process would. Waiting
        ``generate`` calls and weight loads fail with :class:`EngineDead`, so does every later
        call, and :meth:`check_health` reports it; nothing is returned: the output is lost."""
        if self._closed or self._dead is not None:
            return
        self._dead = f"sim instance {self.instance_id!r} died (injected)"
        if self._driver is not None:
            self._driver.cancel()
        waiting: list[asyncio.Future[Any]] = [*self._futures.values()]
        waiting += [fut for _, fut in self._load_waiters]
        self._futures.clear()
        self._load_waiters.clear()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(EngineDead(self._dead))
        self._log.warning("sim_killed")

    async def check_health(self) -> None:
        if self._dead is not None and not self._closed:
            raise EngineDead(self._dead)

    # ------------------------------------------------------------------ verbs
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self._check_running()
        tid = request.trajectory_id
        if tid in self._futures:
            raise InvalidRequest(f"trajectory {tid!r} is already generating", field="trajectory_id")
        self._sync()
        self.core.add(request, self._now())
        fut: asyncio.Future[GenerateResult] = asyncio.get_running_loop().create_future()
        self._futures[tid] = fut
        self._recent.pop(tid, None)
        self._wake.set()
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self._futures.pop(tid, None)
            if not self._closed and self.core.holds(tid):
                self._sync()
                if self.core.holds(tid):
                    self.core.interrupt([tid], self._now())
                    self._wake.set()
            raise

    async def interrupt(self, trajectory_ids: Sequence[str] | None = None) -> list[GenerateResult]:
        self._check_running()
        self._sync()
        if trajectory_ids is None:
            targets = None
        else:
            wanted = list(dict.fromkeys(trajectory_ids))
            unknown = [t for t in wanted if not self.core.holds(t) and t not in self._recent]
            if unknown:
                raise UnknownTrajectory(unknown)
            # Ids that finished a moment ago already resolved their generate(); skip them.
            targets = [t for t in wanted if self.core.holds(t)]
        results = self._finish(self.core.interrupt(targets, self._now()))
        self._wake.set()
        self._log.debug("sim_interrupted", count=len(results))
        return results

    async def load_weights(self, version: int, named_tensors: Mapping[str, Any]) -> int:
        self._check_running()
        nbytes = weights_nbytes(
            named_tensors, self.config.weight_shape_map, self.config.weight_dtype_bytes
        )
        self._sync()
        done_at = self.core.load_weights(version, nbytes, self._now())
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._load_waiters.append((version, fut))
        self._wake.set()
        self._log.info("sim_load_weights", version=version, nbytes=nbytes, done_at=done_at)
        return await fut

    async def snapshot(self) -> EngineSnapshot:
        self._check_running()
        self._sync()
        return self.core.snapshot(self._now())

    async def profile(
        self,
        points: Sequence[tuple[int, int]],
        *,
        steps: int = 8,
        sampling: SamplingParams | None = None,
    ) -> list[ProfilePoint]:
        """Run a scratch copy of this engine at each (running, kv) point; mean step latency.
        The simulated step time does not depend on ``sampling``: it is accepted for the
        contract and has no effect.

        As in vLLM's profile, a point's KV is the batch's in the middle of the measured window:
        the prompts hold ``kv/running - steps/2`` tokens each. ``kv_tokens`` of each result is
        the mean resident KV over the measured steps (it grows by ``running`` per step), so a
        linear fit of the points recovers the cost model.
        """
        if steps < 1:
            raise InvalidRequest(f"steps must be >= 1, got {steps}", field="steps")
        rng = np.random.default_rng(self.config.seed)
        out = []
        for running, kv in points:
            latency, mean_kv = self._measure(running, kv, steps)
            if self.profile_noise:
                latency *= float(rng.lognormal(0.0, self.profile_noise))
            out.append(
                ProfilePoint(
                    running=running, kv_tokens=round(mean_kv), step_latency_s=latency, backend="sim"
                )
            )
        return out

    # ------------------------------------------------------------------ extras
    async def progress(self, trajectory_id: str) -> GenerateResult:
        """The tokens a held trajectory has so far (it keeps running)."""
        self._check_running()
        self._sync()
        return self.core.peek(trajectory_id, self._now()).to_result()

    async def pause(self) -> None:
        """Freeze generation in place (KV kept) until :meth:`resume`."""
        self._check_running()
        self._sync()
        self.core.pause(self._now())
        self._wake.set()

    async def resume(self) -> None:
        self._check_running()
        self._sync()
        self.core.resume(self._now())
        self._wake.set()

    # ------------------------------------------------------------------ internals
    def _measure(self, running: int, kv: int, steps: int) -> tuple[float, float]:
        cfg = self.config
        if not 1 <= running <= cfg.max_running:
            raise InvalidRequest(
                f"profile running={running} must be in [1, {cfg.max_running}]", field="points"
            )
        # the point's KV is the batch's in the middle of the window, as in vLLM's profile
        start = kv - running * steps // 2
        per = start // running
        longest = per + (1 if start % running else 0)  # the remainder lengthens some by one
        if (
            per < 1
            or longest + steps + 1 > cfg.max_model_len
            or start + running * (steps + 1) > cfg.kv_capacity
        ):
            raise InvalidRequest(
                f"profile point (running={running}, kv={kv}) does not fit: its prompts of "
                f"kv/running - steps/2 tokens need at least 1 token each, and "
                f"kv/running + steps/2 + 1 <= max_model_len={cfg.max_model_len} and "
                f"kv + running·(steps/2 + 1) <= the KV capacity {cfg.kv_capacity}",
                field="points",
            )
        no_prefill = attrs.evolve(
            cfg,
            prefill_s_per_token=0.0,
            prefill_s_per_token_position=0.0,
            max_num_batched_tokens=None,
            kv_capacity_tokens=cfg.kv_capacity,
        )
        scratch = SimEngineCore(no_prefill, instance_id="profile")
        extra = start - per * running
        for i in range(running):
            plen = per + (1 if i < extra else 0)
            scratch.add(
                GenerateRequest(
                    trajectory_id=f"p{i}",
                    prompt_token_ids=[cfg.num_special_tokens] * plen,
                    sampling=SamplingParams(max_new_tokens=steps + 1),
                ),
                0.0,
            )
        # All were admitted at t=0 in one batch; the first boundary is after steps+1 steps.
        elapsed = scratch.next_event_time()
        per_step = [
            scratch.cost.step_latency(running, start + running * j) for j in range(steps + 1)
        ]
        if not math.isclose(elapsed, sum(per_step), rel_tol=1e-9):
            raise AssertionError("profile batch was not admitted at once")
        return elapsed / (steps + 1), start + running * steps / 2

    def _now(self) -> float:
        return max(self.clock.now(), self.core.now)

    def _check_running(self) -> None:
        if self._dead is not None:
            raise EngineDead(self._dead)
        if self._closed:
            raise EngineUnavailable(f"sim instance {self.instance_id!r} is closed")
        if self._driver is None:
            raise EngineUnavailable(f"sim instance {self.instance_id!r} not started: call start()")

    def _sync(self) -> None:
        self._finish(self.core.advance_to(self._now()))
        if self._load_waiters and not self.core.loading:
            waiters, self._load_waiters = self._load_waiters, []
            for _, fut in waiters:
                if not fut.done():
                    fut.set_result(self.core.version)

    def _finish(self, completions: list[SimCompletion]) -> list[GenerateResult]:
        results = []
        for c in completions:
            result = c.to_result()
            results.append(result)
            fut = self._futures.pop(c.trajectory_id, None)
            if fut is not None and not fut.done():
                fut.set_result(result)
            self._recent[c.trajectory_id] = None
            if len(self._recent) > _RECENT_LIMIT:
                self._recent.popitem(last=False)
        return results

    async def _drive(self) -> None:
        while True:
            self._sync()
            self._wake.clear()
            await self.clock.sleep_until(self.core.next_event_time(), self._wake)
