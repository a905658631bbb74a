"""Public entry point for the TCP service (see :mod:`trajectory_server._service`)."""

from trajectory_server._dispatch import Dispatcher
from trajectory_server._handshake import PRE_AUTH_MAX_BYTES, ConnectionLimits
from trajectory_server._service import DEFAULT_HOST, TrajectoryService, check_bind, is_loopback

__all__ = [
    "DEFAULT_HOST",
    "PRE_AUTH_MAX_BYTES",
    "ConnectionLimits",
    "Dispatcher",
    "TrajectoryService",
    "check_bind",
    "is_loopback",
]
