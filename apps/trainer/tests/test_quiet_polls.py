"""An instance is polled only when it has something to say: a command went to it (also one
sent while a poll was in flight), its watcher (``wait_results``) says it has results or its
view is off, or it died; else only every ``QUIET_POLL_S``. Between polls, an instance with
work gets an extrapolated view and no request. An instance without a watcher is polled every
cycle while it has work. Fake instance handles that answer with real snapshot deltas
(``engine_adapters.SnapshotEncoder``); the Ray deployment runs the same path in
``integration_tests/cpu/test_train_ray.py`` and the bytes benchmark's smoke test."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from engine_adapters import EngineSnapshot, RunningTrajectory, SnapshotEncoder, unpack_ids
from staleflow_trainer.actors import shell_io
from staleflow_trainer.actors.io_bytes import size
from staleflow_trainer.actors.shell_io import POLL_REASONS, QUIET_POLL_S, ShellIO
from staleflow_trainer.config import load_config
from staleflow_trainer.control import effects as fx
from staleflow_trainer.data import PromptLengths

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml"


class _Method:
    def __init__(self, fn: Callable[..., Coroutine[Any, Any, Any]]) -> None:
        self.remote = fn


class FakeInstance:
    """Answers polls like the rollout actor: a delta of its snapshot, None if unchanged."""

    def __init__(self, iid: str) -> None:
        self.iid = iid
        self.enc = SnapshotEncoder()
        self.running: list[str] = []
        self.polls = 0
        self.seq = 0
        self.poll = _Method(self._poll)
        self.submit = _Method(self._submit)
        self.sync = _Method(self._sync)

    async def _poll(self, ack: int | None = None, full: bool = False) -> list[Any] | None:
        self.polls += 1
        self.seq += 1
        snap = EngineSnapshot(
            instance_id=self.iid, seq=self.seq, time_s=float(self.seq), version=0,
            running=tuple(RunningTrajectory(trajectory_id=t, prompt_tokens=4, generated_tokens=0)
                          for t in self.running),
            waiting=0, kv_used_tokens=4 * len(self.running), kv_capacity_tokens=100,
            throughput_tokens_per_s=0.0, decode_steps=0,
        )  # fmt: skip
        delta = self.enc.encode(snap, ack=ack, full=full)
        return None if delta is None else [delta]

    async def _submit(self, version: int, packed: list[Any]) -> int:
        ids = unpack_ids(packed)
        self.running.extend(ids)
        return len(ids)

    async def _sync(self, version: int) -> dict[str, Any]:
        return {"version": version}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(shell_io.time, "monotonic", lambda: now[0])
    return now


def _io(tmp_path: Path, inst: FakeInstance) -> ShellIO:
    return ShellIO(
        load_config(EXAMPLE, [f"run.run_dir={tmp_path}"]), prompts=PromptLengths(()),
        ts_address=("127.0.0.1", 1), ts_token="t", rollouts={inst.iid: inst},
        trainer=None, rewards=[], reward_spec={},
    )  # fmt: skip


async def _cycle(io: ShellIO, between: Callable[[], None] | None = None) -> dict[str, Any]:
    """One control cycle's polls, each answer decoded as the control shell does."""
    polls = await io.poll_all()
    if between is not None:
        between()  # something that happens after the polls went out, before their answers count
    for iid, p in polls.items():
        io.snapshot(iid, (p or {}).get("snapshot"), 0.0, [])
    return polls


async def test_an_idle_instance_is_polled_again_only_after_a_command_or_the_quiet_period(
    tmp_path: Path, clock: list[float]
) -> None:
    inst = FakeInstance("i0")
    io = _io(tmp_path, inst)
    assert "i0" in await _cycle(io)  # first poll: idle, so quiet from now on
    for _ in range(5):
        clock[0] += 0.1
        assert await _cycle(io) == {}
    assert inst.polls == 1
    assert io.byte_stats()["watch"] == 0

    clock[0] += QUIET_POLL_S  # still polled now and then, so a lost instance is noticed
    assert "i0" in await _cycle(io)
    assert inst.polls == 2
    # that poll only showed the instance is alive (answered None): counted as keeping watch
    by_call = io.byte_stats()["by_call"]
    assert size(None) < io.byte_stats()["watch"] < by_call["instances.poll"] + size(None)

    assert await io.carry(fx.Route(instance_id="i0", version=0, trajectory_ids=["t0"])) is None
    assert "i0" in await _cycle(io)  # a command wakes it ...
    assert "i0" in await _cycle(io)  # ... and it stays polled while it has work
    inst.running.clear()  # its work ended
    await _cycle(io)
    assert await _cycle(io) == {}  # idle again: quiet
    # each poll counted by why it was sent: the first, the quiet period's, the command's,
    # and two while it had work (no watcher to ask for them)
    assert io.byte_stats()["polls"] == {"no_view": 1, "quiet": 1, "command": 1, "unwatched": 2}
    assert set(io.byte_stats()["polls"]) <= set(POLL_REASONS)


