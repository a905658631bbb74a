"""Errors raised by the parameter server.

Tree::

    ParamServerError                 root; every error below carries context attributes
    ├── ConfigError                  bad configuration (field, allowed)
    ├── UsageError                   misuse by the caller (bad argument to a public method)
    │   └── UnknownTensor            pull asked for names the version does not hold
    ├── PushFailed                   a push could not be accepted or completed (version, rank, workers)
    │   └── PushConflict             another version is being pushed, or the version is not newer
    ├── VersionUnavailable           no complete version (or not the requested one)
    ├── SliceUnavailable             no holder of some needed slice is alive with a good copy
    ├── ChecksumMismatch             bytes received do not match the checksum pushed with them
    ├── TransferFailed               a NIXL transfer reported an error (worker, op)
    ├── WorkerLost                   a storage worker process died or its channel broke
    ├── ServiceBusy                  the control endpoint already serves its connection limit
    └── ProtocolError                a peer sent a malformed, oversized, unauthenticated or
                                     out-of-schema message (bad input from a peer, not misuse)

``RemoteError`` is what a client raises when the server answered with an error whose kind it
does not map to a class above.
"""

from __future__ import annotations

from collections.abc import Sequence


class ParamServerError(Exception):
    """Root of every param-server error."""


class ConfigError(ParamServerError):
    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"config field {field!r}={value!r} is invalid; allowed: {allowed}")


class UsageError(ParamServerError):
    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        super().__init__(message)


class UnknownTensor(UsageError):
    def __init__(self, names: Sequence[str], version: int) -> None:
        self.names = tuple(names)
        self.version = version
        super().__init__(
            f"version {version} holds no tensor named {list(self.names)!r}", field="names"
        )


class PushFailed(ParamServerError):
    def __init__(
        self,
        message: str,
        *,
        version: int | None = None,
        rank: int | None = None,
        workers: Sequence[str] = (),
    ) -> None:
        self.version = version
        self.rank = rank
        self.workers = tuple(workers)
        ctx = []
        if version is not None:
            ctx.append(f"version={version}")
        if rank is not None:
            ctx.append(f"rank={rank}")
        if self.workers:
            ctx.append(f"workers={list(self.workers)}")
        super().__init__(f"push failed: {message}" + (f" ({', '.join(ctx)})" if ctx else ""))


class PushConflict(PushFailed):
    pass


class VersionUnavailable(ParamServerError):
    def __init__(self, message: str, *, version: int | None = None) -> None:
        self.version = version
        super().__init__(message)


class SliceUnavailable(ParamServerError):
    def __init__(
        self,
        version: int,
        slices: Sequence[tuple[str, int]],
        dead_workers: Sequence[str],
        dropped: Sequence[tuple[str, int, str]] = (),
    ) -> None:
        self.version = version
        self.slices = tuple(slices)
        self.dead_workers = tuple(dead_workers)
        #: (name, slice index, worker) of copies dropped after a checksum mismatch
        self.dropped = tuple(dropped)
        shown = list(self.slices[:8])
        more = f" and {len(self.slices) - 8} more" if len(self.slices) > 8 else ""
        corrupt = (
            f"; copies dropped after a checksum mismatch: {list(self.dropped[:8])}"
            if self.dropped
            else ""
        )
        super().__init__(
            f"version {version}: no live holder for slices {shown}{more} "
            f"(dead workers: {list(self.dead_workers)}{corrupt})"
        )


class ChecksumMismatch(ParamServerError):
    def __init__(
        self, *, name: str, slice_index: int, version: int, expected: int, actual: int, where: str
    ) -> None:
        self.name = name
        self.slice_index = slice_index
        self.version = version
        self.expected = expected
        self.actual = actual
        self.where = where
        super().__init__(
            f"checksum mismatch for {name!r} slice {slice_index} of version {version} at "
            f"{where}: expected {expected:#018x}, got {actual:#018x}"
        )


class TransferFailed(ParamServerError):
    def __init__(self, message: str, *, worker: str | None = None, op: str | None = None) -> None:
        self.worker = worker
        self.op = op
        super().__init__(message)


class WorkerLost(ParamServerError):
    def __init__(self, worker: str, message: str = "") -> None:
        self.worker = worker
        super().__init__(f"storage worker {worker!r} lost" + (f": {message}" if message else ""))


class ServiceBusy(ParamServerError):
    def __init__(self, message: str, *, limit: int | None = None) -> None:
        self.limit = limit
        super().__init__(message)


class ProtocolError(ParamServerError):
    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        super().__init__(message)


class RemoteError(ParamServerError):
    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        super().__init__(f"{kind}: {message}")
