"""Hostile and careless peers on the real control port (with real storage worker processes):
unauthenticated large frames, requests before the hello, floods of silent connections, idle
connections, too many clients; and where the NIXL/UCX endpoints of a local run listen.

Names added with these protections are imported inside the tests that need them, so every test
here also runs (and fails) against a server without them.
"""

from __future__ import annotations

import json
import os
import queue
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import psutil
import pytest
import torch

from param_server import ParamServer, ParamServerClient, ParamServerConfig, ProtocolError
from param_server._wire import SCHEMA_VERSION, decode, encode

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(180)]

TOKEN = "s3cret-token"
HOSTILE_BYTES = 16 << 20


def _read_reply(sock: socket.socket, timeout_s: float = 5.0) -> tuple[str, dict]:  # type: ignore[type-arg]
    sock.settimeout(timeout_s)
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        assert chunk, "closed without an answer"
        head += chunk
    (n,) = struct.unpack(">I", head)
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk
        data += chunk
    return decode(data, None)


def _closed(sock: socket.socket, timeout_s: float) -> bool:
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


@pytest.fixture(scope="module")
def server() -> Iterator[ParamServer]:
    with ParamServer(ParamServerConfig(num_workers=1, token=TOKEN)) as ps:
        yield ps


@pytest.mark.fault
def test_unauthenticated_large_frame_is_refused_before_its_body_is_read(
    server: ParamServer,
) -> None:
    before = server.status()
    with socket.create_connection(server.address) as s:
        s.sendall(struct.pack(">I", HOSTILE_BYTES) + b"\x80" * 1024)  # the body never comes
        kind, body = _read_reply(s)
        assert kind == "error" and body["kind"] == "ProtocolError", body
        assert f"{HOSTILE_BYTES} bytes exceeds 4096" in body["message"]
        assert _closed(s, 5)
    assert server.status()["latest"] == before["latest"]


@pytest.mark.fault
def test_a_request_before_the_hello_is_refused_even_with_the_token(server: ParamServer) -> None:
    with socket.create_connection(server.address) as s:
        s.sendall(encode("status", {}, TOKEN))
        kind, body = _read_reply(s)
        assert kind == "error" and "hello" in body["message"], body
        assert body["context"]["field"] == "kind"
        assert _closed(s, 5)


def test_hello_with_a_wrong_token_or_oversized_fields_is_refused(server: ParamServer) -> None:
    for token in (None, "wrong"):
        with pytest.raises(ProtocolError) as err:
            ParamServerClient(server.address, token=token)
        assert err.value.field == "token"
    fat = msgpack.packb(
        {
            "schema": SCHEMA_VERSION,
            "kind": "hello",
            "token": TOKEN,
            "body": {"worker": None, "pad": list(range(50))},
        }
    )
    with socket.create_connection(server.address) as s:
        s.sendall(struct.pack(">I", len(fat)) + fat)
        kind, body = _read_reply(s)
        assert kind == "error" and "max_array_len" in body["message"], body


def test_frames_are_unpacked_under_msgpack_limits() -> None:
    from param_server._wire import FRAME_LIMITS

    too_many = msgpack.packb(
        {
            "schema": SCHEMA_VERSION,
            "kind": "pull_begin",
            "token": None,
            "body": {"receiver": "r", "names": ["a"] * (FRAME_LIMITS["max_array_len"] + 1)},
        }
    )
    with pytest.raises(ProtocolError, match="max_array_len"):
        decode(too_many, None)


_CHILD = """
import json, sys
import structlog
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
from param_server import ParamServer, ParamServerConfig
with ParamServer(ParamServerConfig(num_workers=1, token=sys.argv[1])) as ps:
    print("ADDRESS", json.dumps(list(ps.address)), flush=True)
    sys.stdin.read()
"""


