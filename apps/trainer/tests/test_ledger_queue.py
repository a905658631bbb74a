"""The ledger's queue view: service order, a limited view, and a saved state read back."""

from __future__ import annotations

import json

import pytest

from staleflow_trainer.control.ledger import Ledger, LedgerError


def _ledger() -> Ledger:
    led = Ledger()
    led.add_group("a", 0, 2, 10)
    led.add_group("b", 1, 2, 20)
    led.add_group("c", 2, 2, 30)
    # a/0 ran at version 3 and came back with 5 tokens: a partial, served first
    led.run("a/0", "i0", 3)
    led.requeue("a/0", 5)
    led.promote("c")  # c's members come before b's
    return led


def _order(led: Ledger, limit: int | None = None) -> list[tuple[str, int | None, int]]:
    return [(q.trajectory_id, q.v_traj, q.generated_len) for q in led.queue_items(limit)]


def test_the_queue_serves_partials_then_promoted_then_fresh_groups() -> None:
    led = _ledger()
    assert _order(led) == [
        ("a/0", 3, 5),
        ("c/0", None, 0),
        ("c/1", None, 0),
        ("a/1", None, 0),
        ("b/0", None, 0),
        ("b/1", None, 0),
    ]
    assert _order(led, 3) == _order(led)[:3]
    assert _order(led, 1) == _order(led)[:1]
    led.run("c/0", "i1", 4)  # routed: it leaves the queue, and the view follows
    assert [t for t, _, _ in _order(led)] == ["a/0", "c/1", "a/1", "b/0", "b/1"]


def test_a_saved_ledger_reads_back_with_the_same_queue() -> None:
    led = _ledger()
    back = Ledger.from_dict(json.loads(json.dumps(led.to_dict())))
    assert _order(back) == _order(led)
    back.run("b/0", "i0", 4)
    led.run("b/0", "i0", 4)
    assert _order(back) == _order(led)


def test_a_saved_queue_naming_a_trajectory_that_is_not_queued_is_refused() -> None:
    d = json.loads(json.dumps(_ledger().to_dict()))
    d["new"].append("a/0")  # a partial, listed again as never routed
    d["entries"] = [e if e[0] != "a/0" else [*e[:5], "running", "i0", None] for e in d["entries"]]
    with pytest.raises(LedgerError, match="a/0"):
        Ledger.from_dict(d)
