"""Hostile and careless peers on the real TCP service: unauthenticated large frames, frames
before the hello, floods of silent connections, idle connections, too many clients, and a
server started without a token.

Each test talks to a real ``TrajectoryService`` over loopback (in this process, or
``python -m trajectory_server`` in a child process with a small file-descriptor limit). Names
added with these protections are imported inside the tests that need them, so every test here
also runs (and fails) against a server without them.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import struct
import subprocess
import sys
import time
from typing import Any

import msgpack
import pytest

from trajectory_server import TrajectoryStore
from trajectory_server import wire as w
from trajectory_server.client import TrajectoryClient
from trajectory_server.errors import InvalidRecord, MalformedMessage, MessageTooLarge, Unauthorized
from trajectory_server.service import TrajectoryService

TOKEN = "correct horse battery staple"
HOSTILE_BYTES = 16 << 20


async def _read_frame(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> Any:
    (size,) = struct.unpack(">I", await asyncio.wait_for(reader.readexactly(4), timeout_s))
    return w.decode_response(await asyncio.wait_for(reader.readexactly(size), timeout_s))


async def _closed(reader: asyncio.StreamReader, timeout_s: float) -> bool:
    """True when the server closes the connection within ``timeout_s``."""
    try:
        return await asyncio.wait_for(reader.read(), timeout_s) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


@pytest.mark.fault
async def test_unauthenticated_large_frame_is_refused_before_its_body_is_read() -> None:
    """A peer without the token announces a 16 MiB frame: the server answers at once, from the
    4-byte header alone, and closes; it never waits for (or buffers, or decodes) the body."""
    async with TrajectoryService(token=TOKEN) as svc:
        svc.store.submit_group("g", [1], 2)
        before = svc.store.to_dict()
        reader, writer = await asyncio.open_connection(*svc.address)
        try:
            writer.write(struct.pack(">I", HOSTILE_BYTES) + b"\x80" * 1024)  # body never sent
            await writer.drain()
            resp = await _read_frame(reader)
            from trajectory_server.service import PRE_AUTH_MAX_BYTES

            assert isinstance(resp.body, MessageTooLarge), resp.body
            assert (resp.body.size, resp.body.limit) == (HOSTILE_BYTES, PRE_AUTH_MAX_BYTES)
            assert await _closed(reader, 5)
        finally:
            writer.close()
        assert svc.store.to_dict() == before
        async with await TrajectoryClient.connect(*svc.address, token=TOKEN) as client:
            assert (await client.stats()).queued == 2


@pytest.mark.fault
async def test_a_request_before_the_hello_is_refused_even_with_the_token() -> None:
    async with TrajectoryService(token=TOKEN) as svc:
        svc.store.submit_group("g", [1], 1)
        before = svc.store.to_dict()
        reader, writer = await asyncio.open_connection(*svc.address)
        try:
            route = w.Route(instance_id="i0", trajectory_ids=("g/0",), version=0)
            frame = w.encode_request(route, 1, TOKEN)
            writer.write(struct.pack(">I", len(frame)) + frame)
            await writer.drain()
            resp = await _read_frame(reader)
            assert isinstance(resp.body, Unauthorized) and resp.body.field == "envelope.type"
            assert "hello" in resp.body.message
            assert await _closed(reader, 5)
        finally:
            writer.close()
        assert svc.store.to_dict() == before


async def test_the_hello_is_unpacked_under_tight_limits() -> None:
    async with TrajectoryService(token=TOKEN) as svc:
        hello = msgpack.packb(
            {"schema": 1, "type": "hello", "id": 0, "token": TOKEN, "body": {"pad": [0] * 100}}
        )
        reader, writer = await asyncio.open_connection(*svc.address)
        try:
            writer.write(struct.pack(">I", len(hello)) + hello)
            await writer.drain()
            resp = await _read_frame(reader)
            assert isinstance(resp.body, MalformedMessage)
            assert "max_array_len" in resp.body.message
        finally:
            writer.close()


def test_request_frames_are_unpacked_under_msgpack_limits() -> None:
    def frame(body: dict[str, Any]) -> bytes:
        env = {"schema": 1, "type": "route", "id": 1, "token": None, "body": body}
        return msgpack.packb(env, use_bin_type=True)  # type: ignore[no-any-return]

    too_many = {"instance_id": "i", "trajectory_ids": ["a"] * (w.MAX_ITEMS + 1), "version": 1}
    with pytest.raises(MalformedMessage, match="max_array_len"):
        w.decode_request(frame(too_many))
    ext = {"instance_id": "i", "trajectory_ids": [msgpack.ExtType(5, b"x")], "version": 1}
    with pytest.raises(MalformedMessage, match="max_ext_len"):
        w.decode_request(frame(ext))


def _start_child(*extra: str, nofile: int | None = None) -> tuple[subprocess.Popen[str], int]:
    def limit_fds() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen(
        [sys.executable, "-m", "trajectory_server", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, TS_TEST_TOKEN=TOKEN),
        preexec_fn=limit_fds,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        assert proc.stderr is not None
        raise AssertionError(f"server exited {proc.returncode}: {proc.stderr.read()}")
    return proc, json.loads(line)["port"]


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)


@pytest.mark.fault
async def test_a_client_is_served_while_200_silent_connections_are_held() -> None:
    """200 connections that never say anything, against a server process that may hold only
    128 file descriptors: the oldest silent ones are closed as new ones arrive, so a real
    client still connects and is served (without the cap, accept() runs out of descriptors
    and the client times out)."""
    proc, port = _start_child("--token-env", "TS_TEST_TOKEN", nofile=128)
    hostile: list[socket.socket] = []
    try:
        for _ in range(200):
            hostile.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.5)
        t0 = time.monotonic()
        client = await TrajectoryClient.connect("127.0.0.1", port, token=TOKEN, timeout_s=10)
        try:
            assert (await client.ping())["schema"] == w.SCHEMA_VERSION
            await client.submit_group("g", [1, 2], 2)
            assert (await client.stats()).queued == 2
        finally:
            await client.close()
        assert time.monotonic() - t0 < 5
        from trajectory_server.service import ConnectionLimits

        closed = 0
        for s in hostile:
            s.settimeout(0.05)
            try:
                closed += s.recv(1) == b""
            except TimeoutError:
                pass
            except ConnectionError:
                closed += 1
        assert closed >= 200 - ConnectionLimits().max_unauthenticated
    finally:
        for s in hostile:
            s.close()
        _stop(proc)


@pytest.mark.fault
async def test_silent_and_idle_connections_are_closed_and_clients_keep_theirs_alive() -> None:
    from trajectory_server.service import ConnectionLimits

    limits = ConnectionLimits(handshake_timeout_s=0.5, idle_timeout_s=0.6)
    async with TrajectoryService(token=TOKEN, limits=limits) as svc:
        # never sends a hello: closed after the handshake timeout
        reader, writer = await asyncio.open_connection(*svc.address)
        assert await _closed(reader, 5)
        writer.close()
        # a half-sent hello is just as silent
        reader, writer = await asyncio.open_connection(*svc.address)
        writer.write(struct.pack(">I", 200) + b"\x85")
        assert await _closed(reader, 5)
        writer.close()
        # authenticated, then silent: closed after the idle timeout
        reader, writer = await asyncio.open_connection(*svc.address)
        hello = w.encode_hello(TOKEN)
        writer.write(struct.pack(">I", len(hello)) + hello)
        resp = await _read_frame(reader)
        assert resp.ok and resp.body["idle_timeout_s"] == 0.6
        assert await _closed(reader, 5)
        writer.close()
        # the client pings before the idle timeout: quiet for 2 s, still connected
        async with await TrajectoryClient.connect(*svc.address, token=TOKEN) as client:
            await asyncio.sleep(2)
            assert (await client.stats()).queued == 0
            assert svc.connection_counts() == {"unauthenticated": 0, "authenticated": 1}


@pytest.mark.fault
async def test_connections_beyond_max_connections_are_refused_with_service_busy() -> None:
    from trajectory_server.errors import ServiceBusy
    from trajectory_server.service import ConnectionLimits

    limits = ConnectionLimits(max_connections=2)
    async with TrajectoryService(token=TOKEN, limits=limits) as svc:
        a = await TrajectoryClient.connect(*svc.address, token=TOKEN)
        b = await TrajectoryClient.connect(*svc.address, token=TOKEN)
        with pytest.raises(ServiceBusy) as busy:
            await TrajectoryClient.connect(*svc.address, token=TOKEN)
        assert busy.value.limit == 2
        await a.close()
        await asyncio.sleep(0.1)
        async with await TrajectoryClient.connect(*svc.address, token=TOKEN) as c:
            assert (await c.ping())["schema"] == w.SCHEMA_VERSION
            assert (await b.ping())["schema"] == w.SCHEMA_VERSION
        await b.close()


def test_connection_limits_are_validated() -> None:
    from trajectory_server.errors import ConfigError
    from trajectory_server.service import ConnectionLimits

    for kw, field in [
        ({"max_connections": 0}, "max_connections"),
        ({"max_unauthenticated": 1.5}, "max_unauthenticated"),
        ({"handshake_timeout_s": 0}, "handshake_timeout_s"),
        ({"handshake_timeout_s": None}, "handshake_timeout_s"),
        ({"idle_timeout_s": float("inf")}, "idle_timeout_s"),
        ({"idle_timeout_s": -1}, "idle_timeout_s"),
    ]:
        with pytest.raises(ConfigError) as err:
            ConnectionLimits(**kw)
        assert err.value.field == field


async def test_the_cli_refuses_to_serve_without_a_token_unless_told() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "trajectory_server"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc
    assert "--insecure-no-token" in proc.stderr and "--token-env" in proc.stderr
    assert proc.stdout == ""  # never listened
    child, port = _start_child("--insecure-no-token")
    try:
        async with await TrajectoryClient.connect("127.0.0.1", port) as client:
            assert (await client.stats()).queued == 0
    finally:
        _stop(child)


# -- bounds on values a peer sends -------------------------------------------------------------


async def test_route_refuses_versions_beyond_int32_and_submit_group_bounds_n() -> None:
    max_version, max_group = 2**31 - 1, 4096  # int32; the documented group-size bound
    store = TrajectoryStore()
    store.submit_group("g", [1], 2)
    before = store.to_dict()
    async with (
        TrajectoryService(store, token=TOKEN) as svc,
        await TrajectoryClient.connect(*svc.address, token=TOKEN) as client,
    ):
        for version in (max_version + 1, 2**40):
            with pytest.raises(InvalidRecord) as err:
                await client.route("i0", ["g/0"], version)
            assert err.value.field == "version" and str(max_version) in err.value.message
        with pytest.raises(InvalidRecord) as err:
            await client.submit_group("big", [1], max_group + 1)
        assert err.value.field == "n" and str(max_group) in err.value.message
        assert store.to_dict() == before
        (t,) = await client.route("i0", ["g/0"], max_version)
        assert t.v_traj == max_version
        assert len(await client.submit_group("max", [1], max_group)) == max_group
    from trajectory_server import MAX_GROUP_SIZE, MAX_VERSION

    assert (max_version, max_group) == (MAX_VERSION, MAX_GROUP_SIZE)
