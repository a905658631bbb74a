"""The ledger half of a checkpoint: write it, and read it back checking consistency (internal).

Keys (after the placement keys of each protocol): ``groups`` (live: id, state, buffer,
members, finished), ``trajectories`` (live: id, group, V_traj, state), ``tombstones`` (ended
entries still recognised, in the order they ended), ``notices`` (the undrained outbox), the
replacement counters, the staleness histograms, ``aborts_by_reason``, ``consumed_batches`` and
``ended`` (how many trajectories and groups ever ended in each terminal state).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._checks import check_id as _check_id
from ._checks import is_int as _is_int
from ._ledger import Group, Traj
from ._records import Abort, GroupAborted, GroupState, Notice, ReplacementRequest, TrajectoryState
from .errors import CorruptState

if TYPE_CHECKING:
    from ._ledger_base import LedgerBase

_ENDED_T = (TrajectoryState.CONSUMED, TrajectoryState.DROPPED, TrajectoryState.ABORTED)
_ENDED_G = (GroupState.CONSUMED, GroupState.DROPPED, GroupState.ABORTED)
_LIVE_T = (TrajectoryState.IN_FLIGHT, TrajectoryState.FINISHED, TrajectoryState.OCCUPIED)
_LIVE_G = (GroupState.RESERVED, GroupState.OCCUPIED)


def ledger_to_dict(p: LedgerBase) -> dict[str, Any]:
    """The ledger half of ``to_dict``, in its key order (it follows the placement keys)."""
    return {
        "groups": [
            [g.group_id, g.state.value, g.buffer, list(g.members), list(g.finished)]
            for g in p._groups.values()
        ],
        "trajectories": [
            [t.trajectory_id, t.group_id, t.version, t.state.value] for t in p._trajs.values()
        ],
        "tombstones": p._tombs.to_list(),
        "notices": [_notice_row(n) for n in p._notices],
        "next_replacement_id": p._next_replacement,
        "replacements_requested": p._replacements_requested,
        "staleness_histogram": [[s, n] for s, n in sorted(p._traj_hist.items())],
        "group_staleness_histogram": [[s, n] for s, n in sorted(p._group_hist.items())],
        "aborts_by_reason": dict(sorted(p._aborts_by_reason.items())),
        "consumed_batches": p._consumed_batches,
        "ended": {
            "trajectories": {s.value: p._tcount[s] for s in _ENDED_T},
            "groups": {s.value: p._gcount[s] for s in _ENDED_G},
        },
    }


def restore_ledger(p: LedgerBase, data: dict[str, Any]) -> None:
    """The ledger half of restore (after the placement is set up): live groups and
    trajectories, tombstones, notices, counters. Raises CorruptState (or a KeyError /
    ValueError / TypeError that ``from_dict`` turns into one) on inconsistent input."""
    published = data["published_version"]
    if not _is_int(published) or not 0 <= published <= p._next:
        raise CorruptState(f"published_version={published!r} outside [0, {p._next}]")
    p._published = published
    for gid, state, buffer, members, finished in data["groups"]:
        _check_id(gid, "group_id")
        if gid in p._groups:
            raise CorruptState(f"group {gid!r} appears twice", group_id=gid)
        g = Group(gid, buffer, GroupState(state))
        if g.state not in _LIVE_G:
            raise CorruptState(f"live group {gid!r} is {state}", group_id=gid)
        g.members = dict.fromkeys(members)
        g.finished = list(finished)
        p._groups[gid] = g
        p._gcount[g.state] += 1
    for tid, gid, version, state in data["trajectories"]:
        _check_id(tid, "trajectory_id")
        if tid in p._trajs:
            raise CorruptState(f"trajectory {tid!r} appears twice", trajectory_id=tid)
        owner = p._groups.get(gid)
        if owner is None or tid not in owner.members:
            raise CorruptState(f"trajectory {tid!r} is not a member of a live group {gid!r}")
        if not _is_int(version) or not 0 <= version <= published:
            raise CorruptState(f"trajectory {tid!r} has version {version!r}", trajectory_id=tid)
        t = Traj(tid, gid, version, TrajectoryState(state))
        if t.state not in _LIVE_T:
            raise CorruptState(f"live trajectory {tid!r} is {state}", trajectory_id=tid)
        p._trajs[tid] = t
        p._tcount[t.state] += 1
    for g in p._groups.values():
        if any(tid not in p._trajs for tid in g.members):
            raise CorruptState(f"group {g.group_id!r} names an unknown member")
    p._tombs.load(data["tombstones"])
    p._notices = [_notice_from_row(r) for r in data["notices"]]
    p._next_replacement = int(data["next_replacement_id"])
    p._replacements_requested = int(data["replacements_requested"])
    p._traj_hist = {int(s): int(n) for s, n in data["staleness_histogram"]}
    p._group_hist = {int(s): int(n) for s, n in data["group_staleness_histogram"]}
    p._aborts_by_reason = {str(k): int(v) for k, v in data["aborts_by_reason"].items()}
    p._consumed_batches = int(data["consumed_batches"])
    for s in _ENDED_T:
        p._tcount[s] = int(data["ended"]["trajectories"][s.value])
    for gs in _ENDED_G:
        p._gcount[gs] = int(data["ended"]["groups"][gs.value])


def _notice_row(n: Notice) -> list[Any]:
    if isinstance(n, Abort):
        return ["abort", n.trajectory_id, n.group_id, n.version, n.reason, n.was_running]
    if isinstance(n, GroupAborted):
        return ["group_aborted", n.group_id, n.reason]
    return ["replacement", n.request_id, n.replaces_group_id, n.reason]


def _notice_from_row(row: list[Any]) -> Notice:
    kind = row[0]
    if kind == "abort":
        _, tid, gid, version, reason, was_running = row
        return Abort(
            trajectory_id=tid,
            group_id=gid,
            version=int(version),
            reason=str(reason),
            was_running=bool(was_running),
        )
    if kind == "group_aborted":
        _, gid, reason = row
        return GroupAborted(group_id=gid, reason=str(reason))
    if kind == "replacement":
        _, rid, gid, reason = row
        return ReplacementRequest(request_id=int(rid), replaces_group_id=gid, reason=str(reason))
    raise ValueError(f"notice kind {kind!r}: allowed 'abort', 'group_aborted' or 'replacement'")
