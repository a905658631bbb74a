"""Restore whichever protocol wrote a checkpoint, by its ``format``."""

from __future__ import annotations

from typing import Any

from ._gc_fifo import GC_FIFO_FORMAT, GcFifo
from ._protocol import FORMAT, StalenessProtocol
from ._unbounded import UNBOUNDED_FORMAT, UnboundedFifo
from .errors import CorruptState

_BY_FORMAT: dict[str, type[StalenessProtocol] | type[UnboundedFifo]] = {
    FORMAT: StalenessProtocol,
    UNBOUNDED_FORMAT: UnboundedFifo,
    GC_FIFO_FORMAT: GcFifo,
}


def protocol_from_dict(data: dict[str, Any]) -> StalenessProtocol | UnboundedFifo:
    """Restore whichever protocol wrote ``data`` (``StalenessProtocol``, ``UnboundedFifo`` or
    ``GcFifo``), chosen by its ``format``; CorruptState for anything else."""
    fmt = data.get("format") if isinstance(data, dict) else None
    cls = _BY_FORMAT.get(fmt) if isinstance(fmt, str) else None
    if cls is None:
        raise CorruptState(f"format={fmt!r} is invalid: allowed one of {sorted(_BY_FORMAT)}")
    return cls.from_dict(data)
