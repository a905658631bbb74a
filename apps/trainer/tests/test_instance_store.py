"""A rollout instance's trajectory-server requests across a broken connection, against a real
service on loopback: a request whose answer was lost (a proxy forwards it, then cuts the
connection instead of the answer) is settled by the store's view, never written twice and never
dropped; results the store cannot be reached for are kept and written once it is back."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from engine_adapters import FinishReason, GenerateResult
from engine_adapters.sim import SimAdapter, SimConfig
from staleflow_trainer.actors.instance_store import InstanceStore, StoreUnreachable
from staleflow_trainer.actors.rollout import RolloutActor
from staleflow_trainer.actors.rollout_wire import unpack_outcomes
from trajectory_server import Completion, LocationState, SamplingParams, Segment, TrajectoryStore
from trajectory_server.client import TrajectoryClient
from trajectory_server.service import ConnectionLimits, TrajectoryService

TOKEN = "store-token"
SIM_TINY = Path(__file__).resolve().parents[3] / "examples" / "sim-tiny.yaml"
IID = "sim-0"


class CutProxy:
    """Forwards each connection to ``target``. After :meth:`cut_next_answer`, the next bytes
    the service sends are not forwarded: both sides of that connection are closed instead, so
    the request was carried out and its answer is lost (``on_cut`` runs then). After
    :meth:`cut_next_request`, the next request is not forwarded: the connection is closed
    before the service saw it. While :meth:`stall` holds, requests reach the service but no
    answer comes back (nor a handshake's), as from a service that has stopped answering."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._cut: bool | None = None  # True: the next answer, False: the next request
        self.cuts = 0
        self.stalled = False
        self.on_cut: Callable[[], None] = lambda: None
        self._server: asyncio.Server | None = None

    async def start(self) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    def cut_next_answer(self) -> None:
        self._cut = True

    def cut_next_request(self) -> None:
        self._cut = False

    def stall(self, stalled: bool = True) -> None:
        self.stalled = stalled

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _connection(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection(*self.target)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, answers: bool) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await r.read(1 << 16):
                    if self._cut is answers:
                        self._cut = None
                        self.cuts += 1
                        self.on_cut()
                        cw.transport.abort()
                        sw.transport.abort()
                        return
                    if answers and self.stalled:
                        continue  # swallowed: the caller waits in vain
                    w.write(data)
                    await w.drain()
            w.close()

        await asyncio.gather(pipe(cr, sw, False), pipe(sr, cw, True))


def _store(members: int = 2, *, routed: bool = True) -> tuple[TrajectoryStore, list[str]]:
    store = TrajectoryStore()
    ids = list(
        store.submit_group("g", [1, 2, 3], members, sampling=SamplingParams(max_new_tokens=8))
    )
    if routed:
        store.route(IID, ids, 0)
    return store, ids


@contextlib.asynccontextmanager
async def _served(store: TrajectoryStore, port: int = 0) -> AsyncIterator[tuple[str, int]]:
    svc = TrajectoryService(store, token=TOKEN, port=port)
    address = await svc.start()
    try:
        yield address
    finally:
        await svc.stop()


@contextlib.asynccontextmanager
async def _through_proxy(
    store: TrajectoryStore, *, timeout_s: float = 60.0
) -> AsyncIterator[tuple[InstanceStore, CutProxy]]:
    """A connected ``InstanceStore`` that reaches a service of ``store`` through a proxy."""
    async with _served(store) as address:
        proxy = CutProxy(address)
        io = InstanceStore(IID, await proxy.start(), TOKEN, timeout_s=timeout_s)
        try:
            await io.connect()
            yield io, proxy
        finally:
            await io.close()
            await proxy.stop()


def _done(tid: str, tokens: list[int]) -> Completion:
    return Completion(trajectory_id=tid, start=0, token_ids=tokens, logprobs=[-0.5] * len(tokens),
                      versions=[0] * len(tokens), finish_reason="stop")  # fmt: skip


def _partial(tid: str, tokens: list[int]) -> Segment:
    return Segment(trajectory_id=tid, start=0, token_ids=tokens, logprobs=[-0.5] * len(tokens),
                   versions=[0] * len(tokens))  # fmt: skip


@pytest.mark.parametrize("finished", [True, False], ids=["finish", "return_partial"])
async def test_a_write_whose_answer_was_lost_is_settled_by_the_store(finished: bool) -> None:
    store, ids = _store()
    async with _through_proxy(store) as (io, proxy):
        make = _done if finished else _partial
        items = [(make(t, [5, 6, i]), t) for i, t in enumerate(ids)]
        proxy.cut_next_answer()
        written, refused, left = await io.write(items, finished=finished)
        assert proxy.cuts == 1  # the first write landed, its answer was lost
        assert (written, refused, left) == (items, [], [])
        assert io.link.connects == 2
        want = LocationState.FINISHED if finished else LocationState.QUEUED
        assert [store.location(t).state for t in ids] == [want, want]
        for i, t in enumerate(ids):  # written once: the tokens are not doubled
            assert list(store.get(t).generated_token_ids) == [5, 6, i]


async def test_a_store_that_stops_answering_costs_a_write_its_timeouts_not_the_results() -> None:
    # The write reaches the store, which carries it out, but no answer comes back, nor one to
    # the new connection's handshake: after waits of the link's timeout_s the results come
    # back unresolved (kept by the caller). Once the store answers again, the lost write is
    # settled by the store's view: written once.
    store, ids = _store()
    async with _through_proxy(store, timeout_s=0.3) as (io, proxy):
        items = [(_done(t, [5, 6, i]), t) for i, t in enumerate(ids)]
        proxy.stall()
        async with asyncio.timeout(10):
            assert await io.write(items, finished=True) == ([], [], items)
        assert [store.location(t).state for t in ids] == [LocationState.FINISHED] * 2
        proxy.stall(False)
        assert await io.write(items, finished=True) == (items, [], [])
        for i, t in enumerate(ids):
            assert list(store.get(t).generated_token_ids) == [5, 6, i]


async def test_a_write_lost_before_the_store_saw_it_is_written_on_the_new_connection() -> None:
    store, ids = _store()
    async with _through_proxy(store) as (io, proxy):
        items = [(_done(t, [5, i]), t) for i, t in enumerate(ids)]
        proxy.cut_next_request()
        assert await io.write(items, finished=True) == (items, [], [])
        assert proxy.cuts == 1 and io.link.connects == 2
        assert [list(store.get(t).generated_token_ids) for t in ids] == [[5, 0], [5, 1]]


async def test_a_lost_write_is_judged_by_where_the_store_has_the_trajectory() -> None:
    """The lost return_partial landed, but the trajectory was dropped before the store was
    asked: it is not where a landed return_partial leaves it, so the result is refused."""
    store, ids = _store()
    async with _through_proxy(store) as (io, proxy):
        proxy.on_cut = lambda: store.drop([ids[0]], "filtered")
        items = [(_partial(t, [5]), t) for t in ids]
        proxy.cut_next_answer()
        written, refused, left = await io.write(items, finished=False)
        assert written == items[1:] and left == []
        assert [item for item, _ in refused] == items[:1]
        assert store.location(ids[0]).state is LocationState.DROPPED


async def test_a_store_at_its_connection_limit_leaves_the_results_unresolved() -> None:
    store, ids = _store()
    svc = TrajectoryService(store, token=TOKEN, limits=ConnectionLimits(max_connections=1))
    address = await svc.start()
    other = await TrajectoryClient.connect(*address, token=TOKEN)  # takes the only slot
    io = InstanceStore(IID, address, TOKEN)
    try:
        items = [(_done(t, [7]), t) for t in ids]
        assert await io.write(items, finished=True) == ([], [], items)  # kept, not refused
        await other.close()
        await asyncio.sleep(0.05)
        assert await io.write(items, finished=True) == (items, [], [])
    finally:
        await io.close()
        await svc.stop()


async def test_concurrent_requests_share_one_new_connection_after_a_break() -> None:
    store, ids = _store(4, routed=False)
    store.route(IID, ids[:2], 0)
    async with _served(store) as address:
        io = InstanceStore(IID, address, TOKEN)
        try:
            await io.connect()
            io.link._client._writer.transport.abort()  # the kept connection breaks
            await asyncio.sleep(0.05)
            items = [(_done(t, [5]), t) for t in ids[:2]]
            wrote, routed = await asyncio.gather(
                io.write(items, finished=True), io.route(ids[2:], 0)
            )
            assert wrote == (items, [], []) and [p.trajectory_id for p in routed[0]] == ids[2:]
            assert io.link.connects == 2
        finally:
            await io.close()
        assert io.link._client is None
        payloads, refused = await io.route(ids[:1], 0)  # closed: nothing is sent
        assert payloads == [] and "closed" in refused[0][1]
        assert io.link.connects == 2


async def test_a_route_whose_answer_was_lost_brings_the_payloads_from_the_store() -> None:
    store, ids = _store(routed=False)
    async with _through_proxy(store) as (io, proxy):
        proxy.cut_next_answer()
        payloads, refused = await io.route(ids, 0)
        assert proxy.cuts == 1 and refused == []
        assert [p.trajectory_id for p in payloads] == ids
        assert [list(p.prompt_token_ids) for p in payloads] == [[1, 2, 3]] * 2
        assert all(store.location(t).instance_id == IID for t in ids)
        # an id that was not in a broken request is refused as before, with the reason
        store.submit_group("h", [4], 1, sampling=SamplingParams(max_new_tokens=8))
        store.route("other", ["h/0"], 0)
        payloads, refused = await io.route(["h/0"], 0)
        assert payloads == [] and [t for t, _ in refused] == ["h/0"]


async def test_results_are_kept_while_the_store_is_away_and_written_once_it_is_back() -> None:
    store, ids = _store()
    async with _served(store) as address:
        io = InstanceStore(IID, address, TOKEN)
        await io.connect()
    try:  # the service is gone: nothing can be written, nothing is dropped
        items = [(_done(t, [7]), t) for t in ids]
        assert await io.write(items, finished=True) == ([], [], items)
        async with _served(store, port=address[1]):
            assert await io.write(items, finished=True) == (items, [], [])
        assert [store.location(t).state for t in ids] == [LocationState.FINISHED] * 2
    finally:
        await io.close()


async def _actor(address: tuple[str, int]) -> RolloutActor:
    actor = RolloutActor(instance_id=IID, backend="sim", engine_kwargs={}, ts_address=address,
                         ts_token=TOKEN)  # fmt: skip
    engine = SimAdapter(SimConfig(), instance_id=IID)
    await engine.start()
    actor._engine = engine
    return actor


def _result(tid: str, tokens: tuple[int, ...], finish: FinishReason) -> Any:
    return GenerateResult(trajectory_id=tid, token_ids=tokens, logprobs=(-0.5,) * len(tokens),
                          versions=(0,) * len(tokens), finish_reason=finish)  # fmt: skip


async def test_a_polled_instance_keeps_its_results_until_the_store_is_back() -> None:
    store, ids = _store()
    async with _served(store) as address:
        actor = await _actor(address)
        await actor._io.connect()
    try:
        # one interrupted, then one finished, waiting to be written when the store went away
        actor._to_write += [(_result(ids[1], (6,), FinishReason.INTERRUPTED), False),
                            (_result(ids[0], (4, 5), FinishReason.STOP), True)]  # fmt: skip
        with pytest.raises(StoreUnreachable, match=r"2 results .* kept"):
            await actor.poll()
        assert [r.trajectory_id for r, _ in actor._to_write] == ids[::-1]  # kept, in order
        assert await actor.interrupt([], report=True) == []  # an interrupt does not fail
        assert len(actor._to_write) == 2
        async with _served(store, port=address[1]):
            answer = await actor.poll(None, True)
        assert answer is not None
        assert sorted(unpack_outcomes(answer[1])) == [(ids[0], 2, "stop"), (ids[1], 1, None)]
        assert actor._to_write == [] and actor._errors == []
        assert store.location(ids[0]).state is LocationState.FINISHED
        assert store.location(ids[1]).state is LocationState.QUEUED
        assert list(store.get(ids[0]).generated_token_ids) == [4, 5]
        assert list(store.get(ids[1]).generated_token_ids) == [6]
    finally:
        await actor.close()


async def test_a_route_the_store_could_not_be_reached_for_is_refused_not_failed() -> None:
    """No connection could be opened: nothing was sent, so the ids stay queued in the store
    and come back refused. A route whose answer was lost, with no connection to settle it,
    fails: the store may have it running here."""
    store, ids = _store(routed=False)
    async with _served(store) as address:
        io = InstanceStore(IID, address, TOKEN)
        await io.connect()
    for _ in range(200):  # the kept connection sees the service go
        if io.link._client.failure is not None:
            break
        await asyncio.sleep(0.01)
    try:
        payloads, refused = await io.route(ids, 0)
        assert payloads == [] and [t for t, _ in refused] == ids
        assert all("cannot open a connection" in why for _, why in refused)
        assert [store.location(t).state for t in ids] == [LocationState.QUEUED] * 2
    finally:
        await io.close()
    async with _through_proxy(store) as (io, proxy):
        proxy.cut_next_answer()
        proxy.on_cut = lambda: proxy._server.close() if proxy._server else None
        with pytest.raises(StoreUnreachable):
            await io.route(ids, 0)
        assert [store.location(t).instance_id for t in ids] == [IID] * 2


async def test_a_stalled_store_fails_the_poll_before_the_poll_timeout_ends_the_instance() -> None:
    """A store that takes requests and never answers: the instance's poll fails with
    ``StoreUnreachable`` (tried again later by the control side) after two waits of
    ``coordinator.store_wait_s``, before ``coordinator.poll_timeout_s`` would end it as hung."""
    from staleflow_trainer.config import load_config

    cfg = load_config(SIM_TINY, ["coordinator.poll_timeout_s=3"]).coordinator
    assert cfg.store_wait_s == 1.0
    store, ids = _store()
    async with _served(store) as address:
        proxy = CutProxy(address)
        actor = RolloutActor(instance_id=IID, backend="sim", engine_kwargs={},
                             ts_address=await proxy.start(), ts_token=TOKEN,
                             store_timeout_s=cfg.store_wait_s)  # fmt: skip
        actor._engine = SimAdapter(SimConfig(), instance_id=IID)
        await actor._engine.start()
        try:
            await actor._io.connect()
            actor._to_write.append((_result(ids[0], (4, 5), FinishReason.STOP), True))
            proxy.stall()
            t0 = time.monotonic()
            with pytest.raises(StoreUnreachable, match=r"1 results .* kept"):
                await actor.poll()
            assert 2 * cfg.store_wait_s <= time.monotonic() - t0 < cfg.poll_timeout_s
            assert len(actor._to_write) == 1  # kept for a later poll
        finally:
            await actor.close()
            await proxy.stop()
