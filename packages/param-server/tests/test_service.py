"""Real end-to-end: storage worker processes, NIXL transfers, concurrent pull processes,
worker death and rejoin, checksum corruption, tokens."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import Iterator

import pytest
import torch

from param_server import (
    ChecksumMismatch,
    ConfigError,
    ParamServer,
    ParamServerClient,
    ParamServerConfig,
    ProtocolError,
    PushFailed,
    SliceUnavailable,
    TransferFailed,
    UnknownTensor,
    VersionUnavailable,
)
from param_server._wire import Channel
from param_server.testing import pull_after_barrier, tensor_bytes

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]


def small_model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(512, 256, generator=g)  # 512 KiB
    return {
        "embed.weight": embed,
        "tied.lm_head": embed,  # same storage twice (tied weights)
        "embed.row3": embed[3],  # a view into it
        "layers.0.mlp.weight": torch.randn(1024, 512, generator=g),  # 2 MiB, sliced
        "layers.0.norm.weight": torch.randn(256, generator=g).to(torch.bfloat16),
        "layers.0.attn.qkv": torch.randn(768, 256, generator=g).to(torch.float16),
        "lm_head.weight": torch.randn(512, 256, generator=g).t(),  # non-contiguous
        "step": torch.tensor(seed, dtype=torch.int64),  # 0-d
        "empty": torch.empty(0, 4),
        "mask": torch.rand(33, generator=g) > 0.5,
    }


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a
    )


def _config() -> ParamServerConfig:
    return ParamServerConfig(
        num_workers=2,
        replication=2,
        max_slice_bytes=1 << 20,
        fault_injection=True,
        monitor_interval_s=0.2,
    )


@pytest.fixture(scope="module")
def shared() -> Iterator[ParamServer]:
    """One server for the tests that do not kill workers (versions only grow across them)."""
    with ParamServer(_config()) as ps:
        yield ps


@pytest.fixture
def server() -> Iterator[ParamServer]:
    """A server of its own, for tests that kill workers."""
    with ParamServer(_config()) as ps:
        yield ps


def _next(ps: ParamServer) -> int:
    return (ps.status()["latest"] or 0) + 1


def test_push_then_two_concurrent_pull_processes_get_identical_bytes(shared: ParamServer) -> None:
    server = shared
    model = small_model(1)
    version = _next(server)
    with ParamServerClient(server.address) as trainer:
        res = trainer.push(version, model)
    assert res.complete and res.version == version
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    ready = ctx.Barrier(2)
    procs = [
        ctx.Process(target=pull_after_barrier, args=(server.address, ready, q)) for _ in range(2)
    ]
    for p in procs:
        p.start()
    results = [q.get(timeout=90) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    want = tensor_bytes(model)
    for got_version, got in results:
        assert got_version == version
        assert got == want
    st = server.status()
    assert st["latest"] == version and st["active_pulls"] == 0


def test_pull_names_and_versions(shared: ParamServer) -> None:
    v1 = _next(shared)
    with ParamServerClient(shared.address) as c:
        c.push(v1, small_model(1))
        c.push(v1 + 1, small_model(2))
        v, got = c.pull(names=["embed.weight", "step"])
        assert v == v1 + 1 and set(got) == {"embed.weight", "step"} and int(got["step"]) == 2
        v, got = c.pull(version=v1)
        assert v == v1 and same(got, small_model(1))
        with pytest.raises(VersionUnavailable):
            c.pull(version=v1 + 7)
        with pytest.raises(UnknownTensor) as e:
            c.pull(names=["nope"])
        assert e.value.names == ("nope",)
        with pytest.raises(PushFailed, match="not newer"):
            c.push(v1 + 1, small_model(2))


def test_nothing_pushed_yet(server: ParamServer) -> None:
    with ParamServerClient(server.address) as c, pytest.raises(VersionUnavailable):
        c.pull()


def test_version_invisible_until_every_rank_commits(shared: ParamServer) -> None:
    server = shared
    version = _next(server)
    model = small_model(3)
    names = sorted(model)
    half = len(names) // 2
    r0 = {k: model[k] for k in names[:half]}
    r1 = {k: model[k] for k in names[half:]}
    with (
        ParamServerClient(server.address) as a,
        ParamServerClient(server.address) as b,
        ParamServerClient(server.address) as reader,
    ):
        assert not a.push(version, r0, rank=0, world_size=2).complete
        with pytest.raises(VersionUnavailable):
            reader.pull(version=version)
        assert reader.pull()[0] == version - 1  # pulls keep getting the previous version
        assert b.push(version, r1, rank=1, world_size=2).complete
        v, got = reader.pull()
        assert v == version and same(got, model)


def test_worker_death_replicated_pull_ok_push_fails_then_recovers(server: ParamServer) -> None:
    model = small_model(4)
    with ParamServerClient(server.address) as trainer, ParamServerClient(server.address) as rollout:
        trainer.push(1, model)
        v, got = rollout.pull()
        assert same(got, model)
        os.kill(server.worker_pids()["w1"], signal.SIGKILL)  # no warning to the server
        v, got = rollout.pull()  # may hit the dead worker first: retried on a fresh plan
        assert v == 1 and same(got, model)
        deadline = time.monotonic() + 10
        while "w1" not in server.status()["dead"]:
            assert time.monotonic() < deadline, "death not detected"
            time.sleep(0.05)
        with pytest.raises(PushFailed) as e:
            trainer.push(2, small_model(5))
        assert e.value.workers == ("w1",) and "w1" in str(e.value)
        server.restart_worker("w1")
        assert server.status()["dead"] == []
        assert trainer.push(2, small_model(5)).complete
        v, got = rollout.pull()
        assert v == 2 and same(got, small_model(5))


def test_unreplicated_loss_reports_unavailable_slices() -> None:
    cfg = ParamServerConfig(num_workers=2, replication=1, max_slice_bytes=1 << 20)
    with ParamServer(cfg) as ps, ParamServerClient(ps.address) as c:
        model = small_model(6)
        c.push(1, model)
        slice_map = ps.core.slice_map(1)
        on_w0 = {n for n, sl in slice_map.items() if any(s.locations[0].worker == "w0" for s in sl)}
        only_w1 = sorted(set(model) - on_w0)
        assert on_w0 and only_w1
        ps.kill_worker("w0")
        unavailable = ps.status()["unavailable"]
        assert {name for _, name, _ in unavailable} == on_w0
        with pytest.raises(SliceUnavailable) as e:
            c.pull()
        assert e.value.dead_workers == ("w0",)
        _v, got = c.pull(names=only_w1)
        assert same(got, {k: model[k] for k in only_w1})


def test_corruption_detected_by_checksum(shared: ParamServer) -> None:
    server = shared
    model = small_model(7)
    version = _next(server)
    with ParamServerClient(server.address) as c:
        c.push(version, model)
        server.corrupt(version, "layers.0.mlp.weight", slice_index=1, offset=5)  # every copy
        # without verification the flipped byte really comes through
        _, got = c.pull(verify=False)
        assert not torch.equal(got["layers.0.mlp.weight"], model["layers.0.mlp.weight"])
        with pytest.raises(ChecksumMismatch) as e:
            c.pull()
        assert e.value.name == "layers.0.mlp.weight" and e.value.slice_index == 1
        assert e.value.version == version and "no good copy" in e.value.where
        # both copies were checked where they lie and dropped: the slice is unavailable now
        dropped = [d for d in server.status()["dropped_copies"] if d[0] == version]
        assert sorted(dropped) == [[version, "layers.0.mlp.weight", 1, w] for w in ("w0", "w1")]
        with pytest.raises(SliceUnavailable) as u:
            c.pull()
        assert u.value.slices == (("layers.0.mlp.weight", 1),) and len(u.value.dropped) == 2
        _, rest = c.pull(names=["embed.weight"])  # other slices still serve
        assert torch.equal(rest["embed.weight"], model["embed.weight"])
        assert c.status()["active_pulls"] == 0  # in-order channel: pull_end already served


@pytest.mark.fault
def test_one_corrupt_replica_is_reread_from_the_other_and_dropped(shared: ParamServer) -> None:
    """replication=2, every slice of one worker corrupted: each pull re-reads those slices from
    the other holder and returns the exact pushed bytes; the bad copies are dropped (once) and
    later plans never pick them."""
    server = shared
    model = small_model(10)
    version = _next(server)
    with ParamServerClient(server.address) as c:
        c.push(version, model)
        on_w0 = [
            (name, s.index)
            for name, slices in server.core.slice_map(version).items()
            for s in slices
            if s.nbytes and any(loc.worker == "w0" for loc in s.locations)
        ]
        assert len(on_w0) >= 4
        for name, index in on_w0:
            server.corrupt(version, name, slice_index=index, offset=1, workers=["w0"])
        for _ in range(6):
            v, got = c.pull()
            assert v == version and same(got, model)
        dropped = sorted(tuple(d) for d in server.status()["dropped_copies"] if d[0] == version)
        holders = {
            (n, s.index): s.locations
            for n, sl in server.core.slice_map(version).items()
            for s in sl
        }
        assert dropped and all(w == "w0" for *_, w in dropped)
        assert len(dropped) == len(set(dropped))  # each bad copy reported and dropped once
        for _v, name, index, _w in dropped:
            assert [loc.worker for loc in holders[(name, index)]] == ["w1"]
        assert c.status()["active_pulls"] == 0  # in-order channel: pull_end already served


def test_non_loopback_needs_token_and_token_is_checked() -> None:
    with pytest.raises(ConfigError) as e:
        ParamServerConfig(host="0.0.0.0")
    assert e.value.field == "host"
    cfg = ParamServerConfig(num_workers=1, host="0.0.0.0", token="s3cret")
    with ParamServer(cfg) as ps:
        addr = ("127.0.0.1", ps.address[1])
        with ParamServerClient(addr, token="s3cret") as ok:
            ok.push(1, {"w": torch.ones(4)})
            assert ok.pull()[0] == 1
        with pytest.raises(ProtocolError):
            ParamServerClient(addr, token="wrong").status()
        with pytest.raises(ProtocolError):
            ParamServerClient(addr).status()
        assert ps.status()["latest"] == 1  # nothing changed by the rejected peers


def test_malformed_peer_messages_leave_state_unchanged(shared: ParamServer) -> None:
    server = shared
    with ParamServerClient(server.address) as c:
        c.push(_next(server), small_model(8))

    def state() -> dict[str, object]:
        return {k: v for k, v in server.status().items() if k != "connections"}

    before = state()
    raw = socket.create_connection(server.address)
    raw.sendall(b"\x00\x00\x00\x05hello")  # not msgpack (refused before any hello)
    raw.settimeout(10)
    assert raw.recv(4096)  # an error frame, then the server closes
    raw.close()
    big = socket.create_connection(server.address)
    big.sendall((1 << 30).to_bytes(4, "big"))  # announces a 1 GiB frame
    big.settimeout(10)
    assert big.recv(4096)
    big.close()
    chan = Channel.connect(server.address, None)
    kind, body = chan.call("pull_end", {"pull_id": 999, "failed_worker": None})
    assert kind == "error" and body["kind"] == "UsageError"
    nxt = _next(server)
    kind, body = chan.call(
        "push_begin", {"version": nxt, "rank": 3, "world_size": 2, "tensors": []}
    )
    assert kind == "error" and body["context"]["field"] == "rank"
    kind, body = chan.call(
        "push_begin",
        {"version": nxt, "rank": 0, "world_size": 1, "tensors": [["x", "complex64", [2], 16]]},
    )
    assert kind == "error" and body["context"]["field"] == "dtype"
    # a push whose regions no worker can allocate fails cleanly and leaves nothing staged
    huge = 64 << 30
    kind, body = chan.call(
        "push_begin",
        {"version": nxt, "rank": 0, "world_size": 1, "tensors": [["x", "uint8", [huge], huge]]},
    )
    assert kind == "error" and body["kind"] == "PushFailed", body
    assert "cannot allocate" in body["message"]
    chan.close()
    assert state() == before


def test_pull_that_hits_a_dead_worker_reports_it_and_retries_on_replicas() -> None:
    # The monitor is slowed down so that the client, not the server, finds the dead worker.
    cfg = ParamServerConfig(
        num_workers=2, replication=2, max_slice_bytes=1 << 20, monitor_interval_s=60
    )
    model = small_model(9)
    with ParamServer(cfg) as ps, ParamServerClient(ps.address) as c:
        c.push(1, model)
        c.pull()
        os.kill(ps.worker_pids()["w1"], signal.SIGKILL)
        time.sleep(0.5)
        assert ps.status()["dead"] == []
        with pytest.raises(TransferFailed) as e:
            c.pull(retries=0)
        assert e.value.worker is not None and e.value.worker.startswith("ps-w1-")
        assert ps.status()["dead"] == ["w1"]  # the client's report made the server check
        v, got = c.pull(retries=0)
        assert v == 1 and same(got, model)


def test_worker_output_goes_to_the_servers_stderr_not_its_stdout() -> None:
    """A program that embeds the server owns its stdout (the trainer prints its progress
    there): the storage workers' log lines go to the server process's stderr."""
    import subprocess
    import sys

    code = (
        "from param_server import ParamServer, ParamServerConfig\n"
        "with ParamServer(ParamServerConfig(num_workers=1)) as ps:\n"
        "    ps.status()\n"
        "print('embedder-line')\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, check=True
    )
    assert "embedder-line" in p.stdout
    assert "worker_ready" not in p.stdout, p.stdout  # the worker's line, not the server's
    assert "worker_ready" in p.stderr, p.stderr[-2000:]
