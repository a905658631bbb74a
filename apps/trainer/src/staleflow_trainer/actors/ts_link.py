"""Kept-open trajectory-server connections, reopened when they break.

:class:`AsyncStoreLink` is the connection for asyncio code (a rollout instance): opened on first
use and kept for the next calls (its keepalive pings run between calls), so a call costs one
request on an open connection instead of a new TCP connection and handshake. A connection that
broke (the server restarted, the transport failed) is dropped; with ``retry`` the call is tried
once more on a new one, without it the error goes to the caller, whose next call opens a new
connection. An error about the trajectories themselves (unknown, not finished) goes to the
caller and the connection stays. ``timeout_s`` bounds each wait (to connect, for the
handshake, to send a request, for its answer); a request not sent or answered by then counts as
broken.

:class:`StoreLink` is the same for a synchronous actor (the trainer, a reward worker): their
methods are plain functions, so the connection lives on an event loop in a daemon thread of
the actor's process, and every call is retried once on a new connection (their calls read or
free finished trajectories).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from trajectory_server.errors import ServiceClosed, TransportError

T = TypeVar("T")


#: the errors that say the connection broke (any other is about the call itself)
BROKEN = (TransportError, ServiceClosed)


class NotConnected(TransportError):
    """No connection to the trajectory server could be opened: the request was not sent."""


class AsyncStoreLink:
    """``await run(op)`` awaits ``op(client)`` on the kept connection and returns its result.
    Safe for concurrent calls: they share one connection, a broken one is replaced once (a
    call that failed on a connection another call has already replaced leaves the new one
    alone), and after :meth:`drop` with ``closing`` no call opens a new one."""

    def __init__(
        self, address: Sequence[Any], token: str | None, *, timeout_s: float = 60.0
    ) -> None:
        self._address = tuple(address)
        self._token = token or None
        self.timeout_s = timeout_s  # each wait: connect, handshake, send, answer
        self._client: Any = None
        self._connecting = asyncio.Lock()
        self._closed = False
        self.connects = 0  # connections opened so far

    async def _open(self) -> Any:
        from trajectory_server.client import TrajectoryClient

        async with self._connecting:
            if self._closed:
                raise NotConnected("the trajectory-server link is closed")
            if self._client is not None and self._client.failure is not None:
                dead, self._client = self._client, None  # ended: nothing would be sent on it
                await dead.close()
            if self._client is None:
                try:
                    client = await TrajectoryClient.connect(
                        *self._address, token=self._token, timeout_s=self.timeout_s
                    )
                except Exception as e:  # refused, busy, handshake refused: nothing was sent
                    raise NotConnected(
                        f"cannot open a connection to the trajectory server at "
                        f"{self._address}: {e!r:.200}"
                    ) from e
                if self._closed:  # closed while it connected
                    await client.close()
                    raise NotConnected("the trajectory-server link is closed")
                self._client = client
                self.connects += 1
            return self._client

    async def run(self, op: Callable[[Any], Awaitable[T]], *, retry: bool = True) -> T:
        """``op(client)``; a connection that broke is dropped, and with ``retry`` the call is
        made once more on a new one (only for calls that may be repeated: a request whose
        answer was lost may have been carried out). Any other error is about the call itself
        (the trajectories asked for, a message too large) and leaves the connection open;
        :class:`NotConnected` if no connection could be opened, or the link is closed (nothing
        was sent)."""
        for attempt in (0, 1):
            client = await self._open()
            try:
                return await op(client)
            except BROKEN:  # this connection is done for (others may share it: only once)
                await self._discard(client)
                if attempt or not retry or self._closed:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _discard(self, client: Any) -> None:
        if self._client is client:
            self._client = None
        await client.close()

    async def drop(self, *, closing: bool = False) -> None:
        """Close the connection (the next call opens a new one; none with ``closing``)."""
        self._closed = self._closed or closing
        client, self._client = self._client, None
        if client is not None:
            await client.close()


class StoreLink:
    """``run(op)`` awaits ``op(client)`` on the kept connection and returns its result."""

    def __init__(self, address: Sequence[Any], token: str | None) -> None:
        self._link = AsyncStoreLink(address, token)
        self._lock = threading.Lock()  # one call at a time (actors may run 2 threads)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ts-link", daemon=True)
        self._thread.start()

    @property
    def connects(self) -> int:
        """Connections opened so far."""
        return self._link.connects

    def run(self, op: Callable[[Any], Awaitable[T]]) -> T:
        if self._loop.is_closed():
            raise RuntimeError("the trajectory-server link is closed")
        with self._lock:
            return asyncio.run_coroutine_threadsafe(self._link.run(op), self._loop).result()

    def close(self) -> None:
        """Close the connection and stop the loop's thread (idempotent)."""
        if self._loop.is_closed():
            return
        with self._lock:
            asyncio.run_coroutine_threadsafe(self._link.drop(closing=True), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()
