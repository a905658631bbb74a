"""One kept-open trajectory-server connection for a synchronous actor (the trainer, a reward
worker): their methods are plain functions, the client is asyncio.

The connection lives on an event loop in a daemon thread of the actor's process, opened on
first use and kept for the next calls (its keepalive pings run there between calls), so a call
costs one request on an open connection instead of a new TCP connection and handshake. A
connection that broke (the server restarted, the transport failed) is dropped and the call is
tried once more on a new one; an error about the trajectories themselves (unknown, not
finished) goes to the caller and the connection stays.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


class StoreLink:
    """``run(op)`` awaits ``op(client)`` on the kept connection and returns its result."""

    def __init__(self, address: Sequence[Any], token: str | None) -> None:
        self._address = tuple(address)
        self._token = token or None
        self._client: Any = None
        self._lock = threading.Lock()  # one call at a time (actors may run 2 threads)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ts-link", daemon=True)
        self._thread.start()
        self.connects = 0  # connections opened so far

    def run(self, op: Callable[[Any], Awaitable[T]]) -> T:
        if self._loop.is_closed():
            raise RuntimeError("the trajectory-server link is closed")
        with self._lock:
            return asyncio.run_coroutine_threadsafe(self._run(op), self._loop).result()

    async def _run(self, op: Callable[[Any], Awaitable[T]]) -> T:
        from trajectory_server.client import TrajectoryClient
        from trajectory_server.errors import (
            InvalidRecord,
            ServiceClosed,
            StateError,
            TransportError,
        )

        for attempt in (0, 1):
            if self._client is None:
                self._client = await TrajectoryClient.connect(*self._address, token=self._token)
                self.connects += 1
            try:
                return await op(self._client)
            except (StateError, InvalidRecord):
                raise  # about the trajectories asked for: the connection is fine
            except BaseException as e:
                await self._drop()
                if attempt or not isinstance(e, TransportError | ServiceClosed):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    def close(self) -> None:
        """Close the connection and stop the loop's thread (idempotent)."""
        if self._loop.is_closed():
            return
        with self._lock:
            asyncio.run_coroutine_threadsafe(self._drop(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()
