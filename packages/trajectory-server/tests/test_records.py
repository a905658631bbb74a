"""Ledger-history checks over trajectory events."""

from __future__ import annotations

from trajectory_server import routes_out_of_queue


def test_routes_out_of_queue_flags_a_route_that_did_not_follow_the_queue() -> None:
    ok = {
        "a": [["submitted", None, None, 1], ["routed", "i0", 0, 2], ["returned", "i0", 0, 3],
              ["routed", "i1", 0, 4], ["lost", "i1", 0, 5], ["routed", "i0", 0, 6],
              ["finished", "i0", 0, 7]],
    }  # fmt: skip
    assert routes_out_of_queue(ok) == []
    twice = {"b": [["submitted", None, None, 1], ["routed", "i0", 0, 2], ["routed", "i1", 0, 3]]}
    assert routes_out_of_queue(twice) == [f"b routed after routed: {twice['b']}"]
    never_queued = {"c": [["routed", "i0", 0, 1]]}
    assert routes_out_of_queue(never_queued) == [f"c routed after None: {never_queued['c']}"]
    after_finish = {"d": [["submitted", None, None, 1], ["routed", "i0", 0, 2],
                          ["finished", "i0", 0, 3], ["routed", "i0", 0, 4]]}  # fmt: skip
    assert len(routes_out_of_queue(after_finish)) == 1
