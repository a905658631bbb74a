"""A live instance whose calls fail (its engine's server went away, say) or hang leaves the run
instead of ending or stalling it: a failed poll is tried again ``POLL_RETRY_S`` later, until
``coordinator.instance_error_limit`` polls in a row have failed; a failed route or interrupt
(the instance's state is then unknown), and any call not answered within
``coordinator.call_timeout_s``, end it at once. Ending it kills its actor; the control loop then
loses it as a dead one.

The shell's peers are in-process fakes (no Ray); ``integration_tests/cpu/
test_train_sglang_standin.py`` runs the same path with real actors and a real server that
stops answering."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from engine_adapters import EngineSnapshot, SnapshotEncoder
from staleflow_trainer.actors import effect_calls, shell_io
from staleflow_trainer.actors.shell_io import ShellIO
from staleflow_trainer.config import load_config
from staleflow_trainer.control import effects as fx
from staleflow_trainer.control.events import InstanceLost, InstanceSilent, Reported
from staleflow_trainer.data import PromptLengths

SIM_TINY = Path(__file__).resolve().parents[3] / "examples" / "sim-tiny.yaml"


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _Instance:
    """Each call fails with ``ConnectionError`` while ``failing``; a poll answers an idle
    engine's snapshot as the rollout actor does (a delta, None if unchanged)."""

    def __init__(self) -> None:
        self.failing = False
        self.hanging = False
        self.delay_s = 0.0  # each call answers this late
        self.calls: list[str] = []
        enc, seq = SnapshotEncoder(), [0]

        def snapshot(ack: int | None = None, full: bool = False) -> list[Any] | None:
            seq[0] += 1
            snap = EngineSnapshot(instance_id="a", seq=seq[0], time_s=float(seq[0]), version=0,
                                  running=(), waiting=0, kv_used_tokens=0,
                                  kv_capacity_tokens=100, throughput_tokens_per_s=0.0)  # fmt: skip
            delta = enc.encode(snap, ack=ack, full=full)
            return None if delta is None else [delta]

        def call(name: str, answer: Any) -> _Remote:
            async def fn(*args: Any) -> Any:
                self.calls.append(name)
                if self.hanging:
                    await asyncio.Event().wait()
                await asyncio.sleep(self.delay_s)
                if self.failing:
                    raise ConnectionError("All connection attempts failed")
                return answer(*args)

            return _Remote(fn)

        self.poll = call("poll", snapshot)
        self.submit = call("submit", lambda version, ids: len(ids))
        self.interrupt = call("interrupt", lambda ids, report: [3] * len(ids))


class _Store:
    async def instance_lost(self, iid: str) -> tuple[str, ...]:
        return ()

    async def drop(self, ids: list[str], reason: str) -> int:
        return len(ids)


CLOCK = [1000.0]  # the shell's clock: it moves only when a test moves it


