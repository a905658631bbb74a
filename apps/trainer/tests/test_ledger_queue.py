"""The ledger's queue view: service order, a limited view, and a saved state read back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollout_coordinator import CoordinatorConfig
from staleflow_trainer.control.config import CoreConfig
from staleflow_trainer.control.ledger import Ledger, LedgerError
from staleness_protocol import ProtocolConfig


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
    items = led.queue_items(limit)
    for q in items:  # each record is its entry's own, current one
        assert q is led.entries[q.trajectory_id].item
    return [(q.trajectory_id, q.v_traj, q.generated_len) for q in items]


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
    led.promote("b")  # promoted after the view was built: the view follows
    assert [t for t, _, _ in _order(led)] == ["a/0", "c/1", "b/0", "b/1", "a/1"]


def test_a_saved_ledger_reads_back_with_the_same_queue() -> None:
    led = _ledger()
    back = Ledger.from_dict(json.loads(json.dumps(led.to_dict())))
    assert _order(back) == _order(led)
    back.run("b/0", "i0", 4)
    led.run("b/0", "i0", 4)
    assert _order(back) == _order(led)


def _saved_with_new(tid: str) -> dict[str, Any]:
    led = _ledger()
    led.run("b/0", "i0", 4)
    d: dict[str, Any] = json.loads(json.dumps(led.to_dict()))
    d["new"].append(tid)
    return d


@pytest.mark.parametrize(
    ("tid", "what"),
    [
        ("b/0", "not queued"),  # running on i0
        ("a/0", "admitted at version 3"),  # a partial, queued by its key
        ("z/0", "not in the entries"),
    ],
)
def test_a_saved_queue_listing_as_never_routed_what_is_not_is_refused(tid: str, what: str) -> None:
    with pytest.raises(LedgerError, match=f"{tid!r} as never routed, but it is {what}"):
        Ledger.from_dict(_saved_with_new(tid))


@pytest.mark.parametrize("limit", [0, -1, 2.5, True])
def test_a_queue_view_limit_below_one_trajectory_is_refused(limit: object) -> None:
    with pytest.raises(ValueError, match="queue_view_limit must be an integer >= 1"):
        CoreConfig(
            protocol=ProtocolConfig(batch_size=2, group_size=2, eta=1),
            coordinator=CoordinatorConfig(),
            steps=1,
            queue_view_limit=limit,
        )
