"""Answers that come after their control cycle (``actors.lanes``): a cycle waits
``ANSWER_WAIT_S`` for the instances' answers, and a late one is handled in a later cycle. These
tests pin what a late answer may and may not do to the control side's view of an instance:

* a late poll answer that a command queued after its poll has overtaken is decoded (the next
  delta follows it) but gives no snapshot: it lacks the command's effect (an abort's interrupt:
  routes to an instance with a call overdue are taken back, see ``actors.silence``);
* an instance with a command still out gets no extrapolated view (it would lack the command);
* the ids an interrupt's answer reported go with the first poll sent after the interrupt, not
  with a late answer to a poll sent before it;
* a later cycle does not wait again for a poll still out.

Fake instances answer with real snapshot deltas (``engine_adapters.SnapshotEncoder``); the
coordinator's speculative state is the real one."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from engine_adapters import EngineSnapshot, RunningTrajectory, SnapshotEncoder, unpack_ids
from rollout_coordinator._speculative import SpeculativeState
from staleflow_trainer.actors import effect_calls, shell_io
from staleflow_trainer.actors.shell_io import ShellIO
from staleflow_trainer.config import load_config
from staleflow_trainer.control import effects as fx
from staleflow_trainer.data import PromptLengths

SIM_TINY = Path(__file__).resolve().parents[3] / "examples" / "sim-tiny.yaml"
pytestmark = pytest.mark.timeout(20)


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _Instance:
    """Routes add running work, interrupts remove it and report it (its next poll's delta
    carries their end), as the rollout actor does; ``poll_delay_s`` makes polls late."""

    def __init__(self, running: tuple[str, ...] = ()) -> None:
        self.running = list(running)
        self.reported: set[str] = set()
        self.poll_delay_s = 0.0
        self.hang_submit = False
        self.calls: list[str] = []
        enc, seq = SnapshotEncoder(), [0]

        async def poll(ack: int | None = None, full: bool = False) -> Any:
            self.calls.append("poll")
            await asyncio.sleep(self.poll_delay_s)
            seq[0] += 1
            snap = EngineSnapshot(
                instance_id="a", seq=seq[0], time_s=float(seq[0]), version=0,
                running=tuple(RunningTrajectory(trajectory_id=t, prompt_tokens=10,
                                                generated_tokens=0) for t in self.running),
                waiting=0, kv_used_tokens=10 * len(self.running), kv_capacity_tokens=1000,
                throughput_tokens_per_s=0.0)  # fmt: skip
            ended, self.reported = self.reported, set()
            delta = enc.encode(snap, ack=ack, full=full, ended=ended)
            return None if delta is None else [delta]

        async def submit(version: int, ids: Any) -> int:
            self.calls.append("submit")
            if self.hang_submit:
                await asyncio.Event().wait()
            self.running += unpack_ids(ids)
            return 0

        async def interrupt(ids: Any, report: bool = False) -> Any:
            self.calls.append("interrupt")
            cut = unpack_ids(ids)
            for t in cut:
                self.running.remove(t)
            self.reported |= set(cut)
            return [3] * len(cut)

        self.poll, self.submit, self.interrupt = _Remote(poll), _Remote(submit), _Remote(interrupt)


@pytest.fixture(autouse=True)
def _fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shell_io, "ANSWER_WAIT_S", 0.05)
    monkeypatch.setattr(effect_calls, "ANSWER_WAIT_S", 0.05)
    monkeypatch.setattr(shell_io, "kill_actor", lambda h: None)


def _io(rollouts: dict[str, Any]) -> ShellIO:
    cfg = load_config(SIM_TINY, ["coordinator.call_timeout_s=30"])
    return ShellIO(cfg, prompts=PromptLengths(()), ts_address=("127.0.0.1", 1), ts_token="t",
                   rollouts=rollouts, trainer=None, rewards=[], reward_spec={})  # fmt: skip


async def _cycle(io: ShellIO) -> dict[str, Any]:
    """One cycle's polls, each answer decoded as the control shell does (its snapshot)."""
    polls = await io.poll_all()
    assert not any(isinstance(p, BaseException) for p in polls.values()), polls
    return {
        i: io.snapshot(i, (p or {}).get("snapshot"), time.monotonic(), []) for i, p in polls.items()
    }


def _route(iid: str, tid: str) -> fx.Route:
    return fx.Route(instance_id=iid, version=0, trajectory_ids=(tid,))


class _Store:
    async def drop(self, ids: list[str], reason: str) -> int:
        return len(ids)


