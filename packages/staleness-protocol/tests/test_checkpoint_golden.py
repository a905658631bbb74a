"""Pins both checkpoint formats byte for byte: a fixed sequence of calls must produce exactly
the JSON text recorded in tests/golden/ (key order included), and restoring that text must
reproduce it. Guards refactors of the shared ledger code against silent format drift.

The ``v1-*.json`` files were written by staleness-protocol 0.1 from the same scenarios (before
``publish`` existed); they must load, migrated, into the state the current code reaches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from staleness_protocol import (
    Abort,
    CorruptState,
    FinishStatus,
    GroupClosed,
    ProtocolConfig,
    ReplacementRequest,
    StalenessProtocol,
    UnboundedConfig,
    UnboundedFifo,
    protocol_from_dict,
)

GOLDEN = Path(__file__).parent / "golden"


def common_prefix(p: StalenessProtocol | UnboundedFifo) -> None:
    """Three groups of n' = 3 at version 0; a and b complete (their third member is aborted as
    group surplus) and are consumed; group 7 gets its first member at version 1."""
    for g in ("a", "b", "c"):
        for i in range(3):
            p.reserve(g, f"{g}{i}", 0)
    p.finish("a0")
    p.finish("a1")
    p.finish("b1")
    p.finish("b0")
    p.publish(p.consume().version + 1)
    p.reserve(7, 70, 1)


def bounded_scenario() -> StalenessProtocol:
    """Touches every field: buffers, every group/trajectory state, queued aborts and
    replacements, histograms, aborts_by_reason, consumed batches."""
    p = StalenessProtocol(
        ProtocolConfig(
            batch_size=2,
            group_size=2,
            eta=1,
            batch_redundancy=1,
            group_redundancy=1,
            filtering=True,
            stuck_threshold=1,
        )
    )
    common_prefix(p)
    p.reserve(7, 71, 1)
    p.reserve("d", "d0", 1)
    p.abort(71, "interrupted")
    p.drop_group("d", "all-equal")
    p.finish(70)
    return p


def unbounded_scenario() -> UnboundedFifo:
    p = UnboundedFifo(
        UnboundedConfig(
            batch_size=2, group_size=2, max_inflight_groups=3, group_redundancy=1, filtering=True
        )
    )
    common_prefix(p)
    p.reserve(7, 71, 0)
    p.reserve("d", "d0", 1)
    p.abort(71, "interrupted")
    p.drop_group("d", "all-equal")
    p.finish("c0")
    p.finish(70)
    p.reserve(7, 72, 1)
    p.finish(72)  # 7 complete: FIFO holds 7
    return p


def check(p: StalenessProtocol | UnboundedFifo, name: str) -> None:
    text = json.dumps(p.to_dict(), indent=1) + "\n"
    assert text == (GOLDEN / name).read_text()
    again = protocol_from_dict(json.loads(text))
    assert type(again) is type(p)
    assert json.dumps(again.to_dict(), indent=1) + "\n" == text


def test_bounded_checkpoint_is_byte_identical() -> None:
    check(bounded_scenario(), "bounded.json")


def test_unbounded_checkpoint_is_byte_identical() -> None:
    check(unbounded_scenario(), "unbounded.json")


def test_golden_differs_when_state_differs() -> None:
    p = bounded_scenario()
    p.take_notices()
    assert json.dumps(p.to_dict(), indent=1) + "\n" != (GOLDEN / "bounded.json").read_text()
    q = unbounded_scenario()
    q.take_notices()
    assert json.dumps(q.to_dict(), indent=1) + "\n" != (GOLDEN / "unbounded.json").read_text()


@pytest.mark.parametrize(
    ("name", "scenario"), [("bounded", bounded_scenario), ("unbounded", unbounded_scenario)]
)
def test_a_checkpoint_written_by_0_1_is_migrated(name: str, scenario: Any) -> None:
    """The 0.1 file of the same scenario restores to the current state, except what 0.1 did not
    know: the ended entries become tombstones stamped with its version, queued aborts and
    replacements one notice list, in that order."""
    old = json.loads((GOLDEN / f"v1-{name}.json").read_text())
    assert old["format"].endswith("/1")
    p = protocol_from_dict(old)
    now = scenario()
    assert p.to_dict()["format"] == now.to_dict()["format"]
    assert (p.next_buffer, p.published_version) == (1, 1)
    mine, theirs = p.to_dict(), now.to_dict()
    for key in ("groups", "trajectories", "staleness_histogram", "aborts_by_reason", "ended"):
        assert mine[key] == theirs[key], key
    assert p.stats().trajectories_by_state == now.stats().trajectories_by_state
    assert {r[1] for r in mine["tombstones"]} == {r[1] for r in theirs["tombstones"]}
    assert p.take_notices() == (
        Abort(
            trajectory_id="a2", group_id="a", version=0, reason="group_surplus", was_running=True
        ),
        Abort(
            trajectory_id="b2", group_id="b", version=0, reason="group_surplus", was_running=True
        ),
        Abort(trajectory_id="d0", group_id="d", version=1, reason="all-equal", was_running=True),
        ReplacementRequest(request_id=0, replaces_group_id="d", reason="all-equal"),
    )
    # the migrated ledger still answers for what ended: late results, late siblings
    assert p.finish("a2").status is FinishStatus.ALREADY_ENDED
    with pytest.raises(GroupClosed):
        p.reserve("a", "a9", 1)
    assert json.loads(json.dumps(p.to_dict())) == p.to_dict()


def test_an_unknown_or_broken_old_checkpoint_is_refused_by_name() -> None:
    old = json.loads((GOLDEN / "v1-bounded.json").read_text())
    del old["pending_aborts"]
    with pytest.raises(CorruptState, match="cannot migrate this staleness-protocol/1"):
        StalenessProtocol.from_dict(old)
    with pytest.raises(CorruptState, match="allowed 'staleness-protocol/2'"):
        StalenessProtocol.from_dict({"format": "staleness-protocol/0"})
