"""A rollout instance whose engine died ends its own process (exit status
``ENGINE_DEAD_EXIT``), found by the health check while it is idle or by a call that meets the
dead engine — here on a real sim engine, with the process exit caught. Over Ray, the control
side then sees a lost instance: ``integration_tests/cpu/test_faults_dead_or_hung_instance_sim.py``."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from engine_adapters import (
    EngineDead,
    EngineUnavailable,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    PromptTooLong,
    SamplingParams,
)
from engine_adapters.sim import SimAdapter, SimConfig
from staleflow_trainer.actors import engine_health
from staleflow_trainer.actors.engine_health import ENGINE_DEAD_EXIT
from staleflow_trainer.actors.rollout import RolloutActor


class Exited(Exception):
    pass


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A child process standing in for the engine's (the test's own children are not the
    dying instance's to kill: pytest's multiprocessing resource tracker is one)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch, child: subprocess.Popen[bytes]) -> list[int]:
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        raise Exited(code)

    monkeypatch.setattr(engine_health.os, "_exit", fake_exit)
    monkeypatch.setattr(engine_health, "HEALTH_CHECK_S", 0.01)
    # no driver fetches the dying instance's last lines here (test_log_relay.py covers that
    # wait): once another test has taken lines in this process, each death would wait for it
    monkeypatch.setattr(engine_health, "LAST_LINES_S", 0.0)
    monkeypatch.setattr(engine_health, "child_processes", lambda: [(child.pid, "sleep 60")])
    return codes


async def _actor() -> tuple[RolloutActor, SimAdapter]:
    actor = RolloutActor(
        instance_id="sim-0", backend="sim", engine_kwargs={}, ts_address=("127.0.0.1", 1),
        ts_token=None,
    )  # fmt: skip
    engine = SimAdapter(SimConfig(), instance_id="sim-0")
    await engine.start()
    actor._engine = engine
    return actor, engine


async def test_the_health_check_ends_the_process_of_an_idle_instance(
    exits: list[int], child: subprocess.Popen[bytes]
) -> None:
    actor, engine = await _actor()
    watch = asyncio.create_task(actor._watch_health())
    await asyncio.sleep(0.05)
    assert not watch.done()  # a live engine: the check goes on
    engine.kill()
    with pytest.raises(Exited):
        await asyncio.wait_for(watch, 5)
    assert exits == [ENGINE_DEAD_EXIT]
    assert child.wait(5) == -signal.SIGKILL  # its child processes were killed first


async def test_a_generation_that_meets_a_dead_engine_ends_the_process(exits: list[int]) -> None:
    actor, engine = await _actor()
    req = GenerateRequest(
        trajectory_id="g/0", prompt_token_ids=(1, 2, 3),
        sampling=SamplingParams(max_new_tokens=10_000),
    )  # fmt: skip
    run: asyncio.Task[Any] = asyncio.create_task(actor._run(engine, req))
    await asyncio.sleep(0.05)
    engine.kill()
    with pytest.raises(Exited):
        await asyncio.wait_for(run, 5)
    assert exits == [ENGINE_DEAD_EXIT]
    # not reported as a zero-progress interruption to requeue: the process ends instead
    assert actor._to_write == [] and actor._errors == []


async def test_a_failed_call_on_an_engine_found_dead_ends_the_process(
    exits: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead server's calls may fail with a plain connection error (SGLang's HTTP client): the
    instance asks the engine's health check, which says it is dead."""
    actor, engine = await _actor()
    engine.kill()

    async def refused() -> None:
        raise ConnectionError("connection refused")

    monkeypatch.setattr(engine, "snapshot", refused)
    with pytest.raises(Exited):
        await actor._snapshot(engine)
    assert exits == [ENGINE_DEAD_EXIT]


async def test_a_failed_call_on_a_live_engine_is_the_callers_to_handle(
    exits: list[int], monkeypatch: pytest.MonkeyPatch, child: subprocess.Popen[bytes]
) -> None:
    actor, engine = await _actor()

    async def refused() -> None:
        raise ConnectionError("connection refused")

    monkeypatch.setattr(engine, "snapshot", refused)
    with pytest.raises(ConnectionError):
        await actor._snapshot(engine)
    assert exits == [] and child.poll() is None
    await engine.close()


