"""The control actor's warnings and errors reach the run's own output: ``log_relay`` keeps
them in the actor's process and the driver logs them again (``integration_tests/cpu/
test_faults_dead_or_hung_instance_sim.py`` checks the whole path on Ray)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog
from structlog.testing import capture_logs

from staleflow_trainer.actors import log_relay


@pytest.fixture
def relayed() -> Iterator[None]:
    """The relay installed (the workspace conftest restores structlog's configuration after
    the test) and nothing kept from before or left for after."""
    log_relay.take()
    log_relay.relay_warnings()
    log_relay.relay_warnings()  # installs it once
    try:
        yield
    finally:
        log_relay.take()


def test_warnings_and_errors_are_kept_and_handed_over_once(relayed: None) -> None:
    log = structlog.get_logger("t").bind(component="control")
    log.info("routine", n=1)
    log.warning("instance_answer_late", instance="a", waited_s=2.0, error=ValueError("x"))
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("instance_hung", instance="a")
    assert structlog.get_config()["processors"].count(log_relay._keep) == 1
    got = log_relay.take()
    assert [(g["level"], g["event"]) for g in got] == [
        ("warning", "instance_answer_late"),
        ("error", "instance_hung"),
    ]
    assert got[0]["component"] == "control" and got[0]["error"] == "ValueError('x')"
    assert "timestamp" not in got[0] and "exc_info" not in got[1]
    assert log_relay.take() == []


def test_lines_beyond_the_limit_are_counted(relayed: None) -> None:
    log = structlog.get_logger("t")
    for k in range(log_relay.KEEP + 5):
        log.warning("w", k=k)
    got = log_relay.take()
    assert got[0] == {"level": "warning", "event": "relayed_lines_dropped", "count": 5}
    assert len(got) == log_relay.KEEP + 1 and got[1]["k"] == 5
    log.warning("w", k=0)
    assert [g["event"] for g in log_relay.take()] == ["w"]


def test_a_process_about_to_end_waits_for_its_lines_to_be_taken(
    relayed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``handed_over``: a dying rollout instance waits (bounded) for the driver to take the
    line that says why it ends; where nobody ever took lines (no relay), it does not wait."""
    import asyncio
    import time

    log = structlog.get_logger("t")

    async def take_later(after_s: float) -> None:
        await asyncio.sleep(after_s)
        log_relay.take()

    async def scenario() -> tuple[bool, float, bool, float]:
        log.error("engine_dead", error="gone")
        t0 = time.monotonic()
        taker = asyncio.create_task(take_later(0.3))
        taken = await log_relay.handed_over(10.0)
        waited = time.monotonic() - t0
        await taker
        log.error("engine_dead", error="again")  # nobody takes it this time
        t0 = time.monotonic()
        left = await log_relay.handed_over(0.4)
        return taken, waited, left, time.monotonic() - t0

    taken, waited, left, bounded = asyncio.run(scenario())
    assert taken and 0.25 <= waited < 5.0  # until the lines were taken, not the limit
    assert not left and 0.35 <= bounded < 5.0  # the limit, then it goes on
    log_relay.take()
    monkeypatch.setattr(log_relay, "_asked", [False])  # a process whose lines nobody takes
    log.error("engine_dead", error="unrelayed")
    t0 = time.monotonic()
    assert asyncio.run(log_relay.handed_over(10.0)) is False
    assert time.monotonic() - t0 < 1.0


def test_replay_logs_each_line_at_its_level_but_the_skipped() -> None:
    lines = [
        {"level": "warning", "event": "instance_answer_late", "instance": "a"},
        {"level": "warning", "event": "instance_lost", "instance": "a"},
        {"level": "error", "event": "instance_hung", "instance": "a"},
    ]
    with capture_logs() as logs:
        log_relay.replay(lines, structlog.get_logger("d"), skip=frozenset({"instance_lost"}))
    assert [(e["log_level"], e["event"], e["instance"], e["relayed_from"]) for e in logs] == [
        ("warning", "instance_answer_late", "a", "control"),
        ("error", "instance_hung", "a", "control"),
    ]


def test_a_line_the_driver_cannot_log_as_is_renamed_or_replaced() -> None:
    lines = [
        {"level": "warning", "event": "w", "self": 1, "method_name": 2, "relayed_from": 3, 7: 4},
        {"level": "error", "event": "e", "bad": object()},
    ]

    class Picky:
        def warning(self, event: str, **kw: object) -> None:
            seen.append((event, kw))

        def error(self, event: str, **kw: object) -> None:
            raise ValueError("cannot log this")

    seen: list[tuple[str, dict[str, object]]] = []
    log_relay.replay(lines, Picky())
    assert seen[0] == ("w", {"relayed_from": "control", "control_self": 1,
                             "control_method_name": 2, "control_relayed_from": 3, "7": 4})  # fmt: skip
    assert seen[1][0] == "relayed_line_unreadable" and "cannot log this" in str(seen[1][1])
