"""Rebuild a StalenessProtocol from ``to_dict`` output, checking it is consistent."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._buffers import Buffer
from ._config import ProtocolConfig
from ._migrate import upgraded
from ._records import GroupState
from .errors import CorruptState

if TYPE_CHECKING:
    from ._protocol import StalenessProtocol


def _fail(message: str) -> CorruptState:
    return CorruptState(message)


def restore(cls: type[StalenessProtocol], data: dict[str, Any]) -> StalenessProtocol:
    from ._protocol import FORMAT

    data = upgraded(data, FORMAT)
    config = ProtocolConfig.from_dict(data["config"])
    version = data["next_buffer"]
    p = cls(config, start_version=version)
    top = int(data["top"])
    if not version - 1 <= top <= version + config.eta:
        raise _fail(f"top={top} outside [{version - 1}, {version + config.eta}]")
    p._top = top
    buffers_in = data["buffers"]
    if [b["version"] for b in buffers_in] != list(range(version, top + 1)):
        raise _fail("buffers must be exactly next_buffer..top, in order")
    for b in buffers_in:
        buf = Buffer(b["version"], config.slots_per_buffer, config.batch_size)
        buf.occupied = dict.fromkeys(b["occupied"])
        buf.reserved = dict.fromkeys(b["reserved"])
        if len(buf.occupied) + len(buf.reserved) > buf.slots or len(buf.occupied) > buf.need:
            raise _fail(f"buffer {buf.version} exceeds its capacity")
        if buf.ready and buf.reserved:
            raise _fail(f"buffer {buf.version} is READY but holds reservations")
        p._buffers[buf.version] = buf
    p._restore_ledger(data)
    for g in p._groups.values():
        home = p._buffers.get(g.buffer) if g.buffer is not None else None
        slots = None
        if home is not None:
            slots = home.reserved if g.state is GroupState.RESERVED else home.occupied
        if slots is None or g.group_id not in slots:
            raise _fail(f"group {g.group_id!r} is {g.state.value} but not in buffer {g.buffer}")
    for buf in p._buffers.values():
        for want, ids in ((GroupState.RESERVED, buf.reserved), (GroupState.OCCUPIED, buf.occupied)):
            for gid in ids:
                entry = p._groups.get(gid)
                if entry is None or entry.state is not want:
                    raise _fail(f"buffer {buf.version} holds {gid!r}, which is not {want.value}")
    return p