@pytest.mark.fault
def test_a_client_is_served_while_200_silent_connections_are_held(tmp_path: Path) -> None:
    """200 connections that never say anything, against a server process that may hold only
    128 file descriptors: the oldest silent ones are closed as new ones arrive, so a real
    client still connects and is served (without the cap, accept() runs out of descriptors
    and nobody is served again)."""

    def limit_fds() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    errors = tmp_path / "server.stderr"
    with errors.open("w") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, TOKEN],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err_file,
            text=True,
            preexec_fn=limit_fds,
        )
    hostile: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        lines: queue.Queue[str] = queue.Queue()
        out = proc.stdout

        def read_lines() -> None:
            for x in iter(out.readline, ""):
                lines.put(x)
            lines.put("")  # end of output: the process exited

        threading.Thread(target=read_lines, daemon=True).start()
        line, deadline = None, time.monotonic() + 120
        # its storage worker shares this stdout and logs to it: the address may follow a
        # worker's unterminated output on the same line
        while line is None or "ADDRESS " not in line:
            try:
                line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if not line:
                what = "did not start within 120 s" if line is None else "exited"
                raise AssertionError(
                    f"the server process {what}; its stderr:\n{errors.read_text()[-3000:]}"
                )
        address = tuple(json.loads(line[line.index("ADDRESS ") + len("ADDRESS ") :]))
        for _ in range(200):
            hostile.append(socket.create_connection(address, timeout=5))
        time.sleep(0.5)
        t0 = time.monotonic()
        with socket.create_connection(address, timeout=5) as probe:  # answered at all?
            probe.sendall(encode("hello", {"worker": None}, TOKEN))
            kind, _body = _read_reply(probe, timeout_s=10)
            assert kind == "hello_ok", _body
        with ParamServerClient(address, token=TOKEN) as c:  # type: ignore[arg-type]
            assert c.status()["alive"] == ["w0"]
            c.push(1, {"w": torch.arange(16.0)})
            assert torch.equal(c.pull()[1]["w"], torch.arange(16.0))
        assert time.monotonic() - t0 < 10
        from param_server import ConnectionLimits

        closed = sum(_closed(s, 0.05) for s in hostile)
        assert closed >= 200 - ConnectionLimits().max_unauthenticated
    finally:
        for s in hostile:
            s.close()
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.fault
def test_silent_and_idle_connections_are_closed_and_clients_reconnect() -> None:
    from param_server import ConnectionLimits

    limits = ConnectionLimits(handshake_timeout_s=0.5, idle_timeout_s=0.6)
    cfg = ParamServerConfig(num_workers=1, token=TOKEN, connection_limits=limits)
    with ParamServer(cfg) as ps:
        with socket.create_connection(ps.address) as s:  # never says hello
            assert _closed(s, 5)
        with socket.create_connection(ps.address) as s:  # half a hello
            s.sendall(struct.pack(">I", 100) + b"\x84")
            assert _closed(s, 5)
        with socket.create_connection(ps.address) as s:  # authenticated, then silent
            s.sendall(encode("hello", {"worker": None}, TOKEN))
            s.settimeout(5)
            (n,) = struct.unpack(">I", s.recv(4))
            assert decode(s.recv(n), TOKEN) == ("hello_ok", {"idle_timeout_s": 0.6})
            assert _closed(s, 5)
        with ParamServerClient(ps.address, token=TOKEN) as c:
            c.push(1, {"w": torch.ones(8)})
            time.sleep(1.5)  # the server closed this client's quiet connection meanwhile
            v, got = c.pull()
            assert v == 1 and torch.equal(got["w"], torch.ones(8))
            time.sleep(1.5)
            assert c.status()["connections"] == {"unauthenticated": 0, "authenticated": 1}
        assert ps.status()["alive"] == ["w0"]  # the worker's own channel is never idle-closed


@pytest.mark.fault
def test_connections_beyond_max_connections_are_refused_and_workers_still_rejoin() -> None:
    from param_server import ConnectionLimits, ServiceBusy

    cfg = ParamServerConfig(
        num_workers=1, token=TOKEN, connection_limits=ConnectionLimits(max_connections=2)
    )
    with ParamServer(cfg) as ps:
        a = ParamServerClient(ps.address, token=TOKEN)
        b = ParamServerClient(ps.address, token=TOKEN)
        with pytest.raises(ServiceBusy) as busy:
            ParamServerClient(ps.address, token=TOKEN)
        assert busy.value.limit == 2
        ps.restart_worker("w0")  # a storage worker is let in at the cap
        assert ps.status()["alive"] == ["w0"]
        a.close()
        time.sleep(0.2)
        with ParamServerClient(ps.address, token=TOKEN) as c:
            c.push(1, {"w": torch.zeros(4)})
            assert b.pull()[0] == 1
        b.close()


def _listening(pids: set[int], but: frozenset[tuple[str, int]] = frozenset()) -> list[str]:
    """The addresses the processes ``pids`` listen on (TCP), but the ``(ip, port)`` in
    ``but``."""
    out = []
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and (conn.laddr.ip, conn.laddr.port) not in but:
                out.append(conn.laddr.ip)
    return out


def _listening_here() -> frozenset[tuple[str, int]]:
    """What this process listens on already (a Ray started by an earlier test in the same
    run listens on every interface from here: not the server's)."""
    conns = psutil.Process(os.getpid()).net_connections(kind="tcp")
    return frozenset((c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN)


@pytest.mark.fault
def test_a_local_run_listens_on_loopback_only() -> None:
    """Control port, storage workers' and clients' NIXL/UCX endpoints: all on loopback when
    the server binds loopback (UCX listens on every network device otherwise)."""
    import ipaddress

    before = _listening_here()
    with ParamServer(ParamServerConfig(num_workers=1)) as ps, ParamServerClient(ps.address) as c:
        c.push(1, {"w": torch.arange(64.0)})
        assert torch.equal(c.pull()[1]["w"], torch.arange(64.0))
        pids = {os.getpid(), *ps.worker_pids().values()}
        addrs = _listening(pids, but=before)
        assert len(addrs) >= 3, addrs  # control port, worker endpoint, client endpoint
        assert all(ipaddress.ip_address(a.removeprefix("::ffff:")).is_loopback for a in addrs), (
            addrs
        )
