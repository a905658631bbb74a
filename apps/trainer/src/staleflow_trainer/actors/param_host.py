"""The parameter server as an actor: owns ``ParamServer`` and its NIXL storage worker processes.

Trainer and rollout actors connect to its control endpoint with ``ParamServerClient`` (address
and token handed out by :meth:`ParamServerHost.address`); the tensors themselves move over NIXL,
never through Ray.
"""

from __future__ import annotations

from typing import Any

import structlog

from staleflow_trainer.actors.log_relay import KeepsWarnings

log = structlog.get_logger(__name__)


class ParamServerHost(KeepsWarnings):
    """Wrap with ``ray.remote``. Starts the service and its workers at construction."""

    def __init__(
        self,
        *,
        num_workers: int = 1,
        keep_versions: int = 2,
        replication: int = 1,
        host: str = "127.0.0.1",
        token: str | None = None,
        worker_pool_bytes: int = 64 << 20,
    ) -> None:
        self._keep_warnings()
        from param_server import ParamServer, ParamServerConfig

        self._server = ParamServer(
            ParamServerConfig(
                num_workers=num_workers,
                keep_versions=keep_versions,
                replication=replication,
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

    def kill_worker(self, worker: str) -> None:
        """Kill a storage worker process (fault tests, operators)."""
        self._server.kill_worker(worker)

    def restart_worker(self, worker: str) -> None:
        """Start a fresh process for a dead worker; returns once it rejoined (empty)."""
        self._server.restart_worker(worker)

    def close(self) -> None:
        self._server.close()
