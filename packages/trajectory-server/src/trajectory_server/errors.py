"""Exceptions raised by the trajectory server.

Every error carries its context (``trajectory_id``, ``instance_id``, ``field``, ...) as
attributes, so callers can react without parsing messages. The same classes cross the wire: the
service sends the class name and context, and the client raises the same class again.

Tree::

    TrajectoryServerError                 root; ``context`` holds every attribute
    ├── UsageError                        the caller misused the API (its own fault)
    │   ├── ConfigError                   bad service/client settings (e.g. remote bind, no token)
    │   └── ServiceClosed                 a call on a closed client/service
    ├── InvalidRecord                     a record field is out of range (``field``, ``value``)
    ├── StateError                        the operation does not fit the store's current state
    │   ├── UnknownTrajectory             no such ``trajectory_id``
    │   ├── UnknownGroup                  no such ``group_id``
    │   ├── DuplicateTrajectory           ``trajectory_id`` already submitted
    │   ├── WrongState                    the trajectory's ``state`` does not allow this
    │   │   └── NotQueued                 route of a trajectory that is not queued
    │   ├── WrongOwner                    output from an instance that does not hold it
    │   ├── StaleVersion                  route at ``version`` < the trajectory's ``v_traj``
    │   └── SegmentMismatch               out-of-order / conflicting output (``start``, ``held``)
    ├── WireError                         bad input from a peer at the message level
    │   ├── MalformedMessage              a field is missing or has the wrong type (``field``)
    │   ├── SchemaMismatch                ``got`` schema version != ``expected``
    │   ├── UnknownMessageType            ``message_type`` not in the schema
    │   ├── MessageTooLarge               ``size`` > ``limit`` bytes
    │   └── Unauthorized                  missing or wrong token
    ├── CheckpointError                   a checkpoint could not be written or read (``path``)
    │   └── CheckpointCorrupt             bad magic, length or checksum
    ├── ServiceBusy                       the service is at its connection ``limit``
    └── TransportError                    the connection to the service failed or closed

``InvalidRecord``, ``StateError`` and ``WireError`` are what a peer's bad message produces; the
store is unchanged after any of them.
"""

from __future__ import annotations

from typing import Any


class TrajectoryServerError(Exception):
    """Root of every trajectory-server error. ``context`` holds the keyword attributes."""

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.context: dict[str, Any] = dict(context)
        for key, value in context.items():
            setattr(self, key, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.context))


def _rebuild(
    cls: type[TrajectoryServerError], message: str, context: dict[str, Any]
) -> TrajectoryServerError:
    return cls(message, **context)


class UsageError(TrajectoryServerError):
    """The caller misused the API."""


class ConfigError(UsageError):
    """Service or client settings are invalid (``field``)."""


class ServiceClosed(UsageError):
    """A call was made on a closed client or service."""


class InvalidRecord(TrajectoryServerError):
    """A record field is invalid (``field``, ``value``)."""


class StateError(TrajectoryServerError):
    """The operation does not fit the current state of the store."""


class UnknownTrajectory(StateError):
    """No trajectory with this ``trajectory_id``."""


class DuplicateTrajectory(StateError):
    """``trajectory_id`` was already submitted."""


class UnknownGroup(StateError):
    """No group with this ``group_id``."""


class WrongState(StateError):
    """``trajectory_id`` is in ``state`` (on ``owner``), where this operation is not allowed."""


class NotQueued(WrongState):
    """``trajectory_id`` is not queued (it is in ``state``)."""


class WrongOwner(StateError):
    """``instance_id`` sent output for ``trajectory_id``, which it does not hold (``owner``)."""


class StaleVersion(StateError):
    """``trajectory_id`` (``v_traj``) cannot run at ``version`` < ``v_traj``."""


class SegmentMismatch(StateError):
    """Output for ``trajectory_id`` starts at ``start`` but the store holds ``held`` tokens,
    or overlapping tokens disagree."""


class WireError(TrajectoryServerError):
    """A message from a peer is not acceptable."""


class MalformedMessage(WireError):
    """A message ``field`` is missing or has the wrong type."""


class SchemaMismatch(WireError):
    """The message's schema version ``got`` differs from ``expected``."""


class UnknownMessageType(WireError):
    """``message_type`` is not part of the schema."""


class MessageTooLarge(WireError):
    """A frame of ``size`` bytes exceeds ``limit``."""


class Unauthorized(WireError):
    """The request carried no token or a wrong one."""


class CheckpointError(TrajectoryServerError):
    """A checkpoint at ``path`` could not be written or read."""


class CheckpointCorrupt(CheckpointError):
    """The checkpoint at ``path`` fails its magic, length or checksum check."""


class ServiceBusy(TrajectoryServerError):
    """The service already serves ``limit`` authenticated connections; try again later."""


class TransportError(TrajectoryServerError):
    """The connection to the service failed or was closed."""


ERROR_CLASSES: dict[str, type[TrajectoryServerError]] = {
    cls.__name__: cls
    for cls in (
        TrajectoryServerError,
        UsageError,
        ConfigError,
        ServiceClosed,
        InvalidRecord,
        StateError,
        UnknownTrajectory,
        UnknownGroup,
        DuplicateTrajectory,
        WrongState,
        NotQueued,
        WrongOwner,
        StaleVersion,
        SegmentMismatch,
        WireError,
        MalformedMessage,
        SchemaMismatch,
        UnknownMessageType,
        MessageTooLarge,
        Unauthorized,
        CheckpointError,
        CheckpointCorrupt,
        ServiceBusy,
        TransportError,
    )
}
"""Name → class, used to raise a remote error again on the client side."""
