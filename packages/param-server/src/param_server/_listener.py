"""The control port: accepts connections, authenticates each, caps and times them out.

Theory of operation
-------------------
A peer that has not proven it holds the token must not be able to make the server allocate more
than a few kilobytes, hold a thread forever, or crowd out real clients. So:

* every connection starts with a ``hello`` (at most ``PRE_AUTH_MAX_BYTES``, unpacked under
  ``PRE_AUTH_LIMITS``, token checked in constant time). A longer frame is refused from its
  4-byte header, without reading the body; any other first message is refused. Either way the
  peer gets an error message and the connection is closed;
* at most ``max_unauthenticated`` connections may wait for their hello: one more closes the
  oldest waiting one, so a flood of silent connections cannot lock out a client that says hello
  at once; each has ``handshake_timeout_s`` to send it;
* at most ``max_connections`` authenticated client connections are served at once (the next
  hello is answered ``ServiceBusy``); a storage worker (its hello names it) is always let in,
  and its channel, once it said ``worker_hello``, belongs to the server and is not counted;
* an authenticated connection silent for ``idle_timeout_s`` is closed.
  :class:`~param_server.client.ParamServerClient` learns the timeout from ``hello_ok`` and
  reconnects before using a connection that has been quiet for half of it.
"""

from __future__ import annotations

import contextlib
import math
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import attrs
import structlog

from ._wire import PRE_AUTH_LIMITS, PRE_AUTH_MAX_BYTES, Channel
from .errors import ConfigError, ProtocolError

log = structlog.get_logger("param_server.listener")


def _count(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65536:
        raise ConfigError(attribute.name, value, "an int in [1, 65536]")


def _seconds(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None and attribute.name == "idle_timeout_s":
        return
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not value > 0
        or not math.isfinite(value)
    ):
        extra = " or None (never)" if attribute.name == "idle_timeout_s" else ""
        raise ConfigError(attribute.name, value, f"a finite number of seconds > 0{extra}")


@attrs.frozen(kw_only=True)
class ConnectionLimits:
    """What the control port allows its peers (see the module docstring)."""

    max_connections: int = attrs.field(default=128, validator=_count)
    max_unauthenticated: int = attrs.field(default=32, validator=_count)
    handshake_timeout_s: float = attrs.field(default=10.0, validator=_seconds)
    idle_timeout_s: float | None = attrs.field(default=600.0, validator=_seconds)


Handler = Callable[[Channel], bool]
"""Serves one authenticated channel until it closes; True if it kept the channel open."""


class Listener:
    """Runs the accept loop on ``sock`` (a listening socket) in a daemon thread."""

    def __init__(
        self, sock: socket.socket, token: str | None, limits: ConnectionLimits, handle: Handler
    ) -> None:
        self.sock = sock
        self.token = token
        self.limits = limits
        self._handle = handle
        self._lock = threading.Lock()
        self._waiting: OrderedDict[int, socket.socket] = OrderedDict()  # oldest first
        self._authenticated = 0
        self._next = 0
        self.evicted = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="ps-accept", daemon=True)
        self._thread.start()

    def counts(self) -> dict[str, int]:
        """Open client connections: waiting for their hello, and authenticated."""
        with self._lock:
            return {"unauthenticated": len(self._waiting), "authenticated": self._authenticated}

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self.sock.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                # e.g. out of file descriptors until evicted connections are closed: retrying
                # at once would spin and starve the threads that close them
                log.warning("accept_failed", error=str(exc))
                self._closed.wait(0.05)
                continue
            threading.Thread(
                target=self._connection, args=(conn,), name="ps-conn", daemon=True
            ).start()

    def _admit(self, conn: socket.socket) -> int:
        with self._lock:
            key = self._next
            self._next += 1
            self._waiting[key] = conn
            while len(self._waiting) > self.limits.max_unauthenticated:
                _old, oldest = self._waiting.popitem(last=False)
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)  # its thread's recv returns at once
                self.evicted += 1
                log.warning(
                    "unauthenticated_connection_evicted",
                    limit=self.limits.max_unauthenticated,
                    evicted=self.evicted,
                )
        return key

    def _connection(self, conn: socket.socket) -> None:
        key = self._admit(conn)
        chan = Channel(conn, self.token)
        counted = kept = False
        try:
            conn.settimeout(self.limits.handshake_timeout_s)
            try:
                kind, body = chan.recv(PRE_AUTH_MAX_BYTES, PRE_AUTH_LIMITS)
                if kind != "hello":
                    raise ProtocolError(
                        f"the first message on a connection must be 'hello' carrying the "
                        f"token, got {kind!r}",
                        field="kind",
                    )
            except ProtocolError as exc:
                log.warning("handshake_refused", error=str(exc), field=exc.field)
                _send_error(chan, "ProtocolError", str(exc), {"field": exc.field})
                return
            except TimeoutError:
                log.warning("handshake_timeout", timeout_s=self.limits.handshake_timeout_s)
                return
            except (ConnectionError, OSError):
                return
            with self._lock:
                if self._waiting.pop(key, None) is None:
                    return  # evicted while its hello arrived
                busy = body["worker"] is None and self._authenticated >= self.limits.max_connections
                if not busy:
                    self._authenticated += 1
                    counted = True
            if busy:
                limit = self.limits.max_connections
                log.warning("connection_refused_busy", limit=limit)
                _send_error(
                    chan,
                    "ServiceBusy",
                    f"the parameter server already serves {limit} connections "
                    "(max_connections); try again later",
                    {"limit": limit},
                )
                return
            try:
                chan.send("hello_ok", {"idle_timeout_s": self.limits.idle_timeout_s})
            except OSError:
                return
            conn.settimeout(self.limits.idle_timeout_s)
            kept = self._handle(chan)
        finally:
            with self._lock:
                self._waiting.pop(key, None)
                if counted:
                    self._authenticated -= 1
            if not kept:
                chan.close()


def _send_error(chan: Channel, kind: str, message: str, context: dict[str, object]) -> None:
    with contextlib.suppress(OSError):
        chan.send("error", {"kind": kind, "message": message, "context": context})
