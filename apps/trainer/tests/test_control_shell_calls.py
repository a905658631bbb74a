"""How the Ray control shell carries out its effects in time: calls to different instances go
out together (one instance's in order), a dead instance leaves the run once, and an event from
background work starts the next cycle at once instead of at the next tick.

The shell's peers are in-process fakes (no Ray); the Ray integration and fault tests run the
same code with real actors."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from engine_adapters import unpack_ids
from staleflow_trainer.actors import background_calls, effect_calls, shell_io
from staleflow_trainer.actors.control import ControlActor
from staleflow_trainer.actors.shell_io import ShellIO
from staleflow_trainer.actors.work_wire import pack_scores
from staleflow_trainer.config import load_config, to_dict
from staleflow_trainer.control import ControlCore, core_config
from staleflow_trainer.control import effects as fx
from staleflow_trainer.control.events import InstanceLost, Rewarded
from staleflow_trainer.data import PromptLengths
from staleflow_trainer.sim.shell import Simulation

SIM_TINY = Path(__file__).resolve().parents[3] / "examples" / "sim-tiny.yaml"


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _Dead(Exception):
    pass


class _Instance:
    """``submit`` logs start and end; the first call waits for ``gate`` when given one, and
    ``opens`` is set by every call."""

    def __init__(self, name: str, log: list[tuple[str, str]], *, gate: asyncio.Event | None = None,
                 opens: asyncio.Event | None = None, dead: bool = False) -> None:  # fmt: skip
        async def submit(version: int, ids: list[str]) -> int:
            log.append(("start", ids[0]))
            if dead:
                raise _Dead(name)
            if opens is not None:
                opens.set()
            if gate is not None and ids[0].endswith("1"):
                await asyncio.wait_for(gate.wait(), timeout=10)
            await asyncio.sleep(0)
            log.append(("end", ids[0]))
            return len(ids)

        self.submit = _Remote(submit)


class _Store:
    async def instance_lost(self, iid: str) -> tuple[str, ...]:
        return ()


def _io(rollouts: dict[str, Any]) -> ShellIO:
    cfg = load_config(SIM_TINY, [])
    io = ShellIO(cfg, prompts=PromptLengths(()), ts_address=("127.0.0.1", 1), ts_token="t",
                 rollouts=rollouts, trainer=None, rewards=[], reward_spec={})  # fmt: skip
    io.ts = _Store()
    return io


def _route(iid: str, tid: str) -> fx.Route:
    return fx.Route(instance_id=iid, version=0, trajectory_ids=(tid,))


async def test_calls_to_different_instances_go_out_together_one_instances_in_order() -> None:
    log: list[tuple[str, str]] = []
    b_started = asyncio.Event()
    io = _io({"a": _Instance("a", log, gate=b_started), "b": _Instance("b", log, opens=b_started)})
    # a's first call waits until b's has started: carried one after another, it never would
    lost = await io.carry_all(
        [_route("a", "a1"), _route("b", "b1"), _route("a", "a2")], lambda: 0.0
    )
    assert lost == []
    assert log.index(("start", "b1")) < log.index(("end", "a1"))
    assert log.index(("end", "a1")) < log.index(("start", "a2"))  # one instance: in order
    assert {x for _, x in log} == {"a1", "a2", "b1"}


async def test_a_dead_instance_leaves_the_run_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shell_io, "is_actor_death", lambda e: isinstance(e, _Dead))
    monkeypatch.setattr(effect_calls, "is_actor_death", lambda e: isinstance(e, _Dead))
    log: list[tuple[str, str]] = []
    io = _io({"a": _Instance("a", log), "c": _Instance("c", log, dead=True)})
    lost = await io.carry_all(
        [_route("c", "c1"), _route("a", "a1"), _route("c", "c2")], lambda: 1.5
    )
    assert [(e.instance_id, e.at) for e in lost] == [("c", 1.5)]
    assert all(isinstance(e, InstanceLost) for e in lost)
    assert list(io.rollouts) == ["a"]
    assert ("end", "a1") in log


async def test_an_event_from_background_work_starts_the_next_cycle_at_once(
    tmp_path: Path,
) -> None:
    # a 60 s tick: only the posted event can start the second cycle within the test's bound
    over = [f"run.run_dir={tmp_path}", "coordinator.snapshot_interval_s=60"]
    cfg = load_config(SIM_TINY, over)
    actor = ControlActor(cfg=to_dict(cfg), prompts=PromptLengths(()), ts_address=("127.0.0.1", 1),
                         ts_token="t", rollouts={}, trainer=None, rewards=[])  # fmt: skip
    sim = Simulation(cfg)
    actor.core = ControlCore(core_config(cfg, rows=None),
                             prompt_len=lambda row: sim.stream.group(row).prompt_len)  # fmt: skip
    actor._wal.reset(actor.core.to_dict())

    async def poll_all(*, wait_all: bool = False, send: bool = True) -> dict[str, Any]:
        return {}

    async def carry(effect: Any) -> None:
        return None

    actor.io.poll_all = poll_all  # type: ignore[method-assign]
    actor.io.carry = carry  # type: ignore[method-assign]
    actor.io.spawn = lambda coro: coro.close()  # type: ignore[method-assign]
    cycles: list[float] = []
    cycle = actor._cycle

    async def counted() -> None:
        cycles.append(actor.now())
        await cycle()

    actor._cycle = counted  # type: ignore[method-assign]

    async def until(n: int) -> None:
        while len(cycles) < n:
            await asyncio.sleep(0.01)

    run = asyncio.create_task(actor.run())
    await asyncio.wait_for(until(1), timeout=10)
    actor._post(Rewarded(at=actor.now(), rewards=[]))
    await asyncio.wait_for(until(2), timeout=10)
    await actor.stop()
    actor._post(Rewarded(at=actor.now(), rewards=[]))  # wakes the loop, which sees the stop
    await asyncio.wait_for(run, timeout=10)
    assert len(cycles) == 2  # the stop ends the loop; _settle feeds the last event


class _Watched:
    """``wait_results`` answers True once ``results`` is set (then blocks); ``poll`` answers
    nothing."""

    def __init__(self) -> None:
        self.results = asyncio.Event()
        self.waits = 0

        async def wait_results(timeout_s: float) -> bool:
            self.waits += 1
            if self.waits > 1:
                await asyncio.sleep(3600)
            await self.results.wait()
            return True

        async def poll(*args: Any) -> None:
            return None

        self.wait_results = _Remote(wait_results)
        self.poll = _Remote(poll)


async def test_an_instance_with_results_starts_the_next_cycle_at_once() -> None:
    inst = _Watched()
    io = _io({"a": inst})
    await io.poll_all()  # starts the watcher: its call waits on the instance
    await asyncio.sleep(0.01)
    assert not io.wake.is_set() and inst.waits == 1
    inst.results.set()
    await asyncio.wait_for(io.wake.wait(), timeout=10)
    await asyncio.sleep(0.01)
    assert inst.waits == 1  # it asks again only once the instance was polled
    await io.poll_all()
    await asyncio.wait_for(_until(lambda: inst.waits == 2), timeout=10)
    io.stop_watching()
    await asyncio.sleep(0)
    assert all(t.done() for t in io._watchers.values()) and not io._watchers


async def _until(cond: Any) -> None:
    while not cond():
        await asyncio.sleep(0.01)


class _Scorer:
    def __init__(self, dead: bool, calls: list[list[str]]) -> None:
        async def score(packed: list[Any]) -> list[Any]:
            await asyncio.sleep(0)  # both calls are in flight before either fails
            if dead:
                raise _Dead("reward")
            ids = unpack_ids(packed)
            calls.append(ids)
            return pack_scores([(float(t.rsplit("/", 1)[1]), None) for t in ids])

        self.score = _Remote(score)


async def test_a_dead_reward_worker_is_replaced_once_by_concurrent_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(background_calls, "is_actor_death", lambda e: isinstance(e, _Dead))
    calls: list[list[str]] = []
    io = _io({})
    io.rewards, io.reward_spec = [_Scorer(True, calls)], {"spec": 1}
    built: list[_Scorer] = []
    monkeypatch.setattr(io, "_new_reward_worker", lambda: built.append(_Scorer(False, calls))
                        or built[-1])  # fmt: skip
    a, b = await asyncio.gather(io.score(["g1/2", "g3/5", "g1/1"]), io.score(["g2/0"]))
    assert len(built) == 1 and io.rewards == built  # not one replacement per failed call
    # each id with its own score, whatever order the worker scored them in
    assert sorted(map(tuple, a[0])) == [("g1/1", 1.0, None), ("g1/2", 2.0, None),
                                        ("g3/5", 5.0, None)]  # fmt: skip
    assert b == [[["g2/0", 0.0, None]]]
    assert sorted(map(tuple, calls)) == [("g1/2", "g1/1", "g3/5"), ("g2/0",)]


async def _settled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   answers: list[dict[str, Any]]) -> tuple[list[Any], list[dict[str, Any]]]:  # fmt: skip
    """``ControlActor._settle`` over instances ``a`` and ``b`` whose polls answer ``answers``
    round after round (an instance left out: its poll failed; an exception: the poll ended
    it). The events fed, and the log."""
    from structlog.testing import capture_logs

    from staleflow_trainer.actors import control
    from staleflow_trainer.actors.in_store import InStore

    monkeypatch.setattr(control, "POLL_RETRY_S", 0.0)
    cfg = load_config(SIM_TINY, [f"run.run_dir={tmp_path}"])
    actor = ControlActor(cfg=to_dict(cfg), prompts=PromptLengths(()), ts_address=("127.0.0.1", 1),
                         ts_token="t", rollouts={"a": object(), "b": object()}, trainer=None,
                         rewards=[])  # fmt: skip
    rounds = iter(answers)

    async def nothing(*args: Any, **kw: Any) -> None:
        return None

    async def poll_all(*, wait_all: bool = False, send: bool = True) -> dict[str, Any]:
        return next(rounds, {}) if send else {}  # send=False: the answers still out, none

    async def refused(iid: str, p: Any) -> InStore:
        return InStore()

    fed: list[Any] = []

    async def feed(events: list[Any]) -> None:
        fed.extend(events)

    async def lose(iid: str, error: BaseException, at: float) -> InstanceLost:
        del actor.io.rollouts[iid]  # as the real one: it leaves the run
        return InstanceLost(at=at, instance_id=iid)

    actor.io.wait_background = nothing  # type: ignore[method-assign]
    actor.io.interrupt_all = nothing  # type: ignore[method-assign]
    actor.io.poll_all = poll_all  # type: ignore[method-assign]
    actor.io.refused = refused  # type: ignore[method-assign]
    actor.io.lose = lose  # type: ignore[method-assign]
    actor._feed_batch = feed  # type: ignore[method-assign]
    with capture_logs() as logs:
        await actor._settle()
    return fed, logs


async def test_settling_polls_again_an_instance_whose_poll_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fed, logs = await _settled(tmp_path, monkeypatch, [{"a": None}, {"b": None}])
    assert sorted(e.instance_id for e in fed) == ["a", "b"]  # b's outcomes were read too
    assert not [e for e in logs if e["event"] == "settle_incomplete"]


async def test_settling_names_the_instances_it_could_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fed, logs = await _settled(tmp_path, monkeypatch, [{"a": None}])
    assert [e.instance_id for e in fed] == ["a"]
    (warning,) = [e for e in logs if e["event"] == "settle_incomplete"]
    assert warning["instances"] == ["b"]


async def test_settling_loses_an_instance_its_polls_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ended = RuntimeError("3 polls in a row failed")
    fed, logs = await _settled(tmp_path, monkeypatch, [{"a": None}, {}, {"b": ended}])
    assert [(type(e).__name__, e.instance_id) for e in fed] == [
        ("Reported", "a"),
        ("InstanceLost", "b"),  # its work goes back to the queue before the checkpoint
    ]
    assert not [e for e in logs if e["event"] == "settle_incomplete"]


async def test_settling_waits_for_a_call_still_out_and_feeds_the_loss_it_ends_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A route to ``a`` hangs and the cycle went on without it (``ANSWER_WAIT_S``); the run
    then stops. Settling waits for that call (``call_timeout_s``, here longer than the
    background wait it would otherwise allow) and feeds the loss it ends in, with the rest."""
    from staleflow_trainer.actors import control
    from staleflow_trainer.actors.in_store import InStore

    monkeypatch.setattr(shell_io, "ANSWER_WAIT_S", 0.05)
    monkeypatch.setattr(effect_calls, "ANSWER_WAIT_S", 0.05)
    monkeypatch.setattr(shell_io, "kill_actor", lambda h: None)
    monkeypatch.setattr(control, "SETTLE_BACKGROUND_S", 0.05)
    monkeypatch.setattr(control, "POLL_RETRY_S", 0.0)  # its rounds of polls do not wait for it
    cfg = load_config(SIM_TINY, [f"run.run_dir={tmp_path}", "coordinator.poll_timeout_s=0.5"])
    log: list[tuple[str, str]] = []

    async def answer(*args: Any) -> None:
        return None

    hung = _Instance("a", log, gate=asyncio.Event())  # its first route waits for good
    well = _Instance("b", log)
    for inst in (hung, well):
        inst.poll = inst.interrupt = _Remote(answer)  # type: ignore[attr-defined]
    actor = ControlActor(cfg=to_dict(cfg), prompts=PromptLengths(()), ts_address=("127.0.0.1", 1),
                         ts_token="t", rollouts={"a": hung, "b": well}, trainer=None,
                         rewards=[])  # fmt: skip
    lost: list[str] = []

    async def lose(iid: str, error: BaseException, at: float) -> InstanceLost | None:
        if actor.io.rollouts.pop(iid, None) is None:
            return None
        lost.append(str(error))
        return InstanceLost(at=at, instance_id=iid)

    async def refused(iid: str, p: Any) -> InStore:
        return InStore()

    fed: list[Any] = []

    async def feed(events: list[Any]) -> None:
        fed.extend(events)

    actor.io.lose = lose  # type: ignore[method-assign]
    actor.io.refused = refused  # type: ignore[method-assign]
    actor._feed_batch = feed  # type: ignore[method-assign]
    routes = [fx.Route(instance_id=i, version=0, trajectory_ids=(f"{i}1",)) for i in "ab"]
    late = await actor.io.carry_all(routes, actor.now)  # a's route is late: a is silent
    assert [(type(e).__name__, e.instance_id) for e in late] == [("InstanceSilent", "a")]
    assert actor.io.lanes.busy("a") and ("end", "b1") in log
    await actor._settle()
    assert [e.instance_id for e in fed if isinstance(e, InstanceLost)] == ["a"]
    assert "route on 'a' did not return within coordinator.poll_timeout_s=0.5" in lost[0]
    assert actor.io.take_late(0.0) == [] and list(actor.io.rollouts) == ["b"]


async def test_a_failure_of_the_loop_itself_is_logged_before_it_ends_the_run(
    tmp_path: Path,
) -> None:
    from structlog.testing import capture_logs

    cfg = load_config(SIM_TINY, [f"run.run_dir={tmp_path}"])
    actor = ControlActor(cfg=to_dict(cfg), prompts=PromptLengths(()), ts_address=("127.0.0.1", 1),
                         ts_token="t", rollouts={}, trainer=None, rewards=[])  # fmt: skip
    sim = Simulation(cfg)
    actor.core = ControlCore(core_config(cfg, rows=None),
                             prompt_len=lambda row: sim.stream.group(row).prompt_len)  # fmt: skip

    async def broken() -> None:
        raise RuntimeError("boom")

    actor._cycle = broken  # type: ignore[method-assign]
    with capture_logs() as logs, pytest.raises(RuntimeError, match="boom"):
        await actor.run()
    (failed,) = [e for e in logs if e["event"] == "run_failed"]
    assert failed["log_level"] == "error" and "boom" in failed["error"]
