"""Restore whichever protocol wrote a checkpoint, by its ``format``."""

from __future__ import annotations

from typing import Any

from ._gc_fifo import GC_FIFO_FORMAT, GcFifo
from ._migrate import V1_FORMATS
from ._protocol import FORMAT, StalenessProtocol
from ._unbounded import UNBOUNDED_FORMAT, UnboundedFifo
from .errors import CorruptState

_BY_FORMAT: dict[str, type[StalenessProtocol] | type[UnboundedFifo]] = {
    FORMAT: StalenessProtocol,
    UNBOUNDED_FORMAT: UnboundedFifo,
    GC_FIFO_FORMAT: GcFifo,
}
for _old, _new in V1_FORMATS.items():  # 0.1 checkpoints are migrated on load
    _BY_FORMAT[_old] = _BY_FORMAT[_new]


def protocol_from_dict(data: dict[str, Any]) -> StalenessProtocol | UnboundedFifo:
    """Restore whichever protocol wrote ``data`` (``StalenessProtocol``, ``UnboundedFifo`` or
    ``GcFifo``, current or 0.1 format), chosen by its ``format``; CorruptState otherwise."""
    fmt = data.get("format") if isinstance(data, dict) else None
    cls = _BY_FORMAT.get(fmt) if isinstance(fmt, str) else None
    if cls is None:
        raise CorruptState(f"format={fmt!r} is invalid: allowed one of {sorted(_BY_FORMAT)}")
    return cls.from_dict(data)
