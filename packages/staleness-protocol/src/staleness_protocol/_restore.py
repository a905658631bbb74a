"""Rebuild a StalenessProtocol from ``to_dict`` output, checking it is consistent."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._buffers import Buffer
from ._config import ProtocolConfig
from ._ledger import Group, Traj
from ._records import GroupState, TrajectoryState
from .errors import CorruptState

if TYPE_CHECKING:
    from ._protocol import StalenessProtocol


def _fail(message: str) -> CorruptState:
    return CorruptState(message)


def restore(cls: type[StalenessProtocol], data: dict[str, Any]) -> StalenessProtocol:
    from ._protocol import FORMAT

    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _fail(f"format must be {FORMAT!r}")
    config = ProtocolConfig.from_dict(data["config"])
    version = data["current_version"]
    p = cls(config, start_version=version)
    top = int(data["top"])
    if not version - 1 <= top <= version + config.eta:
        raise _fail(f"top={top} outside [{version - 1}, {version + config.eta}]")
    p._top = top
    buffers_in = data["buffers"]
    if [b["version"] for b in buffers_in] != list(range(version, top + 1)):
        raise _fail("buffers must be exactly current_version..top, in order")
    for b in buffers_in:
        buf = Buffer(b["version"], config.slots_per_buffer, config.batch_size)
        buf.occupied = dict.fromkeys(b["occupied"])
        buf.reserved = dict.fromkeys(b["reserved"])
        if len(buf.occupied) + len(buf.reserved) > buf.slots or len(buf.occupied) > buf.need:
            raise _fail(f"buffer {buf.version} exceeds its capacity")
        if buf.ready and buf.reserved:
            raise _fail(f"buffer {buf.version} is READY but holds reservations")
        p._buffers[buf.version] = buf
    for gid, state, buffer, members, finished, reason in data["groups"]:
        g = Group(gid, buffer, GroupState(state), reason)
        g.members = dict.fromkeys(members)
        g.finished = list(finished)
        if gid in p._groups:
            raise _fail(f"duplicate group {gid!r}")
        p._groups[gid] = g
        p._gcount[g.state] += 1
        if g.state is GroupState.RESERVED and gid not in p._buffers[buffer].reserved:
            raise _fail(f"group {gid!r} is reserved but not in buffer {buffer}")
        if g.state is GroupState.OCCUPIED and gid not in p._buffers[buffer].occupied:
            raise _fail(f"group {gid!r} is occupied but not in buffer {buffer}")
    for buf in p._buffers.values():
        for gid in buf.reserved:
            if p._groups[gid].state is not GroupState.RESERVED:
                raise _fail(f"buffer {buf.version} reserves non-reserved group {gid!r}")
        for gid in buf.occupied:
            if p._groups[gid].state is not GroupState.OCCUPIED:
                raise _fail(f"buffer {buf.version} occupies non-occupied group {gid!r}")
    for tid, gid, tversion, state, buffer, reason in data["trajectories"]:
        if tid in p._trajs:
            raise _fail(f"duplicate trajectory {tid!r}")
        if gid not in p._groups:
            raise _fail(f"trajectory {tid!r} names unknown group {gid!r}")
        t = Traj(tid, gid, tversion, TrajectoryState(state), buffer, reason)
        p._trajs[tid] = t
        p._tcount[t.state] += 1
    for g in p._groups.values():
        for tid in g.members:
            if tid not in p._trajs:
                raise _fail(f"group {g.group_id!r} names unknown member {tid!r}")
    p._restore_outboxes_and_counters(data)
    return p
