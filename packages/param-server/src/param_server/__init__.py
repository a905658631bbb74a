"""Versioned weights over NIXL: atomic Push, concurrent Pull, load-balanced plans.

Public API::

    ParamServer(ParamServerConfig(num_workers=2, replication=2))  # starts worker processes
    ParamServerClient(server.address).push(version, state_dict)   # trainer rank
    ParamServerClient(server.address).pull() -> (version, tensors)  # rollout instance

``ParamServer`` and ``ParamServerClient`` import torch/NIXL lazily; the pure pieces
(``ParamServerCore``, ``plan_transfers``) import neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._core import ParamServerCore
from ._listener import ConnectionLimits
from ._plan import LinkClass, PlanRequest, SliceRef, TransferPlan, plan_transfers, uniform_link
from ._records import CoreConfig, TensorSpec
from .errors import (
    ChecksumMismatch,
    ConfigError,
    ParamServerError,
    ProtocolError,
    PushConflict,
    PushFailed,
    RemoteError,
    ServiceBusy,
    SliceUnavailable,
    TransferFailed,
    UnknownTensor,
    UsageError,
    VersionUnavailable,
    WorkerLost,
)

if TYPE_CHECKING:
    from ._config import ParamServerConfig
    from ._service import ParamServer, new_token
    from .client import ParamServerClient, PushResult

__version__ = "0.2.0"

_LAZY = {
    "ParamServer": "._service",
    "ParamServerConfig": "._config",
    "new_token": "._service",
    "ParamServerClient": ".client",
    "PushResult": ".client",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(name)


__all__ = [
    "ChecksumMismatch",
    "ConfigError",
    "ConnectionLimits",
    "CoreConfig",
    "LinkClass",
    "ParamServer",
    "ParamServerClient",
    "ParamServerConfig",
    "ParamServerCore",
    "ParamServerError",
    "PlanRequest",
    "ProtocolError",
    "PushConflict",
    "PushFailed",
    "PushResult",
    "RemoteError",
    "ServiceBusy",
    "SliceRef",
    "SliceUnavailable",
    "TensorSpec",
    "TransferFailed",
    "TransferPlan",
    "UnknownTensor",
    "UsageError",
    "VersionUnavailable",
    "WorkerLost",
    "new_token",
    "plan_transfers",
    "uniform_link",
]
