"""Per-trajectory staleness bound: Reserve / Occupy / Consume over per-version buffers (sans-IO).

    from staleness_protocol import StalenessProtocol, ProtocolConfig, Admission
    p = StalenessProtocol(ProtocolConfig(batch_size=B, group_size=n, eta=eta))
    # admit at p.published_version or older, finish, drain p.take_notices(), consume, publish
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
    Admission,
    Batch,
    BufferFill,
    FinishOutcome,
    FinishStatus,
    GroupAborted,
    GroupMove,
    GroupRecord,
    GroupState,
    Notice,
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
    GroupNotDroppable,
    InvalidId,
    InvalidVersion,
    MechanismDisabled,
    NoFreeSlot,
    NotAdmissible,
    NotReady,
    ProtocolError,
    ProtocolMisuse,
    PublishOutOfOrder,
    SiblingTooStale,
    TrajectoryNotInFlight,
    UnknownGroup,
    UnknownTrajectory,
    VersionNotPublished,
)

__version__ = "0.2.0"

__all__ = [
    "FORMAT",
    "GC_FIFO_FORMAT",
    "UNBOUNDED_FORMAT",
    "Abort",
    "AbortReason",
    "Admission",
    "BadInput",
    "Batch",
    "BelowAbortFloor",
    "BufferFill",
    "ConfigError",
    "CorruptState",
    "DuplicateTrajectory",
    "FinishOutcome",
    "FinishStatus",
    "GcFifo",
    "GcFifoConfig",
    "GroupAborted",
    "GroupClosed",
    "GroupFull",
    "GroupMove",
    "GroupNotDroppable",
    "GroupRecord",
    "GroupState",
    "InvalidId",
    "InvalidVersion",
    "MechanismDisabled",
    "NoFreeSlot",
    "NotAdmissible",
    "NotReady",
    "Notice",
    "ProtocolConfig",
    "ProtocolError",
    "ProtocolMisuse",
    "ProtocolStats",
    "PublishOutOfOrder",
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
    "VersionNotPublished",
    "__version__",
    "protocol_from_dict",
]
