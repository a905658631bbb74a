"""The asyncio TCP shell around the store: length-prefixed msgpack frames.

Each frame is a 4-byte big-endian length followed by that many bytes of msgpack (see
:mod:`trajectory_server._wire`). A connection serves its requests in order; store operations
run synchronously on the event loop, so each one is atomic with respect to every other client.

Security: the service binds 127.0.0.1 unless told otherwise. Binding anything that is not a
loopback address needs ``allow_remote=True`` *and* a token; when a token is set every request
must carry it (constant-time compare). Each connection first authenticates with a small
``hello`` (:mod:`trajectory_server._handshake`): before that, nothing longer than
``PRE_AUTH_MAX_BYTES`` is read or decoded. A frame longer than the limit that applies is
answered with ``MessageTooLarge`` and the connection is closed without reading the body.
:class:`ConnectionLimits` caps waiting and authenticated connections and times out idle ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import struct
from typing import Any

import structlog

from trajectory_server import _handshake, _wire
from trajectory_server._core import TrajectoryStore
from trajectory_server._dispatch import Dispatcher
from trajectory_server._handshake import ConnectionLimits, Welcome
from trajectory_server.errors import (
    ConfigError,
    MessageTooLarge,
    ServiceBusy,
    ServiceClosed,
    TrajectoryServerError,
)

log = structlog.get_logger("trajectory_server")

LENGTH = struct.Struct(">I")
DEFAULT_HOST = "127.0.0.1"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, *, allow_remote: bool, token: str | None) -> None:
    """Raise ``ConfigError`` unless binding ``host`` is allowed by the security rules."""
    if not isinstance(host, str) or not host:
        raise ConfigError(f"host must be a non-empty string, got {host!r}", field="host")
    if is_loopback(host):
        return
    if not allow_remote:
        raise ConfigError(
            f"refusing to bind non-loopback address {host!r}: set allow_remote=True and a token",
            field="allow_remote",
            host=host,
        )
    if not token:
        raise ConfigError(
            f"binding non-loopback address {host!r} requires a shared token",
            field="token",
            host=host,
        )


class TrajectoryService:
    """Serves one :class:`TrajectoryStore` over TCP. Use ``async with`` or ``start``/``stop``."""

    def __init__(
        self,
        store: TrajectoryStore | None = None,
        *,
        host: str = DEFAULT_HOST,
        port: int = 0,
        token: str | None = None,
        allow_remote: bool = False,
        checkpoint_path: str | os.PathLike[str] | None = None,
        max_message_bytes: int = _wire.DEFAULT_MAX_MESSAGE_BYTES,
        dispatcher: Dispatcher | None = None,
        limits: ConnectionLimits | None = None,
    ) -> None:
        if dispatcher is None:
            dispatcher = Dispatcher(
                store,
                token=token,
                checkpoint_path=checkpoint_path,
                max_message_bytes=max_message_bytes,
            )
        elif store is not None or token is not None or checkpoint_path is not None:
            raise ConfigError(
                "with a dispatcher, pass store/token/checkpoint_path to the dispatcher",
                field="dispatcher",
            )
        check_bind(host, allow_remote=allow_remote, token="set" if dispatcher.has_token else None)
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"port must be an int in [0, 65535], got {port!r}", field="port")
        if limits is not None and not isinstance(limits, ConnectionLimits):
            raise ConfigError("limits must be a ConnectionLimits or None", field="limits")
        self.dispatcher = dispatcher
        self.limits = limits if limits is not None else ConnectionLimits()
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()
        # connections still waiting for their hello, oldest first (dicts keep insertion order)
        self._waiting: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}
        self._authenticated: set[asyncio.Task[Any]] = set()
        self.evicted = 0

    def connection_counts(self) -> dict[str, int]:
        """Open connections: waiting for their hello, and authenticated."""
        return {"unauthenticated": len(self._waiting), "authenticated": len(self._authenticated)}

    @property
    def store(self) -> TrajectoryStore:
        return self.dispatcher.store

    @property
    def address(self) -> tuple[str, int]:
        if self._server is None:
            raise ServiceClosed("the service is not running")
        sock = self._server.sockets[0].getsockname()
        return sock[0], sock[1]

    async def start(self) -> tuple[str, int]:
        if self._server is not None:
            return self.address
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        log.info("service_started", host=self.address[0], port=self.address[1])
        return self.address

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await server.wait_closed()
        log.info("service_stopped")

    async def serve_forever(self) -> None:
        await self.start()
        assert self._server is not None
        await self._server.serve_forever()

    async def __aenter__(self) -> TrajectoryService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        peer = str(writer.get_extra_info("peername"))
        try:
            self._admit(task, writer, peer)
            if not await self._handshake(reader, writer, peer, task):
                return
            limit = self.dispatcher.max_message_bytes
            while True:
                data = await self._read_frame(reader, writer, peer, limit)
                if data is None:
                    return
                await _write(writer, self.dispatcher.handle_frame(data, authenticated=True))
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            self._waiting.pop(task, None)
            self._authenticated.discard(task)
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _admit(self, task: asyncio.Task[Any], writer: asyncio.StreamWriter, peer: str) -> None:
        """Count a new connection as waiting; beyond the cap, close the oldest waiting one."""
        self._waiting[task] = writer
        while len(self._waiting) > self.limits.max_unauthenticated:
            oldest = next(iter(self._waiting))
            self._waiting.pop(oldest)
            oldest.cancel()
            self.evicted += 1
            log.warning(
                "unauthenticated_connection_evicted",
                peer=peer,
                limit=self.limits.max_unauthenticated,
                evicted=self.evicted,
            )

    async def _handshake(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: str,
        task: asyncio.Task[Any],
    ) -> bool:
        """Read and check the hello; True once this connection is authenticated."""
        try:
            async with asyncio.timeout(self.limits.handshake_timeout_s):
                data = await self._read_frame(
                    reader, writer, peer, _handshake.PRE_AUTH_MAX_BYTES, idle=False
                )
        except TimeoutError:
            log.warning("handshake_timeout", peer=peer, timeout_s=self.limits.handshake_timeout_s)
            return False
        if data is None:
            return False
        try:
            self.dispatcher.authorize(_handshake.decode_hello(data))
            if len(self._authenticated) >= self.limits.max_connections:
                raise ServiceBusy(
                    f"the service already serves {self.limits.max_connections} connections "
                    "(max_connections); try again later",
                    limit=self.limits.max_connections,
                )
        except TrajectoryServerError as exc:
            self.dispatcher.rejected += 1
            log.warning(
                "handshake_refused", peer=peer, error=type(exc).__name__, detail=exc.message
            )
            await _write(writer, _wire.encode_error(0, exc))
            return False
        self._waiting.pop(task, None)
        self._authenticated.add(task)
        welcome = Welcome(
            max_message_bytes=self.dispatcher.max_message_bytes,
            idle_timeout_s=self.limits.idle_timeout_s,
        )
        await _write(writer, _handshake.encode_welcome(welcome))
        return True

    async def _read_frame(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: str,
        limit: int,
        *,
        idle: bool = True,
    ) -> bytes | None:
        """One frame's body, or None when the connection should close (EOF, too large, idle)."""
        timeout = self.limits.idle_timeout_s if idle else None
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that comes
        # as its read completes, and ``stop`` waits on every connection's task
        try:
            async with asyncio.timeout(timeout):
                header = await reader.readexactly(LENGTH.size)
            (size,) = LENGTH.unpack(header)
            if size > limit:
                exc = MessageTooLarge(
                    f"frame of {size} bytes exceeds the limit of {limit}", size=size, limit=limit
                )
                log.warning("frame_too_large", peer=peer, size=size, limit=limit)
                await _write(writer, _wire.encode_error(0, exc))
                return None
            async with asyncio.timeout(timeout):
                return await reader.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        except TimeoutError:
            log.info("idle_connection_closed", peer=peer, timeout_s=timeout)
            return None


async def _write(writer: asyncio.StreamWriter, payload: bytes) -> None:
    writer.write(LENGTH.pack(len(payload)))
    writer.write(payload)
    await writer.drain()
