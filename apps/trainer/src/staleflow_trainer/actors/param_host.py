"""The parameter server as an actor: owns ``ParamServer`` and its NIXL storage worker processes.

Trainer and rollout actors connect to its control endpoint with ``ParamServerClient`` (address
and token handed out by :meth:`ParamServerHost.address`); the tensors themselves move over NIXL,
never through Ray.
"""

from __future__ import annotations

from typing import Any

import structlog

log = structlog.get_logger(__name__)


class ParamServerHost:
    """Wrap with ``ray.remote``. Starts the service and its workers at construction."""

    def __init__(
        self,
        *,
        num_workers: int = 1,
        keep_versions: int = 2,
        host: str = "127.0.0.1",
        token: str | None = None,
        worker_pool_bytes: int = 64 << 20,
    ) -> None:
        from param_server import ParamServer, ParamServerConfig

        self._server = ParamServer(
            ParamServerConfig(
                num_workers=num_workers,
                keep_versions=keep_versions,
                host=host,
                token=token or None,
                worker_pool_bytes=worker_pool_bytes,
            )
        )
        log.info("param_server_started", address=self._server.address, workers=num_workers)

    def address(self) -> list[Any]:
        host, port = self._server.address
        return [host, int(port)]

    def status(self) -> dict[str, Any]:
        return self._server.status()

    def worker_pids(self) -> dict[str, int]:
        return dict(self._server.worker_pids())

    def close(self) -> None:
        self._server.close()
