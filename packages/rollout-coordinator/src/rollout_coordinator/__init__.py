"""Snapshot-command cycle: cost-model routing, per-instance sync, migration, baselines."""

from rollout_coordinator._commands import (
    Command,
    Drop,
    Interrupt,
    InterruptReason,
    PendingRoutes,
    Route,
    Sync,
)
from rollout_coordinator._config import MIGRATION_INDICATORS, PROFILES, CoordinatorConfig
from rollout_coordinator._cycle import Coordinator, CycleReport
from rollout_coordinator._records import (
    InstanceSnapshot,
    QueuedTrajectory,
    QueueView,
    RunningEntry,
    RunningRows,
)
from rollout_coordinator._speculative import InstanceState, SpeculativeState
from rollout_coordinator._state import coordinator_from_dict, coordinator_to_dict
from rollout_coordinator.cost_model import PRESETS, CostModel
from rollout_coordinator.errors import (
    ConfigError,
    CoordinatorError,
    CostModelError,
    FitError,
    FutureSnapshot,
    InconsistentSnapshot,
    InvalidSnapshot,
    SnapshotRejected,
    StaleSnapshot,
    SyncInProgress,
    UnknownInstance,
    UnknownPolicy,
)

__version__ = "0.2.0"

__all__ = [
    "MIGRATION_INDICATORS",
    "PRESETS",
    "PROFILES",
    "Command",
    "ConfigError",
    "Coordinator",
    "CoordinatorConfig",
    "CoordinatorError",
    "CostModel",
    "CostModelError",
    "CycleReport",
    "Drop",
    "FitError",
    "FutureSnapshot",
    "InconsistentSnapshot",
    "InstanceSnapshot",
    "InstanceState",
    "Interrupt",
    "InterruptReason",
    "InvalidSnapshot",
    "PendingRoutes",
    "QueueView",
    "QueuedTrajectory",
    "Route",
    "RunningEntry",
    "RunningRows",
    "SnapshotRejected",
    "SpeculativeState",
    "StaleSnapshot",
    "Sync",
    "SyncInProgress",
    "UnknownInstance",
    "UnknownPolicy",
    "coordinator_from_dict",
    "coordinator_to_dict",
]
