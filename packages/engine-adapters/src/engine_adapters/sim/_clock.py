"""Clocks the async sim adapter reads time from: real (scaled) or virtual."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Protocol

from engine_adapters.errors import InvalidRequest


class Clock(Protocol):
    """What :class:`~engine_adapters.sim.SimAdapter` needs from a clock (seconds)."""

    def now(self) -> float: ...

    async def sleep_until(self, t: float, wake: asyncio.Event) -> None:
        """Return once the clock reads >= ``t`` or ``wake`` is set (whichever comes first)."""
        ...


class RealClock:
    """Wall-clock time since construction, scaled: ``speed=100`` runs simulated time 100× fast."""

    def __init__(self, speed: float = 1.0) -> None:
        if not (speed > 0 and math.isfinite(speed)):
            raise InvalidRequest(f"speed must be finite and > 0, got {speed!r}", field="speed")
        self.speed = speed
        self._origin = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._origin) * self.speed

    async def sleep_until(self, t: float, wake: asyncio.Event) -> None:
        delay = None if math.isinf(t) else max(0.0, (t - self.now()) / self.speed)
        # not asyncio.wait_for: on Python 3.11 it returns the result of a wait that finished
        # as it was cancelled, and swallows the cancel (a driver told to stop slept on)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await wake.wait()


class VirtualClock:
    """Time that moves only when told to: ``await clock.advance_to(t)`` / ``advance(dt)``.

    With ``auto_advance=True`` the clock instead jumps to whatever time a sleeper asks for,
    so a lone adapter runs as fast as the CPU allows (useful for fast tests of whole runs).
    """

    def __init__(self, start: float = 0.0, *, auto_advance: bool = False) -> None:
        self._t = start
        self.auto_advance = auto_advance
        self._tick = asyncio.Event()

    def now(self) -> float:
        return self._t

    async def advance_to(self, t: float) -> None:
        """Move time forward to ``t`` and let sleepers run."""
        if t < self._t:
            raise InvalidRequest(f"virtual time cannot go back: {t} < {self._t}", field="t")
        self._t = t
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()
        for _ in range(5):  # let woken drivers process their events before returning
            await asyncio.sleep(0)

    async def advance(self, dt: float) -> None:
        await self.advance_to(self._t + dt)

    async def sleep_until(self, t: float, wake: asyncio.Event) -> None:
        while self._t < t and not wake.is_set():
            if self.auto_advance and not math.isinf(t):
                await asyncio.sleep(0)
                if not wake.is_set():
                    self._t = max(self._t, t)
                return
            tick = self._tick
            waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(tick.wait())]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