async def test_a_dying_instance_writes_what_finished_first(
    exits: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    actor, engine = await _actor()
    flushed: list[int] = []

    async def flush() -> None:
        flushed.append(len(actor._to_write))

    monkeypatch.setattr(actor, "_flush", flush)
    done = GenerateResult(trajectory_id="g/1", token_ids=(4, 5), logprobs=(-0.1, -0.2),
                          versions=(0, 0), finish_reason=FinishReason.STOP)  # fmt: skip
    actor._to_write.append((done, True))  # finished, not yet in the TS
    engine.kill()
    with pytest.raises(Exited):
        await actor._watch_health()
    assert flushed == [1] and exits == [ENGINE_DEAD_EXIT]


def _request(i: int, prompt: str | None = None) -> GenerateRequest:
    """Sample 0 of prompt ``g<i>`` (or sample ``i`` of ``prompt``)."""
    tid = f"g{i}/0" if prompt is None else f"{prompt}/{i}"
    return GenerateRequest(trajectory_id=tid, prompt_token_ids=(1, 2, 3),
                           sampling=SamplingParams(max_new_tokens=4))  # fmt: skip


async def test_an_engine_whose_every_generation_fails_ends_the_process(
    exits: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live engine (its health check and snapshots answer) whose generations all fail is
    treated as unable to serve after ``generate_error_limit`` failures in a row."""
    actor, engine = await _actor()
    actor._error_limit = 3

    async def fails(req: GenerateRequest) -> GenerateResult:
        raise EngineUnavailable("HTTP 500: internal error")

    monkeypatch.setattr(engine, "generate", fails)
    for i in range(2):
        await actor._run(engine, _request(i))  # a zero-progress interruption each
    assert exits == [] and len(actor._errors) == 2
    with pytest.raises(Exited):
        await actor._run(engine, _request(2))
    assert exits == [ENGINE_DEAD_EXIT]


async def test_a_success_between_failures_or_a_requests_own_error_counts_for_nothing(
    exits: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    actor, engine = await _actor()
    actor._error_limit = 3
    serve = engine.generate
    outcome: list[BaseException | None] = []

    async def maybe(req: GenerateRequest) -> GenerateResult:
        error = outcome.pop(0)
        if error is not None:
            raise error
        return await serve(req)

    monkeypatch.setattr(engine, "generate", maybe)
    broken, bad = RuntimeError("connection reset"), PromptTooLong("too long", field="prompt")
    outcome += [broken, broken, None, broken, broken, bad, bad, bad, bad]
    for i in range(9):
        await actor._run(engine, _request(i))
    assert exits == [] and len(actor._failed) == 2
    assert len(actor._errors) == 8  # each failure is still reported
    await engine.close()


async def test_an_engine_that_answers_nothing_is_left_to_the_control_sides_polls(
    exits: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that went away fails its generations and its snapshots alike: the control
    side judges it by its failing polls (``coordinator.instance_error_limit``), the instance
    does not end itself over the generations."""
    actor, engine = await _actor()
    actor._error_limit = 2

    async def refused(*_: Any) -> Any:
        raise ConnectionError("connection refused")

    monkeypatch.setattr(engine, "generate", refused)
    monkeypatch.setattr(engine, "snapshot", refused)
    for i in range(4):
        await actor._run(engine, _request(i))
    assert exits == [] and len(actor._failed) == 4
    await engine.close()


async def test_an_engine_that_generates_for_others_is_not_ended(
    exits: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failures in a row of one prompt's samples (a bad prompt fails wherever it runs), or
    while other generations run on the engine, or with one returning during the check, do not
    end the instance."""
    actor, engine = await _actor()
    actor._error_limit = 3
    boom = EngineUnavailable("HTTP 500")
    for i in range(5):  # one prompt's samples
        await actor._count_failure(_request(i, "bad").trajectory_id, boom)
    assert exits == [] and actor._failed == {"bad"}
    long = GenerateRequest(trajectory_id="long/0", prompt_token_ids=(1, 2, 3),
                           sampling=SamplingParams(max_new_tokens=100_000))  # fmt: skip
    running = asyncio.create_task(engine.generate(long))
    await asyncio.sleep(0.05)
    for i in range(5):  # distinct prompts, while another generation runs
        await actor._count_failure(_request(i).trajectory_id, boom)
    assert exits == []
    await engine.interrupt(["long/0"])
    await running
    answer = engine.snapshot

    async def slow_snapshot() -> Any:
        actor._failed = set()  # a generation returned meanwhile
        return await answer()

    monkeypatch.setattr(engine, "snapshot", slow_snapshot)
    await actor._count_failure("g9/0", boom)
    assert exits == []
    monkeypatch.setattr(engine, "snapshot", answer)  # nothing runs, nothing returns: it ends
    actor._failed = {"g7", "g8"}
    with pytest.raises(Exited):
        await actor._count_failure("g9/0", boom)
    assert exits == [ENGINE_DEAD_EXIT]


async def test_ids_of_no_prompt_shape_are_each_their_own_prompt(
    exits: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    actor, _ = await _actor()
    actor._error_limit = 3
    for tid in ("plain-1", "plain-2"):
        await actor._count_failure(tid, RuntimeError("HTTP 500"))
    assert exits == []
    with pytest.raises(Exited):
        await actor._count_failure("plain-3", RuntimeError("HTTP 500"))
    assert exits == [ENGINE_DEAD_EXIT]


async def test_a_dying_instance_exits_even_if_its_output_cannot_be_flushed(
    exits: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    actor, _ = await _actor()

    class Broken:
        def write(self, text: str) -> int:
            return len(text)

        def flush(self) -> None:
            raise BrokenPipeError("stdout is gone")

    monkeypatch.setattr(engine_health.sys, "stdout", Broken())
    with pytest.raises(Exited):
        await actor._die(EngineDead("gone"))
    assert exits == [ENGINE_DEAD_EXIT]
