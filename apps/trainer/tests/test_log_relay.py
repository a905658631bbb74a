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
    before = structlog.get_config()
    log_relay.take()
    log_relay.relay_warnings()
    log_relay.relay_warnings()  # installs it once
    try:
        yield
    finally:
        log_relay.take()
        structlog.configure(**before)


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
    assert len(got) == log_relay.KEEP and got[0]["k"] == 5 and got[0]["dropped"] == 5
    log.warning("w", k=0)
    assert "dropped" not in log_relay.take()[0]


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
