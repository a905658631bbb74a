"""Trajectory payload store with a multi-level queue: Route, Interrupt, nothing lost.

The synchronous core is :class:`TrajectoryStore`; the service, clients and wire format live in
:mod:`trajectory_server.service`, :mod:`trajectory_server.client`,
:mod:`trajectory_server.actor` and :mod:`trajectory_server.wire`. See the package README for a worked example.

``SamplingParams`` and ``FinishReason`` are engine-adapters' records (``engine_adapters``),
exported here as the same objects: the store keeps and hands the engine one sampling record.
"""

from engine_adapters import FinishReason, SamplingParams
from trajectory_server._core import ALL_LEVELS, TrajectoryStore
from trajectory_server._groups import GroupByKey
from trajectory_server._packed import FloatArray, IntArray
from trajectory_server._records import (
    MAX_GROUP_SIZE,
    MAX_VERSION,
    ROUTABLE_AFTER,
    Completion,
    EventKind,
    FinishedTrajectory,
    LedgerEvent,
    Location,
    LocationState,
    QueueEntry,
    Segment,
    StoreStats,
    Trajectory,
    routes_out_of_queue,
)
from trajectory_server._version import __version__

__all__ = [
    "ALL_LEVELS",
    "MAX_GROUP_SIZE",
    "MAX_VERSION",
    "ROUTABLE_AFTER",
    "Completion",
    "EventKind",
    "FinishReason",
    "FinishedTrajectory",
    "FloatArray",
    "GroupByKey",
    "IntArray",
    "LedgerEvent",
    "Location",
    "LocationState",
    "QueueEntry",
    "SamplingParams",
    "Segment",
    "StoreStats",
    "Trajectory",
    "TrajectoryStore",
    "__version__",
    "routes_out_of_queue",
]
