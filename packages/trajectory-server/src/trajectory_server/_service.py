"""The asyncio TCP shell around the store: length-prefixed msgpack frames.

Each frame is a 4-byte big-endian length followed by that many bytes of msgpack (see
:mod:`trajectory_server._wire`). A connection serves its requests in order; store operations
run synchronously on the event loop, so each one is atomic with respect to every other client.

Security: the service binds 127.0.0.1 unless told otherwise. Binding anything that is not a
loopback address needs ``allow_remote=True`` *and* a token; when a token is set every request
must carry it (constant-time compare). A frame longer than ``max_message_bytes`` is answered
with ``MessageTooLarge`` and the connection is closed without reading the body.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import struct
from typing import Any

import structlog

from trajectory_server import _wire
from trajectory_server._core import TrajectoryStore
from trajectory_server._dispatch import Dispatcher
from trajectory_server.errors import ConfigError, MessageTooLarge, ServiceClosed

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
        self.dispatcher = dispatcher
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()

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
        peer = writer.get_extra_info("peername")
        limit = self.dispatcher.max_message_bytes
        try:
            while True:
                try:
                    header = await reader.readexactly(LENGTH.size)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                (size,) = LENGTH.unpack(header)
                if size > limit:
                    exc = MessageTooLarge(
                        f"frame of {size} bytes exceeds the limit of {limit}",
                        size=size,
                        limit=limit,
                    )
                    log.warning("frame_too_large", peer=str(peer), size=size, limit=limit)
                    await _write(writer, _wire.encode_error(0, exc))
                    return
                try:
                    data = await reader.readexactly(size)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                await _write(writer, self.dispatcher.handle_frame(data))
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def _write(writer: asyncio.StreamWriter, payload: bytes) -> None:
    writer.write(LENGTH.pack(len(payload)))
    writer.write(payload)
    await writer.drain()
