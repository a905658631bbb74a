"""The service over a real TCP socket on loopback: in this process, and in a child process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest

from trajectory_server import Completion, SamplingParams, Segment, TrajectoryStore
from trajectory_server import wire as w
from trajectory_server.actor import TrajectoryServerActor
from trajectory_server.client import InProcessTrajectoryClient, TrajectoryClient
from trajectory_server.errors import (
    CheckpointError,
    ConfigError,
    InvalidRecord,
    MalformedMessage,
    MessageTooLarge,
    NotQueued,
    SchemaMismatch,
    ServiceClosed,
    StaleVersion,
    TransportError,
    Unauthorized,
    WrongOwner,
)
from trajectory_server.service import Dispatcher, TrajectoryService, check_bind

TOKEN = "correct horse battery staple"


def seg(tid: str, start: int, n: int, version: int) -> Segment:
    return Segment(
        trajectory_id=tid,
        start=start,
        token_ids=list(range(start, start + n)),
        logprobs=[-0.5] * n,
        versions=[version] * n,
    )


async def run_lifecycle(c: Any) -> None:
    """A full trajectory lifecycle through any client; asserts every step."""
    assert await c.submit_group(
        "g", [1, 2, 3], 3, sampling=SamplingParams(max_new_tokens=16), metadata={"gt": "7"}
    ) == ("g/0", "g/1", "g/2")
    routed = await c.route("inst-a", ["g/0", "g/1"], 2)
    assert [t.v_traj for t in routed] == [2, 2]
    assert routed[0].metadata == {"gt": "7"}
    back = await c.return_partial("inst-a", [seg("g/0", 0, 4, 2)])
    assert [(e.trajectory_id, e.generated_len, e.interruptions) for e in back] == [("g/0", 4, 1)]
    assert (await c.get("g/0")).generated_token_ids.tolist() == [0, 1, 2, 3]
    assert [(e.trajectory_id, e.v_traj, e.generated_len) for e in await c.queue_view()] == [
        ("g/0", 2, 4),
        ("g/2", None, 0),
    ]
    with pytest.raises(StaleVersion) as stale:
        await c.route("inst-old", ["g/0"], 1)
    assert stale.value.v_traj == 2
    await c.route("inst-b", ["g/0"], 3)
    fin = await c.finish(
        "inst-b",
        [
            Completion(
                trajectory_id="g/0",
                start=4,
                token_ids=[4, 5],
                logprobs=[-0.1, -0.2],
                versions=[3, 3],
                finish_reason="stop",
            )
        ],
    )
    assert fin[0].trajectory.generated_versions.tolist() == [2, 2, 2, 2, 3, 3]
    with pytest.raises(WrongOwner) as wrong:
        await c.return_partial("inst-b", [seg("g/1", 0, 1, 2)])
    assert wrong.value.owner == "inst-a"
    assert await c.instance_lost("inst-a") == ("g/1",)
    stats = await c.stats()
    assert (stats.queued, stats.running, stats.finished, stats.dropped) == (2, 0, 1, 0)
    assert stats.queued_by_level == {2: 1, None: 1}
    assert await c.finished_ids() == ("g/0",)
    assert (await c.release(["g/0"]))[0].finish_reason.value == "stop"
    await c.drop_group("g", "filtered")
    assert [loc.state.value for loc in await c.locate(["g/0", "g/1", "g/2"])] == [
        "dropped",
        "dropped",
        "dropped",
    ]
    kinds = [e.kind.value for e in await c.history("g/0")]
    assert kinds == ["submitted", "routed", "returned", "routed", "finished", "released", "dropped"]


async def test_lifecycle_over_tcp() -> None:
    async with TrajectoryService(token=TOKEN) as svc:
        host, port = svc.address
        assert host == "127.0.0.1"
        client = await TrajectoryClient.connect(host, port, token=TOKEN)
        try:
            await run_lifecycle(client)
        finally:
            await client.close()
        svc.store.check_invariants()


async def test_a_client_says_why_its_connection_ended() -> None:
    """``failure`` is None while the connection is open; once the service goes it is the
    transport error every call then raises at once; after ``close``, ``ServiceClosed``."""
    svc = TrajectoryService(token=TOKEN)
    host, port = await svc.start()
    client = await TrajectoryClient.connect(host, port, token=TOKEN)
    try:
        await client.ping()
        assert client.failure is None
        await svc.stop()
        await asyncio.sleep(0.05)
        assert isinstance(client.failure, TransportError)
        with pytest.raises(TransportError):
            await client.ping()
    finally:
        await client.close()
    fresh = TrajectoryService(token=TOKEN)
    host, port = await fresh.start()
    try:
        third = await TrajectoryClient.connect(host, port, token=TOKEN)
        await third.close()
        assert isinstance(third.failure, ServiceClosed)
    finally:
        await fresh.stop()


async def test_free_sends_no_tokens_back_and_the_client_counts_wire_bytes() -> None:
    """``free`` answers a count whatever the length; ``release`` answers the payloads. The
    client's ``wire_bytes`` counts both directions per request type, as the socket carried
    them."""
    async with TrajectoryService(token=TOKEN) as svc:
        client = await TrajectoryClient.connect(*svc.address, token=TOKEN)
        try:
            got: dict[int, dict[str, dict[str, int]]] = {}
            for g, n in (("a", 8), ("b", 8000)):  # ids of one length: only n differs
                await client.submit_group(
                    g, [1, 2, 3], 2, sampling=SamplingParams(max_new_tokens=n)
                )
                await client.route("i0", [f"{g}/0", f"{g}/1"], 0)
                done = [
                    Completion(trajectory_id=f"{g}/{k}", start=0, token_ids=[7] * n,
                               logprobs=[-0.5] * n, versions=[0] * n, finish_reason="length")
                    for k in (0, 1)
                ]  # fmt: skip
                await client.finish("i0", done)
                before = client.wire_bytes()
                assert await client.free([f"{g}/0"]) == 1
                assert len(await client.release([f"{g}/1"])) == 1
                after = client.wire_bytes()
                got[n] = {
                    t: {k: after[t][k] - before.get(t, {}).get(k, 0) for k in after[t]}
                    for t in ("free", "release")
                }
        finally:
            await client.close()
    for n, by_type in got.items():
        assert by_type["free"]["requests"] == by_type["release"]["requests"] == 1
        assert by_type["release"]["received"] > n * (4 + 8 + 4)  # the payload came back
    assert got[8]["free"] == got[8000]["free"]  # the same bytes either way
    assert got[8000]["free"]["received"] < 64
    assert [svc.store.location(t).state.value for t in ("a/0", "b/0")] == ["finished"] * 2
    assert svc.store.stats().released == 4


async def _finish_both_ways(c: Any) -> list[Any]:
    await c.submit_group("e", [1, 2], 2, sampling=SamplingParams(max_new_tokens=4000))
    await c.route("i0", ["e/0", "e/1"], 0)
    done = [
        Completion(trajectory_id=f"e/{k}", start=0, token_ids=[3] * 4000, logprobs=[-0.5] * 4000,
                   versions=[0] * 4000, finish_reason="length")
        for k in (0, 1)
    ]  # fmt: skip
    return [await c.finish("i0", done[:1], echo=False), await c.finish("i0", done[1:])]


@pytest.mark.parametrize("how", ["tcp", "in-process", "direct"])
async def test_finish_without_echo_answers_a_count(how: str) -> None:
    """``finish(..., echo=False)`` finishes the same way and answers how many finished, not
    the records: an engine that just wrote the tokens gets nothing back."""
    if how == "tcp":
        async with TrajectoryService() as svc:
            c: Any = await TrajectoryClient.connect(*svc.address)
            try:
                quiet, echoed = await _finish_both_ways(c)
            finally:
                await c.close()
            store = svc.store
    else:
        c = InProcessTrajectoryClient(TrajectoryStore(), wire=how == "in-process")
        quiet, echoed = await _finish_both_ways(c)
        store = c.store
    assert quiet == 1
    assert echoed[0].trajectory.generated_len == 4000
    assert [store.location(t).state.value for t in ("e/0", "e/1")] == ["finished"] * 2
    assert store.finished(["e/0"])[0].trajectory.generated_len == 4000
    if how != "direct":
        sizes = c.wire_bytes()["finish"]
        assert sizes["requests"] == 2 and sizes["received"] > 4000 * 16  # the echo only
        assert sizes["received"] < 4000 * 16 + 1000  # and a few bytes for the count


async def test_one_string_is_not_a_list_of_ids() -> None:
    """A client refuses one string where a list of ids goes, as the store does, instead of
    splitting it into one-character ids."""
    store = TrajectoryStore()
    store.submit_group("g", [1], 2)
    c = InProcessTrajectoryClient(store)
    before = store.to_dict()
    for call in (c.route("i0", "g/0", 0), c.drop("g/0", "r"), c.free("g/0"), c.locate("g/0")):
        with pytest.raises(InvalidRecord) as ei:
            await call
        assert ei.value.field == "trajectory_ids"
    assert store.to_dict() == before


@pytest.mark.parametrize("wire", [True, False])
async def test_lifecycle_in_process(wire: bool) -> None:
    client = InProcessTrajectoryClient(TrajectoryStore(), wire=wire)
    await run_lifecycle(client)
    client.store.check_invariants()


async def test_pipelined_concurrent_calls() -> None:
    async with TrajectoryService() as svc:
        svc.store.submit_group("g", [1], 64)
        client = await TrajectoryClient.connect(*svc.address)
        try:
            results = await asyncio.gather(
                *(client.route(f"i{k % 4}", [f"g/{k}"], 0) for k in range(64)),
                *(client.route("dup", ["g/0"], 0) for _ in range(3)),
                return_exceptions=True,
            )
        finally:
            await client.close()
    assert all(r[0].trajectory_id == f"g/{k}" for k, r in enumerate(results[:64]))
    assert all(isinstance(r, NotQueued) for r in results[64:])
    assert svc.store.stats().running_by_instance == {f"i{k}": 16 for k in range(4)}


async def test_wrong_or_missing_token_rejected_state_unchanged() -> None:
    async with TrajectoryService(token=TOKEN) as svc:
        svc.store.submit_group("g", [1], 2)
        before = svc.store.to_dict()
        for token in (None, "", "wrong", TOKEN + " "):
            with pytest.raises(Unauthorized):  # refused at the handshake
                await TrajectoryClient.connect(*svc.address, token=token)
        # after a good hello, every request is still checked (reads too)
        reader, writer = await _hello(svc.address[1], TOKEN)
        try:
            for req in (w.Route(instance_id="i0", trajectory_ids=("g/0",), version=0), w.Stats()):
                resp = await _frame_call(reader, writer, w.encode_request(req, 7, "wrong"))
                assert isinstance(resp.body, Unauthorized) and resp.request_id == 7
        finally:
            writer.close()
        assert svc.store.to_dict() == before
        good = await TrajectoryClient.connect(*svc.address, token=TOKEN)
        try:
            assert len(await good.route("i0", ["g/0"], 0)) == 1
        finally:
            await good.close()


async def test_an_authenticated_connection_needs_no_token_per_request() -> None:
    """The hello carries the token once; the connection's requests then leave it out (the TCP
    client's do: fewer bytes a frame), and one that carries a wrong token is still refused.
    A frame handed over by other means (the actor's ``handle``, a Ray call) needs it."""
    async with TrajectoryService(token=TOKEN) as svc:
        svc.store.submit_group("g", [1], 2)
        sent = w.encode_request(w.Stats(), 3)
        assert "token" not in msgpack.unpackb(sent)  # what the TCP client sends
        assert len(sent) < len(w.encode_request(w.Stats(), 3, TOKEN))
        reader, writer = await _hello(svc.address[1], TOKEN)
        try:
            resp = await _frame_call(reader, writer, sent)
            assert resp.ok and resp.request_id == 3, resp
            route = w.Route(instance_id="i0", trajectory_ids=("g/0",), version=0)
            resp = await _frame_call(reader, writer, w.encode_request(route, 4, "wrong"))
            assert isinstance(resp.body, Unauthorized)
            resp = await _frame_call(reader, writer, w.encode_request(route, 5, TOKEN))
            assert resp.ok, resp
        finally:
            writer.close()
        client = await TrajectoryClient.connect(*svc.address, token=TOKEN)
        try:
            assert len(await client.route("i0", ["g/1"], 0)) == 1
        finally:
            await client.close()
    dispatcher = Dispatcher(token=TOKEN)  # not a connection's: every frame carries the token
    resp = w.decode_response(dispatcher.handle_frame(w.encode_request(w.Stats(), 6)))
    assert isinstance(resp.body, Unauthorized)
    assert w.decode_response(dispatcher.handle_frame(w.encode_request(w.Stats(), 7, TOKEN))).ok
    actor = TrajectoryServerActor(token=TOKEN)
    resp = w.decode_response(await actor.handle(w.encode_request(w.Stats(), 8)))
    assert isinstance(resp.body, Unauthorized)


def test_bind_rules() -> None:
    check_bind("127.0.0.1", allow_remote=False, token=None)
    check_bind("::1", allow_remote=False, token=None)
    check_bind("localhost", allow_remote=False, token=None)
    with pytest.raises(ConfigError) as e1:
        TrajectoryService(host="0.0.0.0")
    assert e1.value.field == "allow_remote"
    with pytest.raises(ConfigError) as e2:
        TrajectoryService(host="0.0.0.0", allow_remote=True)
    assert e2.value.field == "token"
    with pytest.raises(ConfigError):
        TrajectoryService(host="10.1.2.3", allow_remote=True, token="")


async def test_remote_bind_with_token_serves_and_checks_token() -> None:
    async with TrajectoryService(host="0.0.0.0", allow_remote=True, token=TOKEN) as svc:
        port = svc.address[1]
        with pytest.raises(Unauthorized):
            await TrajectoryClient.connect("127.0.0.1", port)
        good = await TrajectoryClient.connect("127.0.0.1", port, token=TOKEN)
        try:
            assert (await good.ping())["schema"] == w.SCHEMA_VERSION
        finally:
            await good.close()


async def _frame_call(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    payload: bytes,
    *,
    length: int | None = None,
) -> Any:
    writer.write(struct.pack(">I", len(payload) if length is None else length) + payload)
    await writer.drain()
    (size,) = struct.unpack(">I", await asyncio.wait_for(reader.readexactly(4), 10))
    return w.decode_response(await reader.readexactly(size))


async def _hello(port: int, token: str | None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection that has passed the handshake."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    resp = await _frame_call(reader, writer, w.encode_hello(token))
    assert resp.ok and resp.body["idle_timeout_s"] is not None, resp
    return reader, writer


async def _raw_call(port: int, payload: bytes, *, length: int | None = None) -> Any:
    """One frame on a fresh, authenticated connection (no token configured)."""
    reader, writer = await _hello(port, None)
    try:
        return await _frame_call(reader, writer, payload, length=length), reader
    finally:
        writer.close()


async def test_garbage_and_oversized_frames_rejected_service_keeps_serving() -> None:
    async with TrajectoryService(max_message_bytes=4096) as svc:
        svc.store.submit_group("g", [1], 1)
        before = svc.store.to_dict()
        port = svc.address[1]
        resp, _ = await _raw_call(port, b"\xc1\x00not msgpack")
        assert isinstance(resp.body, MalformedMessage)
        env = {"schema": 99, "type": "stats", "id": 4, "token": None, "body": {}}
        resp, _ = await _raw_call(port, msgpack.packb(env))
        assert isinstance(resp.body, SchemaMismatch) and resp.request_id == 4
        # a frame announcing more than the limit is refused before its body is read
        resp, reader = await _raw_call(port, b"", length=10_000_000)
        assert isinstance(resp.body, MessageTooLarge)
        assert resp.body.size == 10_000_000
        assert await reader.read() == b""  # and the connection is closed
        client = await TrajectoryClient.connect("127.0.0.1", port)
        try:
            with pytest.raises(MessageTooLarge):
                await client.submit_group("big", list(range(2000)), 1)
        finally:
            await client.close()
        assert svc.store.to_dict() == before
        client = await TrajectoryClient.connect("127.0.0.1", port)
        try:
            assert (await client.stats()).queued == 1
        finally:
            await client.close()


async def test_client_fails_cleanly_when_server_goes_away() -> None:
    svc = TrajectoryService()
    client = await TrajectoryClient.connect(*(await svc.start()))
    await svc.stop()
    with pytest.raises(TransportError):
        await client.stats()
    await client.close()
    with pytest.raises(TransportError):
        await TrajectoryClient.connect("127.0.0.1", 1, timeout_s=2)


class _Proxy:
    """Forwards connections to ``target``; ``reading`` / ``answering`` cleared: it stops
    reading what clients send / passing on what the service answers."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.reading, self.answering = asyncio.Event(), asyncio.Event()
        self.reading.set()
        self.answering.set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _connection(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection(*self.target)
        self._writers += [cw, sw]

        async def pipe(r: asyncio.StreamReader, out: asyncio.StreamWriter, gate: asyncio.Event,
                       drop: bool) -> None:  # fmt: skip
            while True:
                if not drop:
                    await gate.wait()
                if not (data := await r.read(1 << 16)):
                    return
                if drop and not gate.is_set():
                    continue  # swallowed
                out.write(data)
                await out.drain()

        for coro in (pipe(cr, sw, self.reading, False), pipe(sr, cw, self.answering, True)):
            task = asyncio.create_task(coro)
            self._tasks.add(task)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._writers:
            writer.transport.abort()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def test_a_send_the_server_does_not_read_fails_within_the_timeout() -> None:
    # The proxy passes the handshake and one request, then stops reading what the client
    # sends: a large request fills the socket buffers and its send waits. It fails after
    # timeout_s (it used to wait for ever, holding every other call behind it); the connection
    # ends, since the frame is only partly sent, and the next call fails without sending.
    svc = TrajectoryService()
    proxy = _Proxy(await svc.start())
    client = await TrajectoryClient.connect("127.0.0.1", await proxy.start(), timeout_s=2)
    try:
        assert (await client.stats()).queued == 0
        proxy.reading.clear()
        ids = [f"g{i:07d}/0" for i in range(3_000_000)]  # about 33 MB: more than any buffer
        async with asyncio.timeout(60):  # two calls wait behind it for the connection
            got = await asyncio.gather(
                client.free(ids), client.stats(), client.ping(), return_exceptions=True
            )
        assert [type(e) for e in got] == [TransportError] * 3
        assert all("could not send free within 2 s" in str(e) for e in got)
        assert client.failure is not None and "could not send free" in client.failure.message
        with pytest.raises(TransportError, match="could not send free"):
            await client.stats()  # the reason the connection ended, nothing sent
    finally:
        await client.close()
        await proxy.stop()
        await svc.stop()


async def test_an_answer_that_does_not_come_in_time_leaves_the_connection_open() -> None:
    svc = TrajectoryService()
    proxy = _Proxy(await svc.start())
    client = await TrajectoryClient.connect("127.0.0.1", await proxy.start(), timeout_s=0.5)
    try:
        proxy.answering.clear()
        with pytest.raises(TransportError, match=r"no response to stats within 0\.5 s"):
            await client.stats()
        assert client.failure is None
        proxy.answering.set()  # the late answer is dropped; the next call is answered
        assert (await client.stats()).queued == 0
    finally:
        await client.close()
        await proxy.stop()
        await svc.stop()


async def test_actor_wrapper_serves_tcp_and_frames(tmp_path: Path) -> None:
    ckpt = tmp_path / "ts.ckpt"
    actor = TrajectoryServerActor(token=TOKEN, checkpoint_path=ckpt)
    host, port = await actor.start()
    try:
        client = await TrajectoryClient.connect(host, port, token=TOKEN)
        try:
            await client.submit_group("g", [1, 2], 2)
            await client.route("i0", ["g/0"], 5)
            assert await client.save_checkpoint() == str(ckpt)
        finally:
            await client.close()
        frame = await actor.handle(w.encode_request(w.Stats(), 3, TOKEN))
        resp = w.decode_response(frame)
        assert resp.ok and w.decode_result(w.Stats(), resp.body).running == 1
        bad = w.decode_response(await actor.handle(w.encode_request(w.Stats(), 4, "nope")))
        assert isinstance(bad.body, Unauthorized)
    finally:
        await actor.stop()
    restored = TrajectoryServerActor(token=TOKEN, checkpoint_path=ckpt, restore=True)
    assert restored.store.to_dict() == actor.store.to_dict()
    assert restored.store.held_by("i0") == ("g/0",)


async def test_save_checkpoint_without_configured_path_is_a_clean_error() -> None:
    client = InProcessTrajectoryClient(Dispatcher())
    with pytest.raises(CheckpointError) as err:
        await client.save_checkpoint()
    assert err.value.field == "checkpoint_path"


def _start_child(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], int]:
    env = dict(os.environ, TS_TEST_TOKEN=TOKEN)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trajectory_server", "--token-env", "TS_TEST_TOKEN", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    address = json.loads(line)
    assert address["host"] == "127.0.0.1"
    return proc, address["port"]


async def test_server_in_a_separate_process(tmp_path: Path) -> None:
    ckpt = tmp_path / "child.ckpt"
    proc, port = _start_child(tmp_path, "--checkpoint", str(ckpt))
    try:
        client = await TrajectoryClient.connect("127.0.0.1", port, token=TOKEN)
        try:
            await run_lifecycle(client)
            await client.submit_group("h", [4, 5], 2)
            await client.route("inst-c", ["h/1"], 7)
            stats = await client.stats()
        finally:
            await client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    # it checkpointed on exit; a new process restores exactly that state
    store = TrajectoryStore.load_checkpoint(ckpt)
    assert store.stats() == stats
    proc, port = _start_child(tmp_path, "--checkpoint", str(ckpt), "--restore")
    try:
        client = await TrajectoryClient.connect("127.0.0.1", port, token=TOKEN)
        try:
            assert await client.held_by("inst-c") == ("h/1",)
            assert (await client.get("h/1")).v_traj == 7
        finally:
            await client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
