"""Control-channel framing: length-prefixed msgpack records with a schema version and a token.

Every frame is ``u32 big-endian length`` + msgpack map ``{"schema", "kind", "token", "body"}``.
Only plain msgpack types travel (ints, strs, bytes, lists, maps, None, bools); nothing is ever
unpickled. ``decode`` checks the frame size, msgpack well-formedness within the given limits
(:data:`FRAME_LIMITS`: no container or string may claim more entries or bytes), schema version,
message kind, token and the field types of the body against the kind's schema; anything else is
a ``ProtocolError``.

Every connection starts with a ``hello`` (the client's first frame, at most
:data:`PRE_AUTH_MAX_BYTES`, unpacked under :data:`PRE_AUTH_LIMITS`, token checked); the server
answers ``hello_ok`` with its idle timeout, or an error and closes. Until then it reads nothing
larger and decodes nothing else (see :mod:`param_server._listener`).

Bulk bytes (weights) never travel here: they move over NIXL. The control channel carries
NIXL agent metadata (opaque bytes made by NIXL) and descriptor triples ``(addr, nbytes, dev)``.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import socket
import struct
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from .errors import ConfigError, ParamServerError, ProtocolError, ServiceBusy

SCHEMA_VERSION = 1
MAX_FRAME_BYTES = 64 << 20
PRE_AUTH_MAX_BYTES = 4096
"""Largest frame read from a connection that has not authenticated (sent its hello) yet."""
_HEADER = struct.Struct(">I")

FRAME_LIMITS: Mapping[str, int] = {
    "max_str_len": 1 << 20,
    "max_bin_len": MAX_FRAME_BYTES,  # NIXL agent metadata
    "max_array_len": 1 << 20,  # tensors of a push, reads of a pull
    "max_map_len": 1 << 16,
    "max_ext_len": 0,
}
"""``msgpack.unpackb`` bounds for every frame (each defaults to the frame length otherwise)."""

PRE_AUTH_LIMITS: Mapping[str, int] = {
    "max_str_len": 1024,
    "max_bin_len": 0,
    "max_array_len": 8,
    "max_map_len": 8,
    "max_ext_len": 0,
}
"""``msgpack.unpackb`` bounds for the hello."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: v is None or check(v)