async def test_a_late_answer_overtaken_by_a_command_gives_no_snapshot() -> None:
    """(A route to the instance would not be sent: a call to it is overdue, so it is silent
    and its routes are taken back; an abort's interrupt still goes.)"""
    a = _Instance(("t1", "t2"))
    io = _io({"a": a})
    io.ts = _Store()
    (first,) = (await _cycle(io)).values()
    st = SpeculativeState()
    st.add_instance("a", version=0, kv_capacity_tokens=1000)
    st.apply_snapshot(first, now=time.monotonic(), latest_version=0)
    io.touch("a")
    a.poll_delay_s = 0.3
    assert await _cycle(io) == {}  # the poll is late
    st.interrupt("a", ["t1"], now=time.monotonic())  # the protocol aborts t1
    cut = fx.Interrupt(instance_id="a", trajectory_ids=("t1",), reason="x", requeue=False)
    await io.carry_all([cut], time.monotonic)  # queued behind the poll
    await asyncio.sleep(0.5)
    assert a.calls == ["poll", "poll", "interrupt"]
    assert await _cycle(io) == {"a": None}  # its answer, taken before t1 ended: no view
    assert st.instances["a"].n_running == 1  # so t1 stays out of the coordinator's view
    a.poll_delay_s = 0.0
    (snap,) = (await _cycle(io)).values()  # the next delta follows the late one
    assert snap is not None and [r.trajectory_id for r in snap.running] == ["t2"]


async def test_a_late_answer_with_no_command_since_is_used() -> None:
    a = _Instance(("t1",))
    io = _io({"a": a})
    await _cycle(io)
    io.touch("a")
    a.poll_delay_s = 0.3
    assert await _cycle(io) == {}
    await asyncio.sleep(0.5)
    (snap,) = (await _cycle(io)).values()
    assert snap is not None and [r.trajectory_id for r in snap.running] == ["t1"]


async def test_an_instance_with_a_command_out_gets_no_extrapolated_view() -> None:
    a = _Instance(("t1",))
    io = _io({"a": a})
    await _cycle(io)
    assert "a" in io.views(time.monotonic(), {})  # it has work: extrapolated between polls
    a.hang_submit = True
    await io.carry_all([_route("a", "r1")], time.monotonic)
    assert io.lanes.busy("a")
    polls = await io.poll_all()
    assert "a" not in polls and "a" not in io.views(time.monotonic(), polls)
    for t in [*io._tasks, *io.lanes._tail.values()]:
        t.cancel()


async def test_interrupted_ids_go_with_the_first_poll_sent_after_the_interrupt() -> None:
    a = _Instance(("t1", "t2"))
    io = _io({"a": a})
    await _cycle(io)
    io.touch("a")
    a.poll_delay_s = 0.3
    assert await _cycle(io) == {}  # a poll P, late
    cut = fx.Interrupt(instance_id="a", trajectory_ids=("t1",), reason="x", requeue=True)
    await io.carry_all([cut], time.monotonic)  # queued behind P
    await asyncio.sleep(0.5)
    assert a.calls == ["poll", "poll", "interrupt"]
    assert (await _cycle(io))["a"] is None  # P: decoded without t1's end (overtaken)
    a.poll_delay_s = 0.0
    io.touch("a")
    (snap,) = (await _cycle(io)).values()  # the poll after the interrupt carries t1's end
    assert snap is not None and [r.trajectory_id for r in snap.running] == ["t2"]


async def test_a_later_cycle_does_not_wait_for_a_poll_still_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shell_io, "ANSWER_WAIT_S", 0.5)
    monkeypatch.setattr(effect_calls, "ANSWER_WAIT_S", 0.5)
    a, b = _Instance(), _Instance()
    io = _io({"a": a, "b": b})
    await _cycle(io)
    a.poll_delay_s = 10.0
    io.touch("a")
    with capture_logs() as logs:
        assert await _cycle(io) == {}  # a's poll is late: this cycle waited 0.5 s
        for _ in range(3):
            io.touch("b")
            t0 = time.monotonic()
            assert list(await _cycle(io)) == ["b"]
            assert time.monotonic() - t0 < 0.25  # b answers at once; a's poll is not waited for
    assert a.calls == ["poll", "poll"]  # and not sent again
    late = [(e["instance"], e["call"], e["log_level"]) for e in logs
            if e["event"] == "instance_answer_late"]  # fmt: skip
    assert late == [("a", "poll", "warning")]  # said once, when it missed its cycle
    for t in io.lanes._tail.values():
        t.cancel()