@pytest.fixture
def killed(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The actors killed; the shell's clock stands still unless moved (``CLOCK``)."""
    out: list[Any] = []
    monkeypatch.setattr(shell_io, "kill_actor", out.append)
    CLOCK[0] = 1000.0
    # the shell's own clock only: asyncio's (time.monotonic) must run for the call timeouts
    monkeypatch.setattr(shell_io, "time", SimpleNamespace(monotonic=lambda: CLOCK[0]))
    return out


def _io(
    rollouts: dict[str, Any], limit: int = 3, call_s: float = 30.0, poll_s: float | None = None
) -> ShellIO:
    limits = [
        f"coordinator.call_timeout_s={call_s}",
        f"coordinator.poll_timeout_s={poll_s or call_s}",
    ]
    cfg = load_config(SIM_TINY, [f"coordinator.instance_error_limit={limit}", *limits])
    io = ShellIO(cfg, prompts=PromptLengths(()), ts_address=("127.0.0.1", 1), ts_token="t",
                 rollouts=rollouts, trainer=None, rewards=[], reward_spec={})  # fmt: skip
    io.ts = _Store()
    return io


async def _cycle(io: ShellIO) -> dict[str, Any]:
    """One control cycle's polls, each answer decoded as the control shell does."""
    polls = await io.poll_all()
    for iid, p in polls.items():
        if not isinstance(p, BaseException):
            io.snapshot(iid, (p or {}).get("snapshot"), 0.0, [])
    return polls


async def test_failed_polls_are_tried_again_and_the_count_restarts_after_a_good_one(
    killed: list[Any],
) -> None:
    a = _Instance()
    io = _io({"a": a})
    await _cycle(io)  # a full snapshot: idle, it is not polled again before QUIET_POLL_S
    assert "a" not in await _cycle(io) and a.calls.count("poll") == 1
    a.failing = True
    io._signaled.add("a")  # its watcher asks (results wait): the poll fails
    assert "a" not in await _cycle(io) and a.calls.count("poll") == 2
    for _ in range(3):  # not tried again before POLL_RETRY_S, whatever else asks
        io._signaled.add("a")
        assert "a" not in await _cycle(io)
    assert a.calls.count("poll") == 2
    CLOCK[0] += shell_io.POLL_RETRY_S
    assert "a" not in await _cycle(io)  # the second failure in a row (the limit is 3)
    assert a.calls.count("poll") == 3
    assert io.byte_stats()["polls"]["retry"] == 1
    a.failing = False
    CLOCK[0] += shell_io.POLL_RETRY_S
    assert "a" in await _cycle(io)  # the retry answers: the count starts again
    assert a.calls.count("poll") == 4
    a.failing = True
    io._signaled.add("a")
    for _ in range(2):
        assert "a" not in await _cycle(io)
        CLOCK[0] += shell_io.POLL_RETRY_S
    assert killed == [] and list(io.rollouts) == ["a"]
    assert io.byte_stats()["polls"]["retry"] == 3


async def test_an_instance_whose_poll_failed_gets_no_extrapolated_view(
    killed: list[Any],
) -> None:
    """Its view would be its last answer's, without the work routed there since: the core
    keeps its own account of the instance until a poll answers again."""
    a = _Instance()
    io = _io({"a": a})
    await _cycle(io)
    io._quiet.discard("a")  # it had work at its last poll: it gets a view between polls
    assert "a" in io.views(CLOCK[0], ())
    a.failing = True
    io._signaled.add("a")
    assert "a" not in await _cycle(io)
    assert "a" not in io.views(CLOCK[0], ())
    a.failing = False
    CLOCK[0] += shell_io.POLL_RETRY_S
    assert "a" in await _cycle(io)
    io._quiet.discard("a")
    assert "a" in io.views(CLOCK[0], ())


async def test_the_limits_failed_poll_kills_the_actor_and_answers_the_error(
    killed: list[Any],
) -> None:
    a = _Instance()
    io = _io({"a": a}, limit=2)
    a.failing = True
    assert "a" not in await io.poll_all()
    CLOCK[0] += shell_io.POLL_RETRY_S
    got = await io.poll_all()
    err = got["a"]
    assert isinstance(err, RuntimeError)
    assert "2 polls in a row on 'a' failed" in str(err) and "ConnectionError" in str(err)
    assert killed == [a]
    lost = await io.lose("a", err, 4.0)  # what the control loop does with the answer
    assert isinstance(lost, InstanceLost) and lost.instance_id == "a"
    assert io.rollouts == {}
    assert await io.lose("a", err, 5.0) is None  # lost once (a sync may find it dead later)
    assert len(io.lost) == 1


async def test_a_failed_route_ends_the_instance_at_once(killed: list[Any]) -> None:
    a, b = _Instance(), _Instance()
    a.failing = True
    io = _io({"a": a, "b": b})
    route = [fx.Route(instance_id=i, version=0, trajectory_ids=(f"{i}1",)) for i in "ab"]
    lost = await io.carry_all(route, lambda: 2.0)
    assert [(e.instance_id, e.at) for e in lost] == [("a", 2.0)]
    assert killed == [a] and list(io.rollouts) == ["b"]
    assert io.lost[0]["instance_id"] == "a" and "route on 'a' failed" in io.lost[0]["error"]


@pytest.mark.parametrize("requeue", [True, False])
async def test_a_failed_interrupt_ends_the_instance(killed: list[Any], requeue: bool) -> None:
    a = _Instance()
    a.failing = True
    io = _io({"a": a})
    cut = fx.Interrupt(instance_id="a", trajectory_ids=("a1",), reason="migrate", requeue=requeue)
    lost = await io.carry_all([cut], lambda: 2.0)
    assert killed == [a]
    # requeued work needs the loss now; an abort's (dropped in the store) waits for the next
    # poll, which finds the actor gone
    assert [e.instance_id for e in lost] == (["a"] if requeue else [])


@pytest.mark.timeout(10)
@pytest.mark.parametrize("call", ["poll", "route", "interrupt"])
async def test_a_call_that_hangs_ends_the_instance_at_once(killed: list[Any], call: str) -> None:
    # a poll or a route (answered at once by a well instance) is bounded by poll_timeout_s, an
    # interrupt (which may wait for its generations) by call_timeout_s; the other one is long
    key = "call_timeout_s" if call == "interrupt" else "poll_timeout_s"
    a, b = _Instance(), _Instance()
    io = _io({"a": a, "b": b}, **({"call_s": 0.2} if key == "call_timeout_s" else
                                  {"call_s": 60.0, "poll_s": 0.2}))  # fmt: skip
    a.hanging = True
    if call == "poll":
        got = await io.poll_all()
        err = got["a"]
        assert isinstance(err, RuntimeError) and "b" in got
    else:
        cmds = [
            fx.Route(instance_id="a", version=0, trajectory_ids=("a1",))
            if call == "route"
            else fx.Interrupt(instance_id="a", trajectory_ids=("a1",), reason="x", requeue=True),
            fx.Route(instance_id="b", version=0, trajectory_ids=("b1",)),
        ]
        lost = await io.carry_all(cmds, lambda: 2.0)
        assert [e.instance_id for e in lost] == ["a"]
        err = io.lost[0]["error"]
        assert b.calls == ["submit"]
    assert f"{call} on 'a' did not return within coordinator.{key}=0.2" in str(err)
    assert killed == [a]


@pytest.mark.timeout(10)
async def test_after_a_hung_call_the_instances_other_calls_are_not_sent(
    killed: list[Any],
) -> None:
    a = _Instance()
    a.hanging = True
    io = _io({"a": a}, call_s=0.2)
    routes = [fx.Route(instance_id="a", version=0, trajectory_ids=(f"a{k}",)) for k in range(3)]
    lost = await io.carry_all(routes, lambda: 2.0)  # one wait of 0.2 s, not three
    assert [e.instance_id for e in lost] == ["a"] and a.calls == ["submit"]


@pytest.mark.timeout(10)
async def test_a_timeout_error_from_the_instance_itself_is_a_failure_not_a_hang(
    killed: list[Any],
) -> None:
    a = _Instance()
    io = _io({"a": a}, call_s=5.0)

    async def times_out(*args: Any) -> Any:
        raise TimeoutError("the engine's own request timed out")

    a.poll = _Remote(times_out)
    assert "a" not in await io.poll_all()  # retried later, like any failed poll
    assert killed == [] and list(io.rollouts) == ["a"]


@pytest.mark.timeout(10)
async def test_a_hung_poll_holds_its_own_instance_only(
    killed: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cycle waits ANSWER_WAIT_S for the polls, not call_timeout_s: the other instance's
    answer is handed on, the hung one is not polled again while its poll is out, gets no
    extrapolated view, and is ended once call_timeout_s has run out."""
    monkeypatch.setattr(shell_io, "ANSWER_WAIT_S", 0.05)
    monkeypatch.setattr(effect_calls, "ANSWER_WAIT_S", 0.05)
    a, b = _Instance(), _Instance()
    io = _io({"a": a, "b": b}, call_s=0.6)
    await _cycle(io)  # both have a view
    a.hanging = True
    io.touch("a"), io.touch("b")  # a command went to each: both are due
    t0 = asyncio.get_running_loop().time()
    got = await _cycle(io)
    assert list(got) == ["b"] and asyncio.get_running_loop().time() - t0 < 0.5
    assert "a" not in io.views(0.0, got)
    io.touch("a"), io.touch("b")
    assert list(await _cycle(io)) == ["b"] and a.calls == ["poll", "poll"]  # not sent again
    await asyncio.sleep(0.7)
    got = await _cycle(io)
    assert "did not return within coordinator.poll_timeout_s=0.6" in str(got["a"])
    assert killed == [a]


@pytest.mark.timeout(10)
async def test_a_hung_route_holds_its_own_instance_only(
    killed: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """carry_all waits ANSWER_WAIT_S for the instances' calls: the other instance's route is
    carried and the cycle goes on, and the hung one is silent; a later route to it is taken
    back at once (never sent); its loss comes with ``take_late``."""
    monkeypatch.setattr(shell_io, "ANSWER_WAIT_S", 0.05)
    monkeypatch.setattr(effect_calls, "ANSWER_WAIT_S", 0.05)
    a, b = _Instance(), _Instance()
    io = _io({"a": a, "b": b}, call_s=0.4)
    a.hanging = True

    def route(iid: str, tid: str) -> fx.Route:
        return fx.Route(instance_id=iid, version=0, trajectory_ids=(tid,))

    t0 = asyncio.get_running_loop().time()
    with capture_logs() as logs:
        got = await io.carry_all([route("a", "a1"), route("b", "b1")], lambda: 2.0)
        assert got == [InstanceSilent(at=2.0, instance_id="a")]
        got = await io.carry_all([route("a", "a2")], lambda: 2.0)  # taken back: not waited
        assert got == [InstanceSilent(at=2.0, instance_id="a", withdrawn=["a2"])]
    late = [(e["instance"], e["call"]) for e in logs if e["event"] == "instance_answer_late"]
    assert late == [("a", "route")]
    assert asyncio.get_running_loop().time() - t0 < 0.3
    assert b.calls == ["submit"] and a.calls == ["submit"] and io.take_late(3.0) == []
    await asyncio.wait_for(io.wake.wait(), timeout=5)
    late = io.take_late(3.0)
    assert [(type(e), e.instance_id) for e in late] == [(InstanceLost, "a")]
    assert "route on 'a' did not return" in io.lost[0]["error"]
    await io.wait_background(5)
    assert a.calls == ["submit"] and killed == [a]  # a2 was never sent


@pytest.mark.timeout(10)
async def test_an_interrupts_late_answer_comes_with_the_next_cycle(
    killed: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shell_io, "ANSWER_WAIT_S", 0.05)
    monkeypatch.setattr(effect_calls, "ANSWER_WAIT_S", 0.05)
    a = _Instance()
    a.delay_s = 0.3
    io = _io({"a": a}, call_s=5.0)
    cut = fx.Interrupt(instance_id="a", trajectory_ids=("a1", "a2"), reason="x", requeue=True)
    assert await io.carry_all([cut], lambda: 2.0) == [InstanceSilent(at=2.0, instance_id="a")]
    assert not io.lanes.busy("b") and io.lanes.busy("a")
    await asyncio.wait_for(io.wake.wait(), timeout=5)
    rep, answers = io.take_late(4.0)
    assert answers == InstanceSilent(at=4.0, instance_id="a", silent=False)
    assert isinstance(rep, Reported)
    assert rep.instance_id == "a" and rep.at == 4.0
    assert [(o.trajectory_id, o.generated, o.finish) for o in rep.outcomes] == [
        ("a1", 3, None),
        ("a2", 3, None),
    ]
    assert killed == [] and not io.lanes.busy("a")


@pytest.mark.timeout(10)
async def test_a_call_queued_behind_a_hung_poll_is_not_sent(
    killed: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hung poll ends the instance: what waited behind it in its lane is not sent (else
    each of those calls would wait its limit in turn on an instance that is gone)."""
    monkeypatch.setattr(shell_io, "ANSWER_WAIT_S", 0.05)
    monkeypatch.setattr(effect_calls, "ANSWER_WAIT_S", 0.05)
    a = _Instance()
    io = _io({"a": a}, call_s=0.3)
    a.hanging = True
    assert await io.poll_all() == {}  # out, late
    # (a route would be taken back at once: the instance is silent; an abort still goes)
    cut = fx.Interrupt(instance_id="a", trajectory_ids=("a1",), reason="x", requeue=False)
    got = await io.carry_all([cut], lambda: 2.0)  # behind the poll: not waited
    assert got == [InstanceSilent(at=2.0, instance_id="a")]
    await asyncio.sleep(0.5)
    await io.wait_background(5)
    assert a.calls == ["poll"]  # the route was never sent
    got = await io.poll_all()
    assert "did not return within coordinator.poll_timeout_s=0.3" in str(got["a"])


@pytest.mark.timeout(10)
async def test_routes_queued_behind_an_overdue_call_come_back_and_the_instance_is_silent(
    killed: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A route queued behind a call that then misses its cycle is taken back, not sent: the
    core gets it back (``InstanceSilent.withdrawn``) with the news that the instance is silent,
    and routes it to instances that answer. Once the call is answered, the instance answers
    again (``silent=False``) and its later routes are sent."""
    monkeypatch.setattr(shell_io, "ANSWER_WAIT_S", 0.05)
    monkeypatch.setattr(effect_calls, "ANSWER_WAIT_S", 0.05)
    a, b = _Instance(), _Instance()
    io = _io({"a": a, "b": b}, call_s=5.0)
    a.delay_s = 0.4  # slow, not hung
    cut = fx.Interrupt(instance_id="a", trajectory_ids=("a0",), reason="x", requeue=True)
    io.lanes.run("a", lambda: io.carry(cut))  # out before this cycle (not waited for)

    def route(iid: str, *tids: str) -> fx.Route:
        return fx.Route(instance_id=iid, version=0, trajectory_ids=tids)

    got = await io.carry_all([route("a", "a1", "a2"), route("b", "b1")], lambda: 2.0)
    assert got == []  # queued behind the interrupt, not waited for; b's route carried
    io.touch("a")
    assert "a" not in await io.poll_all()  # a poll behind them: not sent (its lane is busy)
    got = await io.carry_all([route("b", "b2")], lambda: 3.0)
    assert got == []
    io._late_answer("a", "interrupt")  # what the cycle that waited for it says once it is late
    assert io.take_late(3.5) == [
        InstanceSilent(at=3.5, instance_id="a"),
        InstanceSilent(at=3.5, instance_id="a", withdrawn=["a1", "a2"]),
    ]
    await io.wait_background(5)
    while io.lanes.busy("a"):
        await asyncio.sleep(0.05)
    assert a.calls == ["interrupt"] and b.calls.count("submit") == 2  # a1, a2 never sent
    assert [e for e in io.take_late(4.0) if isinstance(e, InstanceSilent)] == [
        InstanceSilent(at=4.0, instance_id="a", silent=False)
    ]
    a.delay_s = 0.0
    assert await io.carry_all([route("a", "a3")], lambda: 5.0) == []
    assert a.calls == ["interrupt", "submit"] and killed == []
