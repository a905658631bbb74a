"""Pins both checkpoint formats byte for byte: a fixed sequence of calls must produce exactly
the JSON text recorded in tests/golden/ (key order included), and restoring that text must
reproduce it. Guards refactors of the shared ledger code against silent format drift."""

from __future__ import annotations

import json
from pathlib import Path

from staleness_protocol import (
    ProtocolConfig,
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
    p.consume()
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
    p.take_aborts()
    assert json.dumps(p.to_dict(), indent=1) + "\n" != (GOLDEN / "bounded.json").read_text()
    q = unbounded_scenario()
    q.take_replacements()
    assert json.dumps(q.to_dict(), indent=1) + "\n" != (GOLDEN / "unbounded.json").read_text()
