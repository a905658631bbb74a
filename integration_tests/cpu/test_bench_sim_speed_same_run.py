"""``benchmarks/bench_sim_speed.py`` calls two runs the same when every field both sides write
is equal: a field only one side writes (a step-record key a newer tree added) is listed, not
a difference; a value that differs in a shared field, the timeline or the summary is."""

from __future__ import annotations

import copy
from typing import Any

import bench_sim_speed


def _result() -> dict[str, Any]:
    return {
        "steps": [{"step": 1, "tokens": 100}, {"step": 2, "tokens": 120}],
        "timeline": [{"instance": "sim-0", "state": "busy", "start_s": 0.0, "end_s": 1.0}],
        "summary": {"steps_done": 2, "tokens_per_s": 110.0},
    }


def test_a_field_only_the_newer_side_writes_is_listed_not_a_difference() -> None:
    before, after = _result(), _result()
    for rec in after["steps"]:
        rec["response_lengths"] = [[3, 4]]
    after["summary"]["new_counter"] = 7
    equal, only = bench_sim_speed.same_run(before, after)
    assert equal
    assert only == {"before": [], "after": ["steps.response_lengths", "summary.new_counter"]}


def test_a_shared_field_the_timeline_or_the_summary_that_differs_is_a_difference() -> None:
    for where in ("steps", "timeline", "summary"):
        before, after = _result(), copy.deepcopy(_result())
        if where == "steps":
            after["steps"][1]["tokens"] = 121
        elif where == "timeline":
            after["timeline"][0]["end_s"] = 1.5
        else:
            after["summary"]["tokens_per_s"] = 111.0
        equal, _ = bench_sim_speed.same_run(before, after)
        assert not equal, where


def test_a_missing_step_is_a_difference() -> None:
    before, after = _result(), _result()
    after["steps"].pop()
    assert not bench_sim_speed.same_run(before, after)[0]
