"""The per-connection handshake of the TCP service, and the limits that protect it.

Theory of operation
-------------------
A peer that has not proven it holds the token must not be able to make the server allocate more
than a few kilobytes. So every TCP connection starts with one small ``hello`` frame::

    {"schema": 1, "type": "hello", "id": 0, "token": <str|None>, "body": {}}

The server reads its 4-byte length first and refuses (``MessageTooLarge``, then closes) anything
longer than :data:`PRE_AUTH_MAX_BYTES` without reading the body; it unpacks the frame under
:data:`PRE_AUTH_LIMITS` (short strings, no binary, a handful of entries per container) and checks
the token in constant time. It answers ``ok`` with ``{"max_message_bytes", "idle_timeout_s"}``,
or a typed error (``Unauthorized``, ``ServiceBusy``) and closes. Only after an ``ok`` does the
server read frames up to ``max_message_bytes`` and decode them. The connection is then
authenticated: its requests leave the token out (a request that carries one anyway has it
checked, so a wrong one is still refused). Frames handed over by other means — through
:meth:`TrajectoryServerActor.handle`, a Ray call — must carry the token, checked on every one.

:class:`ConnectionLimits` bounds what idle or hostile peers can hold: at most
``max_unauthenticated`` connections may be waiting for their hello (a new one beyond that closes
the oldest waiting one, so a flood of silent connections cannot lock out a real client) and each
has ``handshake_timeout_s`` to send it; at most ``max_connections`` authenticated connections
are served at once (the next hello gets ``ServiceBusy``); an authenticated connection that sends
nothing for ``idle_timeout_s`` is closed. :class:`~trajectory_server.client.TrajectoryClient`
learns the idle timeout from the ``ok`` and pings before it runs out.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from trajectory_server import _plain, _wire
from trajectory_server._records import is_int
from trajectory_server.errors import ConfigError, MalformedMessage, Unauthorized

HELLO = "hello"
PRE_AUTH_MAX_BYTES = 4096
"""Largest frame read from a connection that has not authenticated yet."""

PRE_AUTH_LIMITS: dict[str, int] = {
    "max_str_len": 1024,
    "max_bin_len": 0,
    "max_array_len": 8,
    "max_map_len": 8,
    "max_ext_len": 0,
}
"""``msgpack.unpackb`` bounds for the hello frame."""


def _positive_or_none(name: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"{name} must be a number > 0 or None, got {value!r}", field=name)
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be finite (None disables it), got {value!r}", field=name)


def _count(name: str, value: object) -> None:
    if not is_int(value) or not 1 <= value <= 65536:  # type: ignore[operator]
        raise ConfigError(f"{name} must be an int in [1, 65536], got {value!r}", field=name)


@attrs.frozen(kw_only=True)
class ConnectionLimits:
    """What one TCP service allows its peers (see the module docstring).

    ``idle_timeout_s=None`` keeps idle authenticated connections open forever; the handshake
    timeout always applies.
    """

    max_connections: int = 128
    max_unauthenticated: int = 32
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float | None = 600.0

    def __attrs_post_init__(self) -> None:
        _count("max_connections", self.max_connections)
        _count("max_unauthenticated", self.max_unauthenticated)
        if self.handshake_timeout_s is None:
            raise ConfigError(
                "handshake_timeout_s must be a number > 0", field="handshake_timeout_s"
            )
        _positive_or_none("handshake_timeout_s", self.handshake_timeout_s)
        _positive_or_none("idle_timeout_s", self.idle_timeout_s)


@attrs.frozen(kw_only=True)
class Welcome:
    """The server's answer to a good hello: what this connection may send."""

    max_message_bytes: int
    idle_timeout_s: float | None


def encode_hello(token: str | None) -> bytes:
    return _wire._pack(
        {"schema": _wire.SCHEMA_VERSION, "type": HELLO, "id": 0, "token": token, "body": {}}
    )


def decode_hello(data: bytes) -> str | None:
    """The token a hello frame carries; ``Unauthorized`` if the frame is not a hello."""
    obj = _wire._unpack(data, PRE_AUTH_MAX_BYTES, PRE_AUTH_LIMITS)
    kind, _rid, r = _wire._envelope(obj, None)
    if kind != HELLO:
        raise Unauthorized(
            f"the first frame on a connection must be {HELLO!r} carrying the token, "
            f"got {kind!r:.40}",
            field="envelope.type",
        )
    token = r.text("token", None)
    r.sub("body").done()
    r.done()
    return token  # type: ignore[no-any-return]


def encode_welcome(welcome: Welcome) -> bytes:
    return _wire.encode_ok(
        0,
        {
            "max_message_bytes": welcome.max_message_bytes,
            "idle_timeout_s": welcome.idle_timeout_s,
        },
    )


def decode_welcome(data: bytes, *, max_bytes: int) -> Welcome:
    """The server's answer to our hello; its error raised again if it refused."""
    frame = _wire.decode_response(data, max_bytes=max_bytes)
    if not frame.ok:
        raise frame.body
    r = _plain.Reader(frame.body, "hello.result")
    limit = r.integer("max_message_bytes")
    idle: Any = r._get("idle_timeout_s")
    if idle is not None and not (is_int(idle) or isinstance(idle, float)):
        raise MalformedMessage(
            "hello.result.idle_timeout_s: must be a number or null", field="hello.result"
        )
    r.done()
    return Welcome(max_message_bytes=limit, idle_timeout_s=None if idle is None else float(idle))
