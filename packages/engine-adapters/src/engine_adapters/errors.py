"""Errors raised by engine adapters.

EngineError                      root of this package
├── InvalidRequest               the caller sent a bad request (field named in ``.field``)
│   ├── PromptTooLong            prompt (+ resumed tokens) exceeds the model context
│   ├── InvalidWeights           missing / extra / mis-shaped tensors in load_weights
│   └── CostModelError           bad cost-model coefficients, preset name or coefficient file
├── UnknownTrajectory            interrupt() named an id the engine does not hold
├── EngineUnavailable            the engine is not started, closed or dead
│   └── EngineDead               its process died, or it can never serve again (``check_health``)
└── BackendNotInstalled (also ImportError)  the backend's extra is missing
"""

from __future__ import annotations


class EngineError(Exception):
    """Root of every engine-adapter error."""


class InvalidRequest(EngineError, ValueError):
    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class PromptTooLong(InvalidRequest):
    pass


class InvalidWeights(InvalidRequest):
    pass


class CostModelError(InvalidRequest):
    """Bad cost-model coefficients, an unknown preset or an unreadable coefficient file."""


class UnknownTrajectory(EngineError, KeyError):
    def __init__(self, trajectory_ids: list[str]) -> None:
        super().__init__(f"unknown trajectory id(s): {trajectory_ids!r}")
        self.trajectory_ids = trajectory_ids

    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return str(self.args[0])


class EngineUnavailable(EngineError, RuntimeError):
    pass


class EngineDead(EngineUnavailable):
    """The engine's process died (killed, crashed, out of memory), or it can never serve again
    (a weight load that failed half-way): nothing it held can be recovered from it and every
    later call fails. Raised by ``check_health`` and by the calls
    that find it dead; a host should treat the instance as lost."""


class BackendNotInstalled(EngineError, ImportError):
    def __init__(self, backend: str, extra: str, cause: BaseException | None = None) -> None:
        fix = f"pip install 'engine-adapters[{extra}]'" if extra else "reinstall engine-adapters"
        super().__init__(
            f"engine backend {backend!r} is not installed: {fix} (import failed: {cause})"
        )
        self.backend = backend
        self.extra = extra
