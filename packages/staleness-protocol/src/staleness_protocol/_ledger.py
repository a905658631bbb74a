"""Live ledger entries and the tombstones of ended ones (internal; public views in _records).

Only live entries are kept in full: trajectories in flight, finished or occupied, and groups
reserved or occupied. When an entry ends it leaves the live ledger:

* a consumed trajectory is forgotten (counted in the statistics);
* an aborted or dropped trajectory, and every closed group (consumed, dropped, aborted),
  becomes a *tombstone*: its id, group, V_traj, state and reason, stamped with the
  ``next_buffer`` at which it ended. A tombstone answers the calls that can legitimately
  arrive late — ``finish`` of a trajectory the protocol aborted while an engine was still
  generating it, a sibling of a group that has closed — and is forgotten once
  ``next_buffer`` passes its stamp by more than ``tombstone_versions`` (checked at each
  ``publish``, or at a ``consume`` when versions are consumed faster than published; a
  version's worth at a time).

So the ledger holds what is live plus what ended in the last ``tombstone_versions``
versions, whatever the length of the run.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ._records import GroupRecord, GroupState, TrajectoryRecord, TrajectoryState

Id = str | int


class Traj:
    __slots__ = ("group_id", "state", "trajectory_id", "version")

    def __init__(
        self,
        trajectory_id: Id,
        group_id: Id,
        version: int,
        state: TrajectoryState = TrajectoryState.IN_FLIGHT,
    ) -> None:
        self.trajectory_id = trajectory_id
        self.group_id = group_id
        self.version = version  # V_traj: fixed at first routing, never changes
        self.state = state


class Group:
    __slots__ = ("buffer", "finished", "group_id", "members", "state")

    def __init__(
        self, group_id: Id, buffer: int | None, state: GroupState = GroupState.RESERVED
    ) -> None:
        self.group_id = group_id
        self.buffer = buffer  # RESERVED: b_entry; OCCUPIED: the buffer it sits in
        self.state = state
        self.members: dict[Id, None] = {}  # live: in flight or finished, in reserve order
        self.finished: list[Id] = []  # finish order; the first n are kept

    def record(self) -> GroupRecord:
        return GroupRecord(
            group_id=self.group_id,
            state=self.state,
            buffer=self.buffer,
            members=tuple(self.members),
            finished=tuple(self.finished),
            reason=None,
        )


class TrajTomb:
    """An aborted or dropped trajectory, remembered for a while."""

    __slots__ = ("group_id", "reason", "stamp", "state", "version", "was_running")

    def __init__(
        self,
        group_id: Id,
        version: int,
        state: TrajectoryState,
        reason: str,
        was_running: bool,
        stamp: int,
    ) -> None:
        self.group_id = group_id
        self.version = version
        self.state = state
        self.reason = reason
        self.was_running = was_running
        self.stamp = stamp

    def record(self, trajectory_id: Id) -> TrajectoryRecord:
        return TrajectoryRecord(
            trajectory_id=trajectory_id,
            group_id=self.group_id,
            version=self.version,
            state=self.state,
            buffer=None,
            reason=self.reason,
        )


class GroupTomb:
    """A closed group (consumed, dropped or aborted), remembered for a while."""

    __slots__ = ("buffer", "reason", "stamp", "state")

    def __init__(self, state: GroupState, reason: str | None, buffer: int | None, stamp: int):
        self.state = state
        self.reason = reason
        self.buffer = buffer  # CONSUMED: the version it was trained at
        self.stamp = stamp

    def record(self, group_id: Id) -> GroupRecord:
        return GroupRecord(
            group_id=group_id,
            state=self.state,
            buffer=self.buffer,
            members=(),
            finished=(),
            reason=self.reason,
        )


class Tombstones:
    """Ended trajectories and groups, bucketed by the ``next_buffer`` at which they ended
    (buckets in that order), kept ``keep`` versions."""

    __slots__ = ("buckets", "groups", "keep", "trajs")

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.trajs: dict[Id, TrajTomb] = {}
        self.groups: dict[Id, GroupTomb] = {}
        # stamp -> (group ids, trajectory ids) that ended then; stamps only grow
        self.buckets: dict[int, tuple[list[Id], list[Id]]] = {}

    def __len__(self) -> int:
        return len(self.trajs) + len(self.groups)

    def _bucket(self, stamp: int) -> tuple[list[Id], list[Id]]:
        bucket = self.buckets.get(stamp)
        if bucket is None:
            bucket = self.buckets[stamp] = ([], [])
        return bucket

    def add_traj(self, trajectory_id: Id, tomb: TrajTomb) -> None:
        self.trajs[trajectory_id] = tomb
        self._bucket(tomb.stamp)[1].append(trajectory_id)

    def add_group(self, group_id: Id, tomb: GroupTomb) -> None:
        self.groups[group_id] = tomb
        self._bucket(tomb.stamp)[0].append(group_id)

    def expire(self, next_buffer: int) -> None:
        """Forget every entry whose stamp is more than ``keep`` versions behind."""
        buckets = self.buckets
        limit = next_buffer - self.keep
        while buckets:
            stamp = next(iter(buckets))
            if stamp >= limit:
                return
            group_ids, traj_ids = buckets.pop(stamp)
            deque(map(self.groups.__delitem__, group_ids), maxlen=0)  # delete, looping in C
            deque(map(self.trajs.__delitem__, traj_ids), maxlen=0)

    def to_list(self) -> list[list[Any]]:
        """Per stamp, oldest first: the groups, then the trajectories that ended then."""
        out: list[list[Any]] = []
        for group_ids, traj_ids in self.buckets.values():
            for key in group_ids:
                g = self.groups[key]
                out.append(["group", key, g.state.value, g.reason, g.buffer, g.stamp])
            for key in traj_ids:
                t = self.trajs[key]
                out.append(
                    [
                        "trajectory",
                        key,
                        t.group_id,
                        t.version,
                        t.state.value,
                        t.reason,
                        t.was_running,
                        t.stamp,
                    ]
                )
        return out

    def load(self, rows: list[list[Any]]) -> None:
        """Rebuild from ``to_list`` output (raises KeyError/ValueError/TypeError if malformed)."""
        last = None
        for row in rows:
            stamp = int(row[-1])
            if last is not None and stamp < last:
                raise ValueError("tombstones are not in the order they ended")
            last = stamp
            kind = row[0]
            if kind == "group":
                _, key, state, reason, buffer, _stamp = row
                if key in self.groups:
                    raise ValueError(f"group tombstone {key!r} appears twice")
                self.add_group(key, GroupTomb(GroupState(state), reason, buffer, stamp))
            elif kind == "trajectory":
                _, key, gid, version, state, reason, was_running, _stamp = row
                if key in self.trajs:
                    raise ValueError(f"trajectory tombstone {key!r} appears twice")
                tstate = TrajectoryState(state)
                if tstate not in (TrajectoryState.ABORTED, TrajectoryState.DROPPED):
                    raise ValueError(f"trajectory tombstone {key!r} is {state}")
                self.add_traj(
                    key, TrajTomb(gid, int(version), tstate, str(reason), bool(was_running), stamp)
                )
            else:
                raise ValueError(f"tombstone kind {kind!r}: allowed 'group' or 'trajectory'")
