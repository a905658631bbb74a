"""Mutable per-trajectory and per-group entries (internal; the public view is in _records)."""

from __future__ import annotations

from ._records import GroupRecord, GroupState, TrajectoryRecord, TrajectoryState

Id = str | int


class Traj:
    __slots__ = ("buffer", "group_id", "reason", "state", "trajectory_id", "version")

    def __init__(
        self,
        trajectory_id: Id,
        group_id: Id,
        version: int,
        state: TrajectoryState = TrajectoryState.IN_FLIGHT,
        buffer: int | None = None,
        reason: str | None = None,
    ) -> None:
        self.trajectory_id = trajectory_id
        self.group_id = group_id
        self.version = version  # V_traj: fixed at first routing, never changes
        self.state = state
        self.buffer = buffer
        self.reason = reason

    def record(self) -> TrajectoryRecord:
        return TrajectoryRecord(
            trajectory_id=self.trajectory_id,
            group_id=self.group_id,
            version=self.version,
            state=self.state,
            buffer=self.buffer,
            reason=self.reason,
        )


class Group:
    __slots__ = ("buffer", "finished", "group_id", "members", "reason", "state")

    def __init__(
        self,
        group_id: Id,
        buffer: int | None,
        state: GroupState = GroupState.RESERVED,
        reason: str | None = None,
    ) -> None:
        self.group_id = group_id
        self.buffer = buffer  # RESERVED: b_entry; OCCUPIED/CONSUMED: the buffer it sits in
        self.state = state
        self.reason = reason
        self.members: dict[Id, None] = {}  # live: in flight or finished, in reserve order
        self.finished: list[Id] = []  # finish order; the first n are kept

    def record(self) -> GroupRecord:
        return GroupRecord(
            group_id=self.group_id,
            state=self.state,
            buffer=self.buffer,
            members=tuple(self.members),
            finished=tuple(self.finished),
            reason=self.reason,
        )