def _list_of(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _tuple_of(*checks: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: (
        isinstance(v, list)
        and len(v) == len(checks)
        and all(c(x) for c, x in zip(checks, v, strict=True))
    )


_int = _is_int


def _str(v: object) -> bool:
    return isinstance(v, str)


def _bytes(v: object) -> bool:
    return isinstance(v, bytes)


def _bool(v: object) -> bool:
    return isinstance(v, bool)


def _number(v: object) -> bool:
    return (_is_int(v) or isinstance(v, float)) and v > 0  # type: ignore[operator]


def _agents(v: object) -> bool:
    return isinstance(v, dict) and all(_str(k) and _bytes(x) for k, x in v.items())


_spec = _tuple_of(_str, _str, _list_of(_int), _int)  # name, dtype, shape, nbytes
# name, slice index, byte_start, byte_end, agent, addr, dev, checksum (None on push)
_xfer = _tuple_of(_str, _int, _int, _int, _str, _int, _int, _opt(_int))

SCHEMAS: Mapping[str, Mapping[str, Callable[[object], bool]]] = {
    # the first message on every connection, and its answer
    "hello": {"worker": _opt(_str)},  # a storage worker names itself (exempt from the cap)
    "hello_ok": {"idle_timeout_s": _opt(_number)},
    # client -> server
    "push_begin": {"version": _int, "rank": _int, "world_size": _int, "tensors": _list_of(_spec)},
    "push_commit": {"push_id": _int, "checksums": _list_of(_tuple_of(_str, _int, _int))},
    "push_abort": {"version": _int},
    "pull_begin": {"receiver": _str, "names": _opt(_list_of(_str)), "version": _opt(_int)},
    "pull_end": {"pull_id": _int, "failed_worker": _opt(_str)},
    # slices whose checksum failed on the pull: (name, slice index, agent read from)
    "pull_repair": {"pull_id": _int, "bad": _list_of(_tuple_of(_str, _int, _str))},
    "status": {},
    # server -> client
    "push_ticket": {"push_id": _int, "version": _int, "writes": _list_of(_xfer), "agents": _agents},
    "push_done": {"version": _int, "complete": _bool},
    "pull_ticket": {
        "pull_id": _int,
        "version": _int,
        "tensors": _list_of(_spec),
        "reads": _list_of(_xfer),
        "agents": _agents,
    },
    "pull_repair_ticket": {"reads": _list_of(_xfer), "agents": _agents},
    "ok": {},
    "status_reply": {"status": lambda v: isinstance(v, dict)},
    "error": {"kind": _str, "message": _str, "context": lambda v: isinstance(v, dict)},
    # worker <-> server
    "worker_hello": {"worker": _str, "agent": _str, "metadata": _bytes, "pid": _int},
    "alloc": {"region": _int, "nbytes": _int},
    "allocated": {"region": _int, "addr": _int, "metadata": _bytes},
    "free": {"region": _int},
    "verify": {"region": _int, "checks": _list_of(_tuple_of(_int, _int, _int))},
    "verified": {"bad": _list_of(_tuple_of(_int, _int))},
    "corrupt": {"region": _int, "offset": _int},
    "ping": {},
    "shutdown": {},
}


def check_bind(host: str, token: str | None) -> None:
    """Loopback by default; any other bind needs a shared token."""
    if is_loopback(host):
        return
    if not token:
        raise ConfigError(
            "host", host, "a loopback address (127.0.0.1, ::1, localhost) unless a token is set"
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def encode(kind: str, body: Mapping[str, Any], token: str | None) -> bytes:
    if kind not in SCHEMAS:
        raise ProtocolError(f"unknown message kind {kind!r}", field="kind")
    payload: bytes = msgpack.packb(
        {"schema": SCHEMA_VERSION, "kind": kind, "token": token, "body": dict(body)},
        use_bin_type=True,
    )
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(payload)) + payload


def decode(
    payload: bytes, token: str | None, limits: Mapping[str, int] = FRAME_LIMITS
) -> tuple[str, dict[str, Any]]:
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True, **limits)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable frame: {exc}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("frame is not a map")
    if msg.get("schema") != SCHEMA_VERSION:
        raise ProtocolError(
            f"schema version {msg.get('schema')!r} not supported; expected {SCHEMA_VERSION}",
            field="schema",
        )
    if token is not None:
        got = msg.get("token")
        if not isinstance(got, str) or not hmac.compare_digest(got, token):
            raise ProtocolError("missing or wrong token", field="token")
    kind = msg.get("kind")
    if not isinstance(kind, str) or kind not in SCHEMAS:
        raise ProtocolError(f"unknown message kind {kind!r}", field="kind")
    body = msg.get("body")
    if not isinstance(body, dict):
        raise ProtocolError(f"{kind}: body is not a map", field="body")
    schema = SCHEMAS[kind]
    extra = set(body) - set(schema)
    if extra:
        raise ProtocolError(f"{kind}: unknown fields {sorted(extra)}", field=sorted(extra)[0])
    for field, check in schema.items():
        if field not in body:
            raise ProtocolError(f"{kind}: missing field {field!r}", field=field)
        if not check(body[field]):
            raise ProtocolError(f"{kind}: field {field!r} has a wrong type or shape", field=field)
    return kind, body


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the control channel")
        got += k
    return bytes(buf)


class Channel:
    """One control connection; not thread-safe (callers serialize with their own lock).

    ``idle_timeout_s`` is what the server announced in its ``hello_ok`` (client side only):
    a connection silent that long is closed by the server.
    """

    def __init__(self, sock: socket.socket, token: str | None) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.token = token
        self.idle_timeout_s: float | None = None

    @classmethod
    def connect(
        cls,
        address: tuple[str, int],
        token: str | None,
        timeout: float = 30.0,
        *,
        worker: str | None = None,
    ) -> Channel:
        """Connect and authenticate (``hello``); a refusal raises its error here."""
        sock = socket.create_connection(address, timeout=timeout)
        chan = cls(sock, token)
        try:
            chan.send("hello", {"worker": worker})
            kind, body = chan.recv(PRE_AUTH_MAX_BYTES)
            if kind == "error":
                raise refusal(body)
            if kind != "hello_ok":
                raise ProtocolError(f"expected 'hello_ok', got {kind!r}", field="kind")
        except BaseException:
            chan.close()
            raise
        sock.settimeout(None)
        chan.idle_timeout_s = body["idle_timeout_s"]
        return chan

    def send(self, kind: str, body: Mapping[str, Any]) -> None:
        self.sock.sendall(encode(kind, body, self.token))

    def recv(
        self, max_bytes: int = MAX_FRAME_BYTES, limits: Mapping[str, int] = FRAME_LIMITS
    ) -> tuple[str, dict[str, Any]]:
        (n,) = _HEADER.unpack(_recv_exact(self.sock, _HEADER.size))
        if n > max_bytes:
            raise ProtocolError(f"frame of {n} bytes exceeds {max_bytes}", field="frame")
        return decode(_recv_exact(self.sock, n), self.token, limits)

    def call(self, kind: str, body: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        self.send(kind, body)
        return self.recv()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def refusal(body: Mapping[str, Any]) -> ParamServerError:
    """The error a server's ``error`` answer to a hello stands for."""
    if body.get("kind") == "ServiceBusy":
        return ServiceBusy(body["message"], limit=body["context"].get("limit"))
    return ProtocolError(str(body["message"]), field=body["context"].get("field"))
