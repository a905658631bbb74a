"""Errors raised by the rollout coordinator.

CoordinatorError                 root of this package; context travels as attributes
├── ConfigError (ValueError)     misuse by the caller: a config field out of range
│   │                            (``.field``, ``.allowed``, ``.value``)
│   └── UnknownPolicy            no policy registered under that name (``.name``, ``.known``)
├── SnapshotRejected             bad input from a peer (an engine snapshot); the coordinator
│   │                            keeps its last good state for that instance
│   ├── UnknownInstance          the instance was never registered (``.instance_id``)
│   ├── InvalidSnapshot          negative counts, duplicate ids, KV over capacity (``.field``)
│   ├── StaleSnapshot            older than the last local update, or a sequence regression
│   ├── FutureSnapshot           taken after the coordinator's ``now``
│   └── InconsistentSnapshot     contradicts what the coordinator knows (version regression,
│                                a version nobody synced to)
├── SyncInProgress               a second sync for an instance that is mid-sync
└── FitError (ValueError)        the profile cannot be fitted (too few / malformed records)

CostModelError (``.field``: bad coefficients, preset name or coefficient file) belongs to the
cost model, which lives in engine-adapters; it is re-exported here unchanged
(``engine_adapters.errors.CostModelError``, a ValueError).
"""

from __future__ import annotations

from typing import Any

from engine_adapters.errors import CostModelError


class CoordinatorError(Exception):
    """Root of every rollout-coordinator error."""


class ConfigError(CoordinatorError, ValueError):
    def __init__(self, field: str, value: Any, allowed: str, *, detail: str = "") -> None:
        msg = f"{field} must be {allowed}, got {value!r}"
        if detail:
            msg = f"{msg} ({detail})"
        super().__init__(msg)
        self.field = field
        self.value = value
        self.allowed = allowed
        self.detail = detail


class UnknownPolicy(ConfigError):
    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__("policy", name, f"one of {sorted(known)}")
        self.name = name
        self.known = sorted(known)


class SnapshotRejected(CoordinatorError):
    def __init__(self, message: str, *, instance_id: str, field: str | None = None) -> None:
        super().__init__(f"snapshot of instance {instance_id!r} rejected: {message}")
        self.instance_id = instance_id
        self.field = field


class UnknownInstance(SnapshotRejected, KeyError):
    def __init__(self, instance_id: str, known: list[str] | None = None) -> None:
        detail = "instance is not registered"
        if known is not None:
            detail += f" (known: {sorted(known)[:8]}{'...' if len(known) > 8 else ''})"
        super().__init__(detail, instance_id=instance_id, field="instance_id")

    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return str(self.args[0])


class InvalidSnapshot(SnapshotRejected, ValueError):
    pass


class StaleSnapshot(SnapshotRejected):
    pass


class FutureSnapshot(SnapshotRejected):
    pass


class InconsistentSnapshot(SnapshotRejected):
    pass


class SyncInProgress(CoordinatorError):
    def __init__(self, instance_id: str, to_version: int) -> None:
        super().__init__(
            f"instance {instance_id!r} is already syncing to version {to_version}; "
            "a second sync is never issued mid-sync"
        )
        self.instance_id = instance_id
        self.to_version = to_version


class FitError(CoordinatorError, ValueError):
    def __init__(self, message: str, *, line: int | None = None) -> None:
        super().__init__(message if line is None else f"line {line}: {message}")
        self.line = line


__all__ = [
    "ConfigError",
    "CoordinatorError",
    "CostModelError",
    "FitError",
    "FutureSnapshot",
    "InconsistentSnapshot",
    "InvalidSnapshot",
    "SnapshotRejected",
    "StaleSnapshot",
    "SyncInProgress",
    "UnknownInstance",
    "UnknownPolicy",
]
