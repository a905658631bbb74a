"""Errors raised by the staleness protocol.

Every error leaves the protocol state exactly as it was before the call.

    ProtocolError                  root of everything this package raises
    ├── ConfigError                a ProtocolConfig field is out of range / cannot work (also ValueError)
    ├── NotAdmissible              the assignment would break the bound: keep the trajectory queued
    │   ├── NoFreeSlot             every legal buffer is full or READY right now (may clear later)
    │   ├── SiblingTooStale        join rule v_sibling + η ≥ b_entry fails (route to a newer instance)
    │   └── BelowAbortFloor        version ≤ abort floor: the instance must sync before new work
    ├── ProtocolMisuse             the caller broke the call contract (a bug in the caller)
    │   ├── UnknownTrajectory      no such trajectory id (also KeyError)
    │   ├── UnknownGroup           no such group id (also KeyError)
    │   ├── DuplicateTrajectory    a trajectory id was reserved twice
    │   ├── TrajectoryNotInFlight  finish/abort of a trajectory that is not in flight (finished twice, aborted, ...)
    │   ├── GroupClosed            reserve/drop into a group that is complete, consumed, dropped or aborted
    │   ├── GroupFull              a group already has its n (or n′) live members
    │   ├── NotReady               consume() while the awaited buffer is not READY
    │   └── MechanismDisabled      an optional mechanism was used without its config field
    ├── BadInput                   a value that came from a peer (engine, instance) is invalid
    │   ├── InvalidVersion         a version < 0 or newer than the current version
    │   └── InvalidId              an id that is not a str or int
    └── CorruptState               from_dict() got a dict that is not a consistent protocol state

Context travels as attributes (``group_id``, ``trajectory_id``, ``version``, ``buffer``,
``field`` ...), set to ``None`` where they do not apply.
"""

from __future__ import annotations

from typing import Any

Id = str | int


class ProtocolError(Exception):
    """Root of every error raised by ``staleness_protocol``."""

    def __init__(
        self,
        message: str,
        *,
        group_id: Id | None = None,
        trajectory_id: Id | None = None,
        version: int | None = None,
        buffer: int | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.group_id = group_id
        self.trajectory_id = trajectory_id
        self.version = version
        self.buffer = buffer
        self.field = field


class ConfigError(ProtocolError, ValueError):
    """A config field is out of its allowed range, or the combination cannot work."""

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        super().__init__(f"{field}={value!r} is invalid: allowed {allowed}", field=field)
        self.value = value
        self.allowed = allowed


class NotAdmissible(ProtocolError):
    """Reserving here would break the staleness bound; the trajectory stays queued."""


class NoFreeSlot(NotAdmissible):
    """No buffer in ``[current_version, version + η]`` has a free slot right now."""


class SiblingTooStale(NotAdmissible):
    """A sibling at ``version`` cannot join its group's entry in ``buffer`` (needs v + η ≥ b)."""


class BelowAbortFloor(NotAdmissible):
    """``version`` ≤ the abort floor: nothing generated at it can ever be placed."""

    def __init__(
        self, message: str, *, version: int, abort_floor: int, group_id: Id | None
    ) -> None:
        super().__init__(message, version=version, group_id=group_id)
        self.abort_floor = abort_floor


class ProtocolMisuse(ProtocolError):
    """The caller broke the call contract; nothing changed."""


class UnknownTrajectory(ProtocolMisuse, KeyError):
    """No trajectory with this id was ever reserved."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class UnknownGroup(ProtocolMisuse, KeyError):
    """No group with this id exists."""

    def __str__(self) -> str:
        return self.message


class DuplicateTrajectory(ProtocolMisuse):
    """A trajectory id is already in the ledger; ids must be unique for the protocol's life."""


class TrajectoryNotInFlight(ProtocolMisuse):
    """finish()/abort() of a trajectory whose state is not in-flight.

    ``state`` holds the trajectory's actual state; a caller racing an abort (the engine finished
    just as the protocol aborted it) can check ``state == "aborted"`` and discard the result.
    """

    def __init__(self, message: str, *, trajectory_id: Id, group_id: Id, state: str) -> None:
        super().__init__(message, trajectory_id=trajectory_id, group_id=group_id)
        self.state = state


class GroupClosed(ProtocolMisuse):
    """The group is complete, consumed, dropped or aborted; it takes no new members."""

    def __init__(self, message: str, *, group_id: Id, state: str) -> None:
        super().__init__(message, group_id=group_id)
        self.state = state


class GroupFull(ProtocolMisuse):
    """The group already has ``n`` (``n + group_redundancy``) live members."""


class NotReady(ProtocolMisuse):
    """consume() was called while the buffer for the current version is not READY."""


class MechanismDisabled(ProtocolMisuse):
    """An optional mechanism was used although its config field leaves it off."""


class BadInput(ProtocolError):
    """A value reported by a peer is invalid."""


class InvalidVersion(BadInput):
    """A version below 0 or above the current version (no instance can be ahead of training)."""

    def __init__(self, message: str, *, version: Any, current_version: int) -> None:
        super().__init__(message, version=version if isinstance(version, int) else None)
        self.value = version
        self.current_version = current_version


class InvalidId(BadInput):
    """An id that is not a ``str`` or ``int`` (ids must survive a JSON round trip)."""

    def __init__(self, message: str, *, field: str, value: Any) -> None:
        super().__init__(message, field=field)
        self.value = value


class CorruptState(ProtocolError):
    """from_dict() got a dict that is not a consistent protocol state."""


__all__ = [
    "BadInput",
    "BelowAbortFloor",
    "ConfigError",
    "CorruptState",
    "DuplicateTrajectory",
    "GroupClosed",
    "GroupFull",
    "InvalidId",
    "InvalidVersion",
    "MechanismDisabled",
    "NoFreeSlot",
    "NotAdmissible",
    "NotReady",
    "ProtocolError",
    "ProtocolMisuse",
    "SiblingTooStale",
    "TrajectoryNotInFlight",
    "UnknownGroup",
    "UnknownTrajectory",
]
