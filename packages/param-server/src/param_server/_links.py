"""The server's side of its storage workers' channels, and errors as wire records."""

from __future__ import annotations

import threading
from typing import Any

from ._wire import Channel
from .errors import ParamServerError, ProtocolError, WorkerLost


class WorkerRefused(ParamServerError):
    """A live worker answered a request with an error (e.g. out of memory)."""

    def __init__(self, worker: str, message: str) -> None:
        self.worker = worker
        super().__init__(f"storage worker {worker!r} {message}")


class WorkerLink:
    """The server's channel to one storage worker process (calls are serialized)."""

    def __init__(self, name: str, chan: Channel, agent: str, metadata: bytes, pid: int) -> None:
        self.name = name
        self.chan = chan
        self.agent = agent
        self.metadata = metadata
        self.pid = pid
        self.lock = threading.Lock()
        self.addrs: dict[int, int] = {}

    def call(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            try:
                rkind, rbody = self.chan.call(kind, body)
            except (OSError, ConnectionError, ProtocolError) as exc:
                raise WorkerLost(self.name, str(exc)) from exc
        if rkind == "error":
            raise WorkerRefused(self.name, f"refused {kind}: {rbody['message']}")
        return rbody


def error_body(exc: ParamServerError) -> dict[str, Any]:
    """An error as the typed record that crosses the wire (class name, message, context)."""
    context: dict[str, Any] = {}
    for key in (
        "version",
        "rank",
        "workers",
        "field",
        "worker",
        "names",
        "slices",
        "dead_workers",
        "name",
        "slice_index",
        "expected",
        "actual",
        "where",
        "dropped",
        "limit",
    ):
        if hasattr(exc, key):
            val = getattr(exc, key)
            if isinstance(val, tuple):
                val = [list(v) if isinstance(v, tuple) else v for v in val]
            context[key] = val
    return {"kind": type(exc).__name__, "message": str(exc), "context": context}
