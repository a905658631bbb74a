"""Frames in, frames out: the synchronous request handler the service, the in-process client
and the Ray actor wrapper all share.

:meth:`Dispatcher.handle_frame` never raises for anything a peer sends: every failure becomes an
error response, and the store is only touched once the whole request has decoded, the token has
matched and the operation has validated its inputs (store operations are all-or-nothing).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from trajectory_server import _requests, _wire
from trajectory_server._core import TrajectoryStore
from trajectory_server._version import __version__
from trajectory_server.errors import (
    CheckpointError,
    ConfigError,
    MalformedMessage,
    StateError,
    TrajectoryServerError,
    Unauthorized,
)

log = structlog.get_logger("trajectory_server")


class Dispatcher:
    """Runs typed requests against one :class:`TrajectoryStore`.

    ``token``: when set, every request must carry it (compared in constant time).
    ``checkpoint_path``: where ``SaveCheckpoint`` requests write; peers never choose paths.
    """

    def __init__(
        self,
        store: TrajectoryStore | None = None,
        *,
        token: str | None = None,
        checkpoint_path: str | os.PathLike[str] | None = None,
        max_message_bytes: int = _wire.DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        if token is not None and (not isinstance(token, str) or not token):
            raise ConfigError("token must be a non-empty string or None", field="token")
        if not isinstance(max_message_bytes, int) or max_message_bytes < 1024:
            raise ConfigError(
                f"max_message_bytes must be an int >= 1024, got {max_message_bytes!r}",
                field="max_message_bytes",
            )
        self.store = store if store is not None else TrajectoryStore()
        self.max_message_bytes = max_message_bytes
        self.checkpoint_path = None if checkpoint_path is None else Path(checkpoint_path)
        self._token = None if token is None else token.encode("utf-8")
        self.requests = 0
        self.rejected = 0

    @property
    def has_token(self) -> bool:
        return self._token is not None

    def handle_frame(self, data: bytes, *, authenticated: bool = False) -> bytes:
        """Decode, authorize, execute and encode; any error becomes an error response.

        ``authenticated``: the frame came on a connection whose hello carried the token (the
        TCP service's); it may then leave the token out, and one it carries is still checked.
        Otherwise (a frame handed over by other means, such as a Ray call) it must carry it."""
        self.requests += 1
        rid = 0
        try:
            frame = _wire.decode_request(data, max_bytes=self.max_message_bytes)
            rid = frame.request_id
            if not (authenticated and frame.token is None):
                self.authorize(frame.token)
            result = self.execute(frame.request)
            return _wire.encode_ok(rid, _wire.encode_result(frame.request, result))
        except TrajectoryServerError as exc:
            self.rejected += 1
            if rid == 0:
                rid = _wire.peek_request_id(data) if len(data) <= self.max_message_bytes else 0
            level = "info" if isinstance(exc, StateError) else "warning"
            getattr(log, level)(
                "request_rejected", error=type(exc).__name__, detail=exc.message, request_id=rid
            )
            return _wire.encode_error(rid, exc)
        except Exception as exc:  # a bug, not bad input: report it without killing the service
            self.rejected += 1
            log.exception("request_failed", request_id=rid)
            return _wire.encode_error(
                rid, TrajectoryServerError(f"internal error: {type(exc).__name__}: {exc}")
            )

    def authorize(self, token: str | None) -> None:
        if self._token is None:
            return
        given = (token or "").encode("utf-8")
        if not token or not hmac.compare_digest(given, self._token):
            raise Unauthorized("missing or wrong token", field="envelope.token")

    def execute(self, req: Any) -> Any:
        """Run one decoded request against the store and return its typed result."""
        handler = _HANDLERS.get(type(req))
        if handler is None:
            raise MalformedMessage(f"unsupported request {type(req).__name__}", field="type")
        return handler(self, req)

    def save_checkpoint(self, path: str | os.PathLike[str] | None = None) -> Path:
        target = Path(path) if path is not None else self.checkpoint_path
        if target is None:
            raise CheckpointError(
                "this server has no checkpoint_path configured", path=None, field="checkpoint_path"
            )
        written = self.store.save_checkpoint(target)
        log.info("checkpoint_saved", path=str(written), trajectories=len(self.store))
        return written


def _finish(d: Dispatcher, r: _requests.Finish) -> Any:
    done = d.store.finish(r.instance_id, r.completions)
    return done if r.echo else len(done)


def _submit_group(d: Dispatcher, r: _requests.SubmitGroup) -> Any:
    ids = d.store.submit_group(
        r.group_id,
        r.prompt_token_ids,
        r.n,
        sampling=r.sampling,
        metadata=r.metadata,
        target_lengths=r.target_lengths,
        prompt_key=r.prompt_key,
    )
    return ids if r.echo else len(ids)


def _put_prompts(d: Dispatcher, r: _requests.PutPrompts) -> Any:
    return d.store.prompts.put(zip(r.keys, r.prompt_token_ids, r.metadata, strict=True))


#: each request type and what it does to the store (one entry per type of ``_requests``)
_HANDLERS: dict[type, Callable[[Dispatcher, Any], Any]] = {
    _requests.Route: lambda d, r: d.store.route(r.instance_id, r.trajectory_ids, r.version),
    _requests.ReturnPartial: lambda d, r: d.store.return_partial(r.instance_id, r.segments),
    _requests.Finish: _finish,
    _requests.Submit: lambda d, r: d.store.submit(r.trajectories),
    _requests.SubmitGroup: _submit_group,
    _requests.SubmitGroups: lambda d, r: d.store.submit_groups(
        r.groups, sampling=r.sampling, skip_existing=r.skip_existing
    ),
    _requests.PutPrompts: _put_prompts,
    _requests.Drop: lambda d, r: d.store.drop(r.trajectory_ids, r.reason),
    _requests.DropGroup: lambda d, r: d.store.drop_group(r.group_id, r.reason),
    _requests.InstanceLost: lambda d, r: d.store.instance_lost(r.instance_id),
    _requests.Release: lambda d, r: d.store.release(r.trajectory_ids),
    _requests.Free: lambda d, r: d.store.free(r.trajectory_ids),
    _requests.FinishedIds: lambda d, r: d.store.finished_ids(),
    _requests.GetFinished: lambda d, r: d.store.finished(r.trajectory_ids),
    _requests.QueueView: lambda d, r: d.store.queue_view(r.limit, level=r.level),
    _requests.Stats: lambda d, r: d.store.stats(),
    _requests.Locate: lambda d, r: tuple(d.store.location(t) for t in r.trajectory_ids),
    _requests.Get: lambda d, r: tuple(d.store.get(t) for t in r.trajectory_ids),
    _requests.History: lambda d, r: d.store.history(r.trajectory_id),
    _requests.HeldBy: lambda d, r: d.store.held_by(r.instance_id),
    _requests.Group: lambda d, r: d.store.group(r.group_id),
    _requests.SaveCheckpoint: lambda d, r: str(d.save_checkpoint()),
    _requests.Ping: lambda d, r: {"schema": _wire.SCHEMA_VERSION, "version": __version__},
}
