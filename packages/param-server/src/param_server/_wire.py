"""Control-channel framing: length-prefixed msgpack records with a schema version and a token.

Every frame is ``u32 big-endian length`` + msgpack map ``{"schema", "kind", "token", "body"}``.
Only plain msgpack types travel (ints, strs, bytes, lists, maps, None, bools); nothing is ever
unpickled. ``decode`` checks the frame size, schema version, message kind, token and the
field types of the body against the kind's schema; anything else is a ``ProtocolError``.

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

from .errors import ConfigError, ProtocolError

SCHEMA_VERSION = 1
MAX_FRAME_BYTES = 64 << 20
_HEADER = struct.Struct(">I")


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


def _agents(v: object) -> bool:
    return isinstance(v, dict) and all(_str(k) and _bytes(x) for k, x in v.items())


_spec = _tuple_of(_str, _str, _list_of(_int), _int)  # name, dtype, shape, nbytes
# name, slice index, byte_start, byte_end, agent, addr, dev, checksum (None on push)
_xfer = _tuple_of(_str, _int, _int, _int, _str, _int, _int, _opt(_int))

SCHEMAS: Mapping[str, Mapping[str, Callable[[object], bool]]] = {
    # client -> server
    "push_begin": {"version": _int, "rank": _int, "world_size": _int, "tensors": _list_of(_spec)},
    "push_commit": {"push_id": _int, "checksums": _list_of(_tuple_of(_str, _int, _int))},
    "push_abort": {"version": _int},
    "pull_begin": {"receiver": _str, "names": _opt(_list_of(_str)), "version": _opt(_int)},
    "pull_end": {"pull_id": _int, "failed_worker": _opt(_str)},
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


def decode(payload: bytes, token: str | None) -> tuple[str, dict[str, Any]]:
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
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
    """One control connection; not thread-safe (callers serialize with their own lock)."""

    def __init__(self, sock: socket.socket, token: str | None) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.token = token

    @classmethod
    def connect(cls, address: tuple[str, int], token: str | None, timeout: float = 30.0) -> Channel:
        sock = socket.create_connection(address, timeout=timeout)
        sock.settimeout(None)
        return cls(sock, token)

    def send(self, kind: str, body: Mapping[str, Any]) -> None:
        self.sock.sendall(encode(kind, body, self.token))

    def recv(self) -> tuple[str, dict[str, Any]]:
        (n,) = _HEADER.unpack(_recv_exact(self.sock, _HEADER.size))
        if n > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
        return decode(_recv_exact(self.sock, n), self.token)

    def call(self, kind: str, body: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        self.send(kind, body)
        return self.recv()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
