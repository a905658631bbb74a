"""Typed messages between the service and its clients, encoded with msgpack (never pickle).

A request frame is a msgpack map::

    {"schema": SCHEMA_VERSION, "type": "<request type>", "id": <int>, "token": <str>,
     "body": {...fields of the request record...}}

(``token`` left out where the frame needs none: on a TCP connection its hello authenticated)

and a response frame::

    {"schema": SCHEMA_VERSION, "type": "ok" | "error", "id": <same int>, "body": ...}

where an error body is ``{"error": <class name>, "message": str, "context": {...}}`` and the
client raises that class again. Token ids, logprobs and versions travel as msgpack ``bin``
fields of packed little-endian int32/float64 (:mod:`trajectory_server._packed`): ~10x smaller
and faster than lists of ints. Decoding checks, in order: the size limit, msgpack
well-formedness within :data:`FRAME_LIMITS` (no container or string may claim more entries or
bytes than those bounds), the envelope, the schema version, the message type, then every body
field's presence and type (unknown fields are rejected); errors name the field
(``route.trajectory_ids[2]``). Over TCP, none of this runs before the connection has
authenticated (:mod:`trajectory_server._handshake`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import msgpack

from trajectory_server import _plain
from trajectory_server._core import ALL_LEVELS
from trajectory_server._groups import GroupByKey
from trajectory_server._packed import IntArray
from trajectory_server._records import (
    is_int,
)
from trajectory_server._requests import (
    REQUEST_TYPES,
    Drop,
    DropGroup,
    Finish,
    FinishedIds,
    Free,
    Get,
    GetFinished,
    Group,
    HeldBy,
    History,
    InstanceLost,
    Locate,
    PutPrompts,
    QueueView,
    Release,
    ReturnPartial,
    Route,
    SaveCheckpoint,
    Stats,
    Submit,
    SubmitGroup,
    SubmitGroups,
)
from trajectory_server.errors import (
    ERROR_CLASSES,
    InvalidRecord,
    MalformedMessage,
    MessageTooLarge,
    SchemaMismatch,
    TrajectoryServerError,
    UnknownMessageType,
)

SCHEMA_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
MAX_ITEMS = 1 << 20
"""Most entries one msgpack array may hold (a route, submit or release of 1M ids is absurd)."""
MAX_MAP_ITEMS = 1 << 16
"""Most keys one msgpack map may hold (records have a dozen fields; metadata a handful)."""
MAX_STR_BYTES = 16 << 20
"""Longest msgpack string (metadata text such as a ground-truth answer)."""

FRAME_LIMITS: dict[str, int] = {
    "max_str_len": MAX_STR_BYTES,
    "max_bin_len": DEFAULT_MAX_MESSAGE_BYTES,
    "max_array_len": MAX_ITEMS,
    "max_map_len": MAX_MAP_ITEMS,
    "max_ext_len": 0,  # no msgpack extension type is part of the schema
}
"""``msgpack.unpackb`` bounds for every frame (each defaults to the frame length otherwise)."""


# -- body codecs ---------------------------------------------------------------------------------


def _records(
    r: _plain.Reader, name: str, decode: Callable[[_plain.Reader], Any]
) -> tuple[Any, ...]:
    return tuple(
        decode(_plain.Reader(item, f"{r.path}.{name}[{i}]")) for i, item in enumerate(r.items(name))
    )


def _opt_str_list(r: _plain.Reader, name: str) -> tuple[str, ...] | None:
    if r.obj.get(name, None) is None:
        r.seen.add(name)
        return None
    return tuple(r.texts(name))


def _put_prompts(r: _plain.Reader) -> PutPrompts:
    keys, tokens, metadata = r.integers("keys"), r.items("prompt_token_ids"), r.items("metadata")
    for i, (b, m) in enumerate(zip(tokens, metadata, strict=False)):
        if not isinstance(b, bytes) or len(b) % IntArray.itemsize:
            r.fail(f"{r.path}.prompt_token_ids[{i}]", "must be packed int32 bytes")
        if m is not None and not isinstance(m, dict):
            r.fail(f"{r.path}.metadata[{i}]", f"must be a map or null, got {type(m).__name__}")
    if not len(keys) == len(tokens) == len(metadata):
        r.fail(r.path, "keys, prompt_token_ids and metadata differ in length: "
               f"{len(keys)}, {len(tokens)}, {len(metadata)}")  # fmt: skip
    return PutPrompts(keys=tuple(keys), prompt_token_ids=tuple(map(IntArray.from_bytes, tokens)),
                      metadata=tuple(metadata))  # fmt: skip


def _groups(r: _plain.Reader) -> tuple[GroupByKey, ...]:
    out = []
    for i, g in enumerate(r.items("groups")):
        path = f"{r.path}.groups[{i}]"
        if not isinstance(g, list) or len(g) not in (3, 4):
            r.fail(path, "must be [group_id, n, prompt_key] or [group_id, n, prompt_key, seed]")
        try:
            out.append(GroupByKey(group_id=g[0], n=g[1], prompt_key=g[2], seed=[*g, None][3]))
        except InvalidRecord as exc:
            raise InvalidRecord(
                f"{path}: {exc}", field=f"{path}.{exc.context.get('field')}"
            ) from exc
    return tuple(out)


def _encode_body(req: Any) -> dict[str, Any]:
    if isinstance(req, Submit):
        return {"trajectories": [_plain.trajectory_to_plain(t, True) for t in req.trajectories]}
    if isinstance(req, SubmitGroup):  # the fields that are None left out
        body = {"group_id": req.group_id, "n": req.n}
        if req.prompt_token_ids is not None:
            body["prompt_token_ids"] = req.prompt_token_ids.to_bytes()
        if req.prompt_key is not None:
            body["prompt_key"] = req.prompt_key
        body["sampling"] = _plain.sampling_to_plain(req.sampling)
        body["metadata"] = req.metadata  # (always: an older server requires it)
        if req.target_lengths is not None:
            body["target_lengths"] = list(req.target_lengths)
        if not req.echo:
            body["echo"] = False
        return body
    if isinstance(req, SubmitGroups):  # each group [group_id, n, prompt_key(, seed)]
        groups = [[g.group_id, g.n, g.prompt_key, *(() if g.seed is None else (g.seed,))]
                  for g in req.groups]  # fmt: skip
        body = {"groups": groups, "sampling": _plain.sampling_to_plain(req.sampling)}
        return body | ({"skip_existing": True} if req.skip_existing else {})
    if isinstance(req, PutPrompts):
        return {
            "keys": list(req.keys),
            "prompt_token_ids": [t.to_bytes() for t in req.prompt_token_ids],
            "metadata": list(req.metadata),
        }
    if isinstance(req, ReturnPartial):
        return {
            "instance_id": req.instance_id,
            "segments": [_plain.segment_to_plain(s, True) for s in req.segments],
        }
    if isinstance(req, Finish):
        return {
            "instance_id": req.instance_id,
            "completions": [_plain.segment_to_plain(s, True) for s in req.completions],
            **({} if req.echo else {"echo": False}),
        }
    if isinstance(req, QueueView):
        return {"limit": req.limit, "level": "all" if req.level is ALL_LEVELS else req.level}
    out = {}
    for f in attrs.fields(type(req)):
        value = getattr(req, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _decode_body(cls: type, r: _plain.Reader) -> Any:
    if cls is Submit:
        out: Any = Submit(trajectories=_records(r, "trajectories", _plain.trajectory_from_plain))
    elif cls is SubmitGroup:
        targets = r.obj.get("target_lengths")
        out = SubmitGroup(
            group_id=r.text("group_id"),
            prompt_token_ids=r.int_array("prompt_token_ids")
            if "prompt_token_ids" in r.obj
            else None,
            n=r.integer("n"),
            sampling=_plain.sampling_from_plain(r.sub("sampling")),
            metadata=r.mapping("metadata", {}),
            target_lengths=None if targets is None else tuple(r.integers("target_lengths")),
            prompt_key=r.integer("prompt_key", None),
            echo=r.flag("echo", True),
        )
        r.seen.add("target_lengths")
    elif cls is SubmitGroups:
        out = SubmitGroups(
            groups=_groups(r),
            sampling=_plain.sampling_from_plain(r.sub("sampling")),
            skip_existing=r.flag("skip_existing", False),
        )
    elif cls is PutPrompts:
        out = _put_prompts(r)
    elif cls is Route:
        out = Route(
            instance_id=r.text("instance_id"),
            trajectory_ids=tuple(r.texts("trajectory_ids")),
            version=r.integer("version"),
        )
    elif cls is ReturnPartial:
        out = ReturnPartial(
            instance_id=r.text("instance_id"),
            segments=_records(r, "segments", _plain.segment_from_plain),
        )
    elif cls is Finish:
        out = Finish(
            instance_id=r.text("instance_id"),
            completions=_records(r, "completions", _plain.completion_from_plain),
            echo=r.flag("echo", True),
        )
    elif cls is Drop:
        out = Drop(trajectory_ids=tuple(r.texts("trajectory_ids")), reason=r.text("reason"))
    elif cls is DropGroup:
        out = DropGroup(group_id=r.text("group_id"), reason=r.text("reason"))
    elif cls in (InstanceLost, HeldBy):
        out = cls(instance_id=r.text("instance_id"))
    elif cls in (Release, Free, Locate, Get):
        out = cls(trajectory_ids=tuple(r.texts("trajectory_ids")))
    elif cls is GetFinished:
        out = GetFinished(trajectory_ids=_opt_str_list(r, "trajectory_ids"))
    elif cls is QueueView:
        level = r.obj.get("level", "all")
        r.seen.add("level")
        if not (level is None or level == "all" or is_int(level)):
            r.fail(f"{r.path}.level", f"must be an int, null or 'all', got {level!r:.40}")
        out = QueueView(
            limit=r.integer("limit", None), level=ALL_LEVELS if level == "all" else level
        )
    elif cls is History:
        out = History(trajectory_id=r.text("trajectory_id"))
    elif cls is Group:
        out = Group(group_id=r.text("group_id"))
    else:
        out = cls()
    r.done()
    return out


# -- results -------------------------------------------------------------------------------------
# Each request type's result is one of a few shapes; these encode/decode them.


def _ids(value: Any, path: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise MalformedMessage(f"{path}: must be a list of strings", field=path)
    return tuple(value)


def _list_of(value: Any, path: str, decode: Callable[[_plain.Reader], Any]) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise MalformedMessage(f"{path}: must be a list", field=path)
    return tuple(decode(_plain.Reader(v, f"{path}[{i}]")) for i, v in enumerate(value))


def encode_result(req: Any, result: Any) -> Any:
    if isinstance(req, Finish | SubmitGroup) and not req.echo:
        return result  # the count finished (the dispatcher's answer)
    if isinstance(req, Route | Get):
        return [_plain.trajectory_to_plain(t, True) for t in result]
    if isinstance(req, Finish | Release | GetFinished):
        return [_plain.finished_to_plain(f, True) for f in result]
    if isinstance(req, QueueView | ReturnPartial):
        return [_plain.entry_to_plain(e) for e in result]
    if isinstance(req, Stats):
        return _plain.stats_to_plain(result)
    if isinstance(req, Locate):
        return [_plain.location_to_plain(loc) for loc in result]
    if isinstance(req, History):
        return [_plain.event_to_plain(e) for e in result]
    if isinstance(
        req, Submit | SubmitGroup | DropGroup | InstanceLost | HeldBy | Group | FinishedIds
    ):
        return list(result)
    return result  # Drop: None; SaveCheckpoint: str; Ping: dict


def decode_result(req: Any, body: Any) -> Any:
    path = f"{req.TYPE}.result"
    if isinstance(req, Free | PutPrompts | SubmitGroups) or (
        isinstance(req, Finish | SubmitGroup) and not req.echo
    ):
        if not is_int(body) or body < 0:
            raise MalformedMessage(f"{path}: must be an int >= 0", field=path)
        return body
    if isinstance(req, Route | Get):
        return _list_of(body, path, _plain.trajectory_from_plain)
    if isinstance(req, Finish | Release | GetFinished):
        return _list_of(body, path, _plain.finished_from_plain)
    if isinstance(req, QueueView | ReturnPartial):
        if not isinstance(body, list):
            raise MalformedMessage(f"{path}: must be a list", field=path)
        return tuple(_plain.entry_from_plain(v, f"{path}[{i}]") for i, v in enumerate(body))
    if isinstance(req, Stats):
        return _plain.stats_from_plain(body, path)
    if isinstance(req, Locate):
        return _list_of(body, path, _plain.location_from_plain)
    if isinstance(req, History):
        return _list_of(body, path, _plain.event_from_plain)
    if isinstance(
        req, Submit | SubmitGroup | DropGroup | InstanceLost | HeldBy | Group | FinishedIds
    ):
        return _ids(body, path)
    if isinstance(req, Drop):
        if body is not None:
            raise MalformedMessage(f"{path}: must be null", field=path)
        return None
    if isinstance(req, SaveCheckpoint):
        if not isinstance(body, str):
            raise MalformedMessage(f"{path}: must be a string", field=path)
        return body
    if not isinstance(body, dict):
        raise MalformedMessage(f"{path}: must be a map", field=path)
    return body


# -- frames --------------------------------------------------------------------------------------


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def _unpack(data: bytes, max_bytes: int, limits: dict[str, int] = FRAME_LIMITS) -> Any:
    if len(data) > max_bytes:
        raise MessageTooLarge(
            f"message of {len(data)} bytes exceeds the limit of {max_bytes}",
            size=len(data),
            limit=max_bytes,
        )
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, **limits)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise MalformedMessage(
            f"frame: not a valid msgpack message ({exc})", field="frame"
        ) from exc


def _envelope(obj: Any, kinds: tuple[str, ...] | None) -> tuple[str, int, _plain.Reader]:
    r = _plain.Reader(obj, "envelope")
    schema = r._get("schema")
    if not is_int(schema) or schema != SCHEMA_VERSION:
        raise SchemaMismatch(
            f"schema version {schema!r:.40} is not supported; expected {SCHEMA_VERSION}",
            got=schema if is_int(schema) else None,
            expected=SCHEMA_VERSION,
            field="envelope.schema",
        )
    kind = r.text("type")
    if kinds is not None and kind not in kinds:
        raise UnknownMessageType(
            f"unknown message type {kind!r:.60}; known: {', '.join(kinds)}",
            message_type=kind[:60],
            field="envelope.type",
        )
    return kind, r.integer("id"), r


def encode_request(req: Any, request_id: int, token: str | None = None) -> bytes:
    """A request frame; ``token`` None leaves the envelope's ``token`` out (a request on an
    authenticated TCP connection needs none)."""
    envelope: dict[str, Any] = {"schema": SCHEMA_VERSION, "type": req.TYPE, "id": request_id}
    if token is not None:
        envelope["token"] = token
    envelope["body"] = _encode_body(req)
    return _pack(envelope)


def peek_request_id(data: bytes) -> int:
    """Best-effort request id of a frame that failed to decode (0 when unknown)."""
    try:
        obj = msgpack.unpackb(data, raw=False, **FRAME_LIMITS)
        rid = obj.get("id") if isinstance(obj, dict) else None
        return rid if isinstance(rid, int) and not isinstance(rid, bool) else 0
    except Exception:
        return 0


@attrs.frozen(kw_only=True)
class RequestFrame:
    request_id: int
    token: str | None
    request: Any


def decode_request(data: bytes, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> RequestFrame:
    kind, rid, r = _envelope(_unpack(data, max_bytes), tuple(REQUEST_TYPES))
    token = r.text("token", None)
    body = r.sub("body")
    r.done()
    body.path = kind
    return RequestFrame(
        request_id=rid, token=token, request=_decode_body(REQUEST_TYPES[kind], body)
    )


def encode_ok(request_id: int, body: Any) -> bytes:
    return _pack({"schema": SCHEMA_VERSION, "type": "ok", "id": request_id, "body": body})


def _wire_value(value: Any) -> Any:
    if value is None or isinstance(value, bool | str):
        return value
    if is_int(value):
        return value if -(2**63) <= value < 2**64 else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return repr(value)[:200]


def encode_error(request_id: int, exc: TrajectoryServerError) -> bytes:
    context = {k: _wire_value(v) for k, v in exc.context.items()}
    return _pack(
        {
            "schema": SCHEMA_VERSION,
            "type": "error",
            "id": request_id,
            "body": {"error": type(exc).__name__, "message": exc.message, "context": context},
        }
    )


@attrs.frozen(kw_only=True)
class ResponseFrame:
    request_id: int
    ok: bool
    body: Any  # the raw result body, or the rebuilt exception when not ok


def decode_response(data: bytes, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> ResponseFrame:
    kind, rid, r = _envelope(_unpack(data, max_bytes), ("ok", "error"))
    body = r._get("body")
    r.done()
    if kind == "ok":
        return ResponseFrame(request_id=rid, ok=True, body=body)
    er = _plain.Reader(body, "error")
    name = er.text("error")
    message = er.text("message")
    context = er.mapping("context")
    er.done()
    cls = ERROR_CLASSES.get(name, TrajectoryServerError)
    if not all(isinstance(k, str) and k.isidentifier() for k in context):
        raise MalformedMessage("error.context: keys must be identifiers", field="error.context")
    safe = {k: v for k, v in context.items() if k not in ("message", "context", "args")}
    return ResponseFrame(request_id=rid, ok=False, body=cls(message, **safe))
