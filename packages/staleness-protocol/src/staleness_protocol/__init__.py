"""Per-trajectory staleness bound: Reserve / Occupy / Consume over per-version buffers (sans-IO).

    from staleness_protocol import StalenessProtocol, ProtocolConfig, NotAdmissible
    p = StalenessProtocol(ProtocolConfig(batch_size=B, group_size=n, eta=eta))
    # no staleness control (the bound taken out; same interface):
    p = UnboundedFifo(UnboundedConfig(batch_size=B, group_size=n, max_inflight_groups=2 * B))

See the package README for the rules and the full API.
"""

from ._config import ProtocolConfig
from ._from_dict import protocol_from_dict
from ._gc_fifo import GC_FIFO_FORMAT, GcFifo, GcFifoConfig
from ._protocol import FORMAT, StalenessProtocol
from ._records import (
    Abort,
    AbortReason,
    Batch,
    BufferFill,
    GroupMove,
    GroupRecord,
    GroupState,
    ProtocolStats,
    ReplacementRequest,
    SlotState,
    StuckResolution,
    TrajectoryRecord,
    TrajectoryState,
)
from ._unbounded import UNBOUNDED_FORMAT, UnboundedConfig, UnboundedFifo
from .errors import (
    BadInput,
    BelowAbortFloor,
    ConfigError,
    CorruptState,
    DuplicateTrajectory,
    GroupClosed,
    GroupFull,
    InvalidId,
    InvalidVersion,
    MechanismDisabled,
    NoFreeSlot,
    NotAdmissible,
    NotReady,
    ProtocolError,
    ProtocolMisuse,
    SiblingTooStale,
    TrajectoryNotInFlight,
    UnknownGroup,
    UnknownTrajectory,
)

__version__ = "0.1.0"

__all__ = [
    "FORMAT",
    "GC_FIFO_FORMAT",
    "UNBOUNDED_FORMAT",
    "Abort",
    "AbortReason",
    "BadInput",
    "Batch",
    "BelowAbortFloor",
    "BufferFill",
    "ConfigError",
    "CorruptState",
    "DuplicateTrajectory",
    "GcFifo",
    "GcFifoConfig",
    "GroupClosed",
    "GroupFull",
    "GroupMove",
    "GroupRecord",
    "GroupState",
    "InvalidId",
    "InvalidVersion",
    "MechanismDisabled",
    "NoFreeSlot",
    "NotAdmissible",
    "NotReady",
    "ProtocolConfig",
    "ProtocolError",
    "ProtocolMisuse",
    "ProtocolStats",
    "ReplacementRequest",
    "SiblingTooStale",
    "SlotState",
    "StalenessProtocol",
    "StuckResolution",
    "TrajectoryNotInFlight",
    "TrajectoryRecord",
    "TrajectoryState",
    "UnboundedConfig",
    "UnboundedFifo",
    "UnknownGroup",
    "UnknownTrajectory",
    "__version__",
    "protocol_from_dict",
]
