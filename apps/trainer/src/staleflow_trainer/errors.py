"""Errors raised by the StaleFlow app.

Tree::

    StaleflowError                 root; every app error derives from it
    ├── ConfigError                bad config file / override (``key``, ``allowed``)
    ├── DataError                  bad dataset (``path``, ``row``, ``field``)
    ├── RewardError                reward plug-in could not be loaded or misbehaved (``fn``)
    ├── TrainerError               misuse of the trainer or a malformed batch (``field``)
    ├── CheckpointError            missing / corrupt / mismatched checkpoint (``path``)
    ├── ComponentLost              a component process the run cannot go on without died
    │                              (``component``); restart the app from its last checkpoint
    ├── StartupFailed              a component (Ray) did not start (``component``)
    └── CommandUnavailable         a CLI command whose implementation is not installed (``module``)
"""

from __future__ import annotations

from typing import Any


class StaleflowError(Exception):
    """Root of the app's exceptions. Each pickles with its fields (``key``, ``path``, ...), so
    it crosses a process boundary as itself: from a simulation worker process of ``compare``
    or from a Ray actor (the subclasses' keyword-only fields would fail the default rebuild)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuilt, (type(self), self.args, dict(self.__dict__)))


def _rebuilt(cls: type[StaleflowError], args: tuple[Any, ...], fields: dict[str, Any]) -> Any:
    """An error of ``cls`` with ``args`` and ``fields``, built as pickle rebuilds it."""
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(fields)
    return err


class ConfigError(StaleflowError):
    """A config key is unknown, has the wrong type, or a value is out of range.

    ``key`` is the full dotted key (``trainer.lr``); ``allowed`` describes the allowed values.
    """

    def __init__(self, message: str, *, key: str, allowed: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.allowed = allowed


class DataError(StaleflowError):
    """A dataset file is missing, unreadable, or a row lacks a required field."""

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        row: int | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.row = row
        self.field = field


class RewardError(StaleflowError):
    """A reward function could not be loaded, or returned something that is not a score."""

    def __init__(self, message: str, *, fn: str | None = None) -> None:
        super().__init__(message)
        self.fn = fn


class TrainerError(StaleflowError):
    """The trainer was misused or handed a malformed batch."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class CheckpointError(StaleflowError):
    """A checkpoint is missing, corrupt (checksum mismatch) or does not match the model."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class ComponentLost(StaleflowError):
    """A component the run needs died (the trainer), or every rollout instance is lost with none
    left to replace them (``rollout``); ``component`` names it. The run stops and
    ``run.resume=auto|must`` restarts it from the last checkpoint."""

    def __init__(self, message: str, *, component: str) -> None:
        super().__init__(message)
        self.component = component


class StartupFailed(StaleflowError):
    """A component the run needs did not start (Ray's start-up timed out on every try);
    ``component`` names it."""

    def __init__(self, message: str, *, component: str) -> None:
        super().__init__(message)
        self.component = component


class CommandUnavailable(StaleflowError):
    """A CLI command's implementation module is not installed / not written yet."""

    def __init__(self, message: str, *, module: str) -> None:
        super().__init__(message)
        self.module = module
