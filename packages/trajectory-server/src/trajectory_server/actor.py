"""Run the trajectory server inside a Ray actor (or any host process) without importing Ray.

The app wraps :class:`TrajectoryServerActor` with ``ray.remote``; every method is ``async`` so
Ray runs it as an async actor and the TCP service lives on the actor's own event loop::

    import ray
    from trajectory_server.actor import TrajectoryServerActor

    Actor = ray.remote(num_cpus=0)(TrajectoryServerActor)
    ts = Actor.remote(token=token, checkpoint_path="/ckpt/trajectories.bin", restore=True)
    host, port = ray.get(ts.start.remote())           # 127.0.0.1, ephemeral port
    # other processes: await TrajectoryClient.connect(host, port, token=token)
    # or bytes through Ray: ray.get(ts.handle.remote(encode_request(...)))

Only bytes (msgpack frames) and plain values cross the actor boundary through these methods, so
nothing a peer sends is unpickled into arbitrary objects by this package.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trajectory_server import _wire
from trajectory_server._core import TrajectoryStore
from trajectory_server._dispatch import Dispatcher
from trajectory_server._handshake import ConnectionLimits
from trajectory_server._service import DEFAULT_HOST, TrajectoryService


class TrajectoryServerActor:
    """Holds one store; serves it over TCP (``start``) and/or as frames (``handle``).

    ``restore=True`` loads ``checkpoint_path`` when that file exists (a restarted actor picks up
    where the last checkpoint left off); a damaged file raises ``CheckpointCorrupt``.
    ``limits``: connection caps and timeouts of the TCP service (defaults: ``ConnectionLimits()``).
    """

    def __init__(
        self,
        *,
        token: str | None = None,
        checkpoint_path: str | os.PathLike[str] | None = None,
        restore: bool = False,
        max_message_bytes: int = _wire.DEFAULT_MAX_MESSAGE_BYTES,
        limits: ConnectionLimits | None = None,
    ) -> None:
        store = TrajectoryStore()
        if restore and checkpoint_path is not None and Path(checkpoint_path).exists():
            store = TrajectoryStore.load_checkpoint(checkpoint_path)
        self._dispatcher = Dispatcher(
            store,
            token=token,
            checkpoint_path=checkpoint_path,
            max_message_bytes=max_message_bytes,
        )
        self._limits = limits
        self._service: TrajectoryService | None = None

    @property
    def store(self) -> TrajectoryStore:
        return self._dispatcher.store

    async def start(
        self, host: str = DEFAULT_HOST, port: int = 0, allow_remote: bool = False
    ) -> tuple[str, int]:
        """Start (once) the TCP service on this event loop; returns its address."""
        if self._service is None:
            self._service = TrajectoryService(
                host=host,
                port=port,
                allow_remote=allow_remote,
                dispatcher=self._dispatcher,
                limits=self._limits,
            )
        return await self._service.start()

    async def stop(self) -> None:
        if self._service is not None:
            await self._service.stop()
            self._service = None

    async def address(self) -> tuple[str, int] | None:
        return None if self._service is None else self._service.address

    async def connection_counts(self) -> dict[str, int]:
        """Open TCP connections: waiting for their hello, and authenticated."""
        if self._service is None:
            return {"unauthenticated": 0, "authenticated": 0}
        return self._service.connection_counts()

    async def handle(self, frame: bytes) -> bytes:
        """One request frame (no length prefix) in, one response frame out."""
        return self._dispatcher.handle_frame(frame)

    async def save_checkpoint(self) -> str:
        """Checkpoint to the configured ``checkpoint_path``; returns the path."""
        return str(self._dispatcher.save_checkpoint())

    async def stats(self) -> dict[str, Any]:
        s = self._dispatcher.store.stats()
        return {
            "queued": s.queued,
            "running": s.running,
            "finished": s.finished,
            "dropped": s.dropped,
            "released": s.released,
            "queued_by_level": {str(k): v for k, v in s.queued_by_level.items()},
        }
