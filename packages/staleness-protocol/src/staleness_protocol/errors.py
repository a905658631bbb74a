"""Errors raised by the staleness protocol.

Every error leaves the protocol state exactly as it was before the call.

    ProtocolError                  root of everything this package raises
    ├── ConfigError                a config field is out of range / cannot work (also ValueError)
    ├── NotAdmissible              reserve() refused; ``.admission`` says what to do with it
    │   ├── NoFreeSlot             WAIT: every legal buffer is full or READY right now
    │   ├── SiblingTooStale        SYNC: join rule v_sibling + η ≥ b_entry fails (newer instance)
    │   ├── BelowAbortFloor        SYNC: version ≤ abort floor, the instance must sync first
    │   ├── GroupClosed            DISCARD: the group is complete, consumed, dropped or aborted
    │   └── GroupFull              DISCARD: the group already has its n′ live members
    ├── ProtocolMisuse             the caller broke the call contract (a bug in the caller)
    │   ├── UnknownTrajectory      no such trajectory id, or retired long ago (also KeyError)
    │   ├── UnknownGroup           no such group id, or retired long ago (also KeyError)
    │   ├── DuplicateTrajectory    a trajectory id was reserved twice
    │   ├── TrajectoryNotInFlight  finish/abort of a trajectory that had already finished
    │   ├── GroupNotDroppable      drop_group of a group that was consumed or already dropped
    │   ├── PublishOutOfOrder      publish() of anything but published_version + 1 ≤ next_buffer
    │   ├── NotReady               consume() while the awaited buffer is not READY
    │   └── MechanismDisabled      an optional mechanism was used without its config field
    ├── BadInput                   a value that came from a peer (engine, instance) is invalid
    │   ├── InvalidVersion         a version that is not an int ≥ 0 (or outside a range)
    │   │   └── VersionNotPublished  newer than published_version: its weights do not exist yet
    │   └── InvalidId              an id that is not a str or int
    └── CorruptState               from_dict() got a dict that is not a consistent protocol state

Context travels as attributes (``group_id``, ``trajectory_id``, ``version``, ``buffer``,
``field`` ...), set to ``None`` where they do not apply.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ._records import Admission

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
    """``reserve`` refused the trajectory; ``admission`` says what to do with it.

    Each subclass maps to one :class:`~staleness_protocol.Admission` value, the one
    ``can_reserve`` answers for the same call: ``WAIT`` (keep it queued, ask again),
    ``SYNC`` (only an instance at a newer version can take it) or ``DISCARD`` (never).
    """

    admission: ClassVar[Admission]


class NoFreeSlot(NotAdmissible):
    """No buffer in ``[next_buffer, version + η]`` has a free slot right now (or the FIFO's
    in-flight cap is reached): keep it queued and retry at this version later."""

    admission = Admission.WAIT


class SiblingTooStale(NotAdmissible):
    """A sibling at ``version`` cannot join its group's entry in ``buffer`` (needs v + η ≥ b):
    route it to an instance at a newer version."""

    admission = Admission.SYNC


class BelowAbortFloor(NotAdmissible):
    """``version`` ≤ the abort floor: nothing generated at it can ever be placed."""

    admission = Admission.SYNC

    def __init__(
        self, message: str, *, version: int, abort_floor: int, group_id: Id | None
    ) -> None:
        super().__init__(message, version=version, group_id=group_id)
        self.abort_floor = abort_floor


class GroupClosed(NotAdmissible):
    """The group takes no new members (complete, consumed, dropped or aborted): discard it."""

    admission = Admission.DISCARD

    def __init__(self, message: str, *, group_id: Id, state: str) -> None:
        super().__init__(message, group_id=group_id)
        self.state = state


class GroupFull(NotAdmissible):
    """The group already has ``n + group_redundancy`` live members: discard this one."""

    admission = Admission.DISCARD


class ProtocolMisuse(ProtocolError):
    """The caller broke the call contract; nothing changed."""


class UnknownTrajectory(ProtocolMisuse, KeyError):
    """No live or recently ended trajectory has this id (never reserved, or retired)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class UnknownGroup(ProtocolMisuse, KeyError):
    """No live or recently ended group has this id (never reserved, or retired)."""

    def __str__(self) -> str:
        return self.message


class DuplicateTrajectory(ProtocolMisuse):
    """A trajectory id is already in the ledger; ids must be unique for the protocol's life."""


class TrajectoryNotInFlight(ProtocolMisuse):
    """finish()/abort() of a trajectory that had already finished (``state`` says where it is).

    A trajectory the protocol aborted or dropped while it ran is not this error: ``finish``
    answers ``FinishStatus.ALREADY_ENDED`` and ``abort`` returns False.
    """

    def __init__(self, message: str, *, trajectory_id: Id, group_id: Id, state: str) -> None:
        super().__init__(message, trajectory_id=trajectory_id, group_id=group_id)
        self.state = state


class GroupNotDroppable(ProtocolMisuse):
    """drop_group() of a group that was consumed or that the caller already dropped."""

    def __init__(self, message: str, *, group_id: Id, state: str) -> None:
        super().__init__(message, group_id=group_id)
        self.state = state


class PublishOutOfOrder(ProtocolMisuse):
    """publish(version) with a version other than ``allowed`` (``published_version + 1``),
    or with nothing to publish (``allowed`` is None: buffer ``published_version`` has not
    been consumed yet, so no step has produced the next version)."""

    def __init__(self, message: str, *, version: Any, allowed: int | None) -> None:
        super().__init__(message, version=version if isinstance(version, int) else None)
        self.value = version
        self.allowed = allowed


class NotReady(ProtocolMisuse):
    """consume() was called while the buffer ``next_buffer`` is not READY."""


class MechanismDisabled(ProtocolMisuse):
    """An optional mechanism was used although its config field leaves it off."""


class BadInput(ProtocolError):
    """A value reported by a peer is invalid."""


class InvalidVersion(BadInput):
    """A version that is not an int ≥ 0, or outside the range the call allows (``allowed``)."""

    def __init__(self, message: str, *, version: Any, allowed: str) -> None:
        super().__init__(message, version=version if isinstance(version, int) else None)
        self.value = version
        self.allowed = allowed


class VersionNotPublished(InvalidVersion):
    """A version newer than ``published_version``: its weights do not exist yet, so no
    instance can be generating with them."""

    def __init__(self, message: str, *, version: int, published_version: int) -> None:
        super().__init__(message, version=version, allowed=f"an int in [0, {published_version}]")
        self.published_version = published_version


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
    "GroupNotDroppable",
    "InvalidId",
    "InvalidVersion",
    "MechanismDisabled",
    "NoFreeSlot",
    "NotAdmissible",
    "NotReady",
    "ProtocolError",
    "ProtocolMisuse",
    "PublishOutOfOrder",
    "SiblingTooStale",
    "TrajectoryNotInFlight",
    "UnknownGroup",
    "UnknownTrajectory",
    "VersionNotPublished",
]
