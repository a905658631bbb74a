"""How to run the parameter-server service (:class:`ParamServerConfig`)."""

from __future__ import annotations

import attrs

from ._listener import ConnectionLimits
from ._nixl import local_net_devices
from ._wire import check_bind
from .errors import ConfigError


@attrs.frozen(kw_only=True)
class ParamServerConfig:
    """How to run the service.

    ``host``/``port``: control endpoint (loopback by default; anything else needs ``token``).
    ``token``: shared secret checked on every message, client and worker channels alike.
    ``verify_on_push``: workers recompute each slice checksum before a version is published.
    ``worker_pool_bytes``: freed regions each worker keeps registered for reuse by later
    versions (saves registration and page faults; costs that much idle memory).
    ``fault_injection``: lets tests corrupt worker memory; never enable in production.
    ``connection_limits``: caps and timeouts of the control port (``ConnectionLimits()``).
    ``ucx_devices``: network devices the workers' NIXL/UCX endpoints may listen on (UCX's
    ``UCX_NET_DEVICES`` syntax, e.g. ``"lo"`` or ``"mlx5_0:1"``). ``None``: loopback (``"lo"``)
    when ``host`` is a loopback address, else every device UCX finds. An explicit
    ``UCX_NET_DEVICES`` in the environment wins over both.
    """

    num_workers: int = 2
    replication: int = 1
    keep_versions: int = 2
    max_slice_bytes: int = 64 << 20
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    verify_on_push: bool = True
    worker_start_timeout_s: float = 60.0
    monitor_interval_s: float = 0.5
    worker_pool_bytes: int = 2 << 30
    fault_injection: bool = False
    connection_limits: ConnectionLimits = attrs.field(factory=ConnectionLimits)
    ucx_devices: str | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.connection_limits, ConnectionLimits):
            raise ConfigError("connection_limits", self.connection_limits, "a ConnectionLimits")
        if self.ucx_devices is not None and (
            not isinstance(self.ucx_devices, str) or not self.ucx_devices.strip()
        ):
            raise ConfigError("ucx_devices", self.ucx_devices, "a non-empty string or None")
        if not isinstance(self.worker_pool_bytes, int) or self.worker_pool_bytes < 0:
            raise ConfigError("worker_pool_bytes", self.worker_pool_bytes, "an int >= 0")
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ConfigError("num_workers", self.num_workers, "an int >= 1")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ConfigError("port", self.port, "an int in [0, 65535]")
        check_bind(self.host, self.token)

    def worker_names(self) -> tuple[str, ...]:
        return tuple(f"w{i}" for i in range(self.num_workers))

    def net_devices(self) -> str | None:
        """The UCX devices workers use (see ``ucx_devices``)."""
        return self.ucx_devices if self.ucx_devices is not None else local_net_devices(self.host)
