"""A queued trajectory (the trajectory server's queue record) refuses what no queue holds."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_coordinator import InvalidSnapshot, QueuedTrajectory, QueueView
from rollout_coordinator.testing import new, partial

GOOD = {"trajectory_id": "g/0", "group_id": "g", "v_traj": None, "prompt_len": 5}


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("trajectory_id", "", "a non-empty string"),
        ("trajectory_id", 7, "a non-empty string"),
        ("group_id", "", "a non-empty string"),
        ("group_id", None, "a non-empty string"),
        ("v_traj", -1, "None or an int >= 0"),
        ("v_traj", 1.0, "None or an int >= 0"),
        ("prompt_len", -1, "an int >= 0"),
        ("prompt_len", 2.5, "an int >= 0"),
        ("prompt_len", "5", "an int >= 0"),
        ("prompt_len", True, "an int >= 0"),
        ("prompt_len", np.int64(5), "an int >= 0"),
        ("generated_len", -3, "an int >= 0"),
        ("generated_len", None, "an int >= 0"),
    ],
)
def test_a_bad_field_is_refused_by_name(field: str, value: object, allowed: str) -> None:
    with pytest.raises(InvalidSnapshot) as ei:
        QueuedTrajectory(**{**GOOD, field: value})
    assert ei.value.field == f"queue.{field}"
    assert f"{field} must be {allowed}, got {value!r} ({type(value).__name__})" in str(ei.value)
    assert ei.value.instance_id == "<trajectory-server>"


def test_the_first_bad_field_is_named() -> None:
    with pytest.raises(InvalidSnapshot) as ei:
        QueuedTrajectory(**{**GOOD, "v_traj": -1, "generated_len": -1})
    assert ei.value.field == "queue.v_traj"


@pytest.mark.parametrize(
    "fields",
    [
        GOOD,
        {**GOOD, "prompt_len": 0},
        {**GOOD, "v_traj": 0, "generated_len": 0},
        {**GOOD, "v_traj": 3, "generated_len": 20_000},
    ],
)
def test_every_record_a_queue_holds_is_accepted(fields: dict[str, object]) -> None:
    item = QueuedTrajectory(**fields)  # type: ignore[arg-type]
    assert item.tokens == item.prompt_len + item.generated_len


def test_group_run_end_is_the_end_of_each_items_run_of_its_group() -> None:
    items = [
        partial("p1", 1, group="g0"),
        new("a1", group="g0"),
        new("a2", group="g0"),
        new("b1", group="g1"),
        new("c1", group="g2"),
        new("c2", group="g2"),
        new("c3", group="g2"),
    ]
    view = QueueView(items)
    assert [view.group_run_end(i) for i in range(len(items))] == [3, 3, 3, 4, 7, 7, 7]
