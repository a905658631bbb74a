"""The synchronous actors' kept-open trajectory-server connection (``StoreLink``), against a
real service on loopback: one connection serves every call, an error about a trajectory leaves
it open, and a connection the server dropped is replaced within the call."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

import pytest

from staleflow_trainer.actors.ts_link import StoreLink
from trajectory_server import Completion, SamplingParams, TrajectoryStore
from trajectory_server.errors import StateError, TransportError
from trajectory_server.service import TrajectoryService

TOKEN = "link-token"


class _Service:
    """A service on its own event loop in a thread (the link's caller blocks)."""

    def __init__(self, store: TrajectoryStore, port: int = 0) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.svc = TrajectoryService(store, token=TOKEN, port=port)
        self.address = self._do(self.svc.start())

    def _do(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def stop(self) -> None:
        self._do(self.svc.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def _store_with_finished(n: int) -> TrajectoryStore:
    store = TrajectoryStore()
    ids = store.submit_group("g", [1, 2, 3], n, sampling=SamplingParams(max_new_tokens=4))
    store.route("inst", list(ids), 0)
    store.finish(
        "inst",
        [
            Completion(trajectory_id=t, start=0, token_ids=[7, i], logprobs=[-0.1, -0.2],
                       versions=[0, 0], finish_reason="stop")
            for i, t in enumerate(ids)
        ],
    )  # fmt: skip
    return store


def _finished(ids: list[str]) -> Any:
    async def op(ts: Any) -> list[str]:
        return [ft.trajectory.trajectory_id for ft in await ts.finished(ids)]

    return op


def test_one_connection_serves_every_call_and_survives_a_refused_read() -> None:
    svc = _Service(_store_with_finished(3))
    link = StoreLink(svc.address, TOKEN)
    try:
        for _ in range(3):
            assert link.run(_finished(["g/0", "g/1", "g/2"])) == ["g/0", "g/1", "g/2"]
        with pytest.raises(StateError):  # an unknown trajectory: the caller's error
            link.run(_finished(["g/0", "nope"]))
        assert link.run(_finished(["g/2"])) == ["g/2"]
        assert link.connects == 1
    finally:
        link.close()
        svc.stop()
    link.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        link.run(_finished(["g/0"]))


def test_a_connection_the_server_dropped_is_replaced_within_the_call() -> None:
    store = _store_with_finished(2)
    svc = _Service(store)
    link = StoreLink(svc.address, TOKEN)
    try:
        assert link.run(_finished(["g/0"])) == ["g/0"]
        svc.stop()  # the server goes away; the same store comes back on the same port
        svc = _Service(store, port=svc.address[1])
        assert link.run(_finished(["g/1"])) == ["g/1"]
        assert link.connects == 2
        svc.stop()  # gone for good: the retry fails too, and says so
        with pytest.raises(TransportError):
            link.run(_finished(["g/1"]))
    finally:
        link.close()
