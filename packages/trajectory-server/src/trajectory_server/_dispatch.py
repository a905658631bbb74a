"""Frames in, frames out: the synchronous request handler the service, the in-process client
and the Ray actor wrapper all share.

:meth:`Dispatcher.handle_frame` never raises for anything a peer sends: every failure becomes an
error response, and the store is only touched once the whole request has decoded, the token has
matched and the operation has validated its inputs (store operations are all-or-nothing).
"""

from __future__ import annotations

import hmac
import os
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
        s = self.store
        if isinstance(req, _requests.Route):
            return s.route(req.instance_id, req.trajectory_ids, req.version)
        if isinstance(req, _requests.ReturnPartial):
            return s.return_partial(req.instance_id, req.segments)
        if isinstance(req, _requests.Finish):
            done = s.finish(req.instance_id, req.completions)
            return done if req.echo else len(done)
        if isinstance(req, _requests.Submit):
            return s.submit(req.trajectories)
        if isinstance(req, _requests.SubmitGroup):
            ids = s.submit_group(
                req.group_id,
                req.prompt_token_ids,
                req.n,
                sampling=req.sampling,
                metadata=req.metadata,
                target_lengths=req.target_lengths,
                prompt_key=req.prompt_key,
            )
            return ids if req.echo else len(ids)
        if isinstance(req, _requests.SubmitGroups):
            return s.submit_groups(
                req.groups, sampling=req.sampling, skip_existing=req.skip_existing
            )
        if isinstance(req, _requests.PutPrompts):
            return s.prompts.put(zip(req.keys, req.prompt_token_ids, req.metadata, strict=True))
        if isinstance(req, _requests.Drop):
            return s.drop(req.trajectory_ids, req.reason)
        if isinstance(req, _requests.DropGroup):
            return s.drop_group(req.group_id, req.reason)
        if isinstance(req, _requests.InstanceLost):
            return s.instance_lost(req.instance_id)
        if isinstance(req, _requests.Release):
            return s.release(req.trajectory_ids)
        if isinstance(req, _requests.Free):
            return s.free(req.trajectory_ids)
        if isinstance(req, _requests.FinishedIds):
            return s.finished_ids()
        if isinstance(req, _requests.GetFinished):
            return s.finished(req.trajectory_ids)
        if isinstance(req, _requests.QueueView):
            return s.queue_view(req.limit, level=req.level)
        if isinstance(req, _requests.Stats):
            return s.stats()
        if isinstance(req, _requests.Locate):
            return tuple(s.location(t) for t in req.trajectory_ids)
        if isinstance(req, _requests.Get):
            return tuple(s.get(t) for t in req.trajectory_ids)
        if isinstance(req, _requests.History):
            return s.history(req.trajectory_id)
        if isinstance(req, _requests.HeldBy):
            return s.held_by(req.instance_id)
        if isinstance(req, _requests.Group):
            return s.group(req.group_id)
        if isinstance(req, _requests.SaveCheckpoint):
            return str(self.save_checkpoint())
        if isinstance(req, _requests.Ping):
            return {"schema": _wire.SCHEMA_VERSION, "version": __version__}
        raise MalformedMessage(f"unsupported request {type(req).__name__}", field="type")

    def save_checkpoint(self, path: str | os.PathLike[str] | None = None) -> Path:
        target = Path(path) if path is not None else self.checkpoint_path
        if target is None:
            raise CheckpointError(
                "this server has no checkpoint_path configured", path=None, field="checkpoint_path"
            )
        written = self.store.save_checkpoint(target)
        log.info("checkpoint_saved", path=str(written), trajectories=len(self.store))
        return written
