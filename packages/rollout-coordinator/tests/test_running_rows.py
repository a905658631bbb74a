"""A running list kept as columns (``RunningRows``) is the tuple of its entries to every reader,
and builds no entry for a reader that asks only the count or the ids. (The coordinator deciding
alike on rows and on tuples: ``test_equivalence.py``, whose fast coordinator reads rows.)"""

from __future__ import annotations

from typing import Any

import pytest

from rollout_coordinator import InstanceSnapshot, RunningEntry, RunningRows, SpeculativeState
from rollout_coordinator._records import running_ids

IDS = ("a", "b", "c")
PROMPTS = (10, 20, 30)
BASE = (0, 5, 7)
TAIL = (RunningEntry("h", 40, 2),)
# generated = base + offset (3); the tail after them, as it is
ENTRIES = (
    RunningEntry("a", 10, 3),
    RunningEntry("b", 20, 8),
    RunningEntry("c", 30, 10),
    RunningEntry("h", 40, 2),
)


class _Unread(tuple):  # type: ignore[type-arg]
    """A column that fails when its values are read (its length is free)."""

    def __iter__(self) -> Any:
        raise AssertionError("the column was read")


def test_rows_are_the_tuple_of_their_entries() -> None:
    rows = RunningRows(IDS, PROMPTS, BASE, 3, TAIL)
    assert rows.entries == ENTRIES
    assert tuple(rows) == ENTRIES and list(rows) == list(ENTRIES)
    assert len(rows) == 4 and rows[1] == ENTRIES[1] and rows[-1] == TAIL[0]
    assert rows[1:3] == ENTRIES[1:3]
    assert rows == ENTRIES and rows == RunningRows(IDS, PROMPTS, BASE, 3, TAIL)
    tuple_first = ENTRIES  # a tuple on the left defers to RunningRows.__eq__
    assert tuple_first.__eq__(rows) is NotImplemented
    assert tuple_first == rows
    assert rows != ENTRIES[:3] and rows != RunningRows(IDS, PROMPTS, BASE, 4, TAIL)
    assert rows != list(ENTRIES)  # a tuple's equality: not a list's
    assert hash(rows) == hash(ENTRIES)
    assert repr(rows) == f"RunningRows({ENTRIES!r})"
    assert RunningRows((), (), ()) == () and not RunningRows((), (), ())
    assert RunningRows(IDS, PROMPTS, BASE).entries[2] == RunningEntry("c", 30, 7)  # offset 0


def test_the_count_and_the_ids_read_no_token_column() -> None:
    rows = RunningRows(IDS, _Unread(PROMPTS), _Unread(BASE), 3, TAIL)
    assert len(rows) == 4 and rows
    assert list(rows.trajectory_ids) == ["a", "b", "c", "h"]
    assert list(running_ids(rows)) == ["a", "b", "c", "h"]
    assert list(running_ids(ENTRIES)) == ["a", "b", "c", "h"]
    with pytest.raises(AssertionError, match="read"):
        list(rows)


def _fields(running: Any) -> dict[str, Any]:
    return {
        "instance_id": "i0",
        "seq": 1,
        "time_s": 0.5,
        "version": 0,
        "running": running,
        "waiting": 0,
        "kv_used_tokens": 150,
        "kv_capacity_tokens": 1000,
        "throughput_tokens_per_s": 1.0,
    }


def test_a_snapshot_of_rows_equals_the_snapshot_of_their_tuple() -> None:
    rows = RunningRows(IDS, PROMPTS, BASE, 3, TAIL)
    unchecked = InstanceSnapshot.unchecked(**_fields(rows))
    assert unchecked.running is rows
    checked = InstanceSnapshot(**_fields(ENTRIES))
    assert unchecked == checked and hash(unchecked) == hash(checked)
    # built checked, rows become the tuple (and are checked as one)
    again = InstanceSnapshot(**_fields(rows))
    assert type(again.running) is tuple and again == checked


def test_an_instances_running_ids_are_those_of_its_entries() -> None:
    """``InstanceState.running_ids``: the ids ``running_entries`` lists (the snapshot's, less
    those interrupted since, then those routed since), in order, building no entry."""
    state = SpeculativeState()
    state.add_instance("i0", version=0, kv_capacity_tokens=1000)
    unread = RunningRows(IDS, _Unread(PROMPTS), _Unread(BASE), 3, TAIL)
    state.apply_snapshot(InstanceSnapshot.unchecked(**_fields(unread)), now=1.0, latest_version=0)
    assert state.route("i0", RunningEntry("n", 5, 0), now=2.0)
    st = state.get("i0")
    assert list(st.running_ids()) == ["a", "b", "c", "h", "n"]
    assert st.is_running("h") and st.is_running("n") and not st.is_running("z")
    rows = RunningRows(IDS, PROMPTS, BASE, 3, TAIL)
    state.apply_snapshot(
        InstanceSnapshot.unchecked(**{**_fields(rows), "seq": 2, "time_s": 2.5}),
        now=2.5,
        latest_version=0,
    )
    assert state.route("i0", RunningEntry("n", 5, 0), now=3.0)
    assert [e.trajectory_id for e in state.interrupt("i0", ["b", "n"], now=3.0)] == ["b", "n"]
    assert list(st.running_ids()) == [e.trajectory_id for e in st.running_entries()]
    assert list(st.running_ids()) == ["a", "c", "h"]