async def test_a_command_sent_while_a_poll_is_in_flight_keeps_the_instance_polled(
    tmp_path: Path, clock: list[float]
) -> None:
    inst = FakeInstance("i0")
    io = _io(tmp_path, inst)
    # the poll answers "idle", but a command went out before the answer was read: the answer
    # may predate it, so the instance must not go quiet
    await _cycle(io, between=lambda: io.touch("i0"))
    assert "i0" in await _cycle(io)
    assert await _cycle(io) == {}

    await io.sync("i0", inst, 3)  # a sync wakes it too: its new version shows in the next poll
    assert "i0" in await _cycle(io)


class WatchedInstance(FakeInstance):
    """With ``wait_results``, as the rollout actor has: True once ``ready`` is set."""

    def __init__(self, iid: str) -> None:
        super().__init__(iid)
        self.ready = asyncio.Event()
        self.dead = False
        self.wait_results = _Method(self._wait)

    async def _wait(self, timeout_s: float) -> bool:
        if self.dead:
            raise RuntimeError("the actor died")
        try:
            await asyncio.wait_for(self.ready.wait(), timeout_s)
        except TimeoutError:
            return False
        self.ready.clear()
        return True


async def _settle() -> None:
    for _ in range(5):  # let the watcher task run
        await asyncio.sleep(0)


async def test_an_instance_with_work_is_polled_when_it_asks_and_viewed_in_between(
    tmp_path: Path, clock: list[float]
) -> None:
    inst = WatchedInstance("i0")
    io = _io(tmp_path, inst)
    try:
        assert "i0" in await _cycle(io)  # no view yet
        assert await io.carry(fx.Route(instance_id="i0", version=0, trajectory_ids=["t0"])) is None
        assert "i0" in await _cycle(io)  # the command: its new work shows in this answer
        await _settle()
        for _ in range(5):  # working, nothing to say: no request, an extrapolated view
            clock[0] += 0.1
            polls = await _cycle(io)
            assert polls == {}
            (snap,) = io.views(clock[0], polls).values()
            assert [r.trajectory_id for r in snap.running] == ["t0"]
        assert inst.polls == 2

        inst.ready.set()  # results, or its view drifted
        await _settle()
        assert io.wake.is_set()
        assert "i0" in await _cycle(io)
        await _settle()
        assert await _cycle(io) == {}

        clock[0] += QUIET_POLL_S + 0.01  # still polled now and then
        assert "i0" in await _cycle(io)

        inst.dead = True  # its watcher's next call fails: that asks for a poll at once
        inst.ready.set()
        await _settle()
        assert "i0" in await _cycle(io)
        await _settle()
        assert "i0" in await _cycle(io)
        assert io.byte_stats()["polls"] == {"no_view": 1, "command": 1, "asked": 3, "quiet": 1}
    finally:
        io.stop_watching()


async def test_a_watch_whose_time_ran_out_is_counted_as_keeping_watch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shell_io, "WATCH_S", 0.01)
    inst = WatchedInstance("i0")
    io = _io(tmp_path, inst)
    try:
        await io.poll_all()  # starts its watcher
        await asyncio.sleep(0.1)  # several waits run out, each renewed
        renewals = io.byte_stats()["watch"] // (size(0.01) + size(False))
        assert renewals >= 2 and io.byte_stats()["watch"] % (size(0.01) + size(False)) == 0
        by_call = io.byte_stats()["by_call"]
        assert by_call["instances.wait_results"] >= io.byte_stats()["watch"]
    finally:
        io.stop_watching()
