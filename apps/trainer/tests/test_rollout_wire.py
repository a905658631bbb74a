"""What the rollout actor and the control shell exchange: outcomes grouped by prompt, poll
arguments and answers in their compact form, and each unpacking to what was packed. The
real-actor round trip (a sim engine, the trajectory server) runs in
``test_coordinator_crash_random.py`` and the Ray integration tests."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from staleflow_trainer.actors.rollout_wire import (
    pack_outcomes,
    poll_args,
    unpack_outcomes,
    unpack_poll,
)

_outcome = st.tuples(
    st.one_of(
        st.builds(lambda g, n: f"g{g:06d}/{n}", st.integers(0, 4), st.integers(0, 7)),
        st.sampled_from(["plain", "x/01"]),
    ),
    st.integers(0, 5000),
    st.sampled_from([None, "stop", "length"]),
)


@given(st.lists(_outcome, max_size=40))
def test_outcomes_unpack_to_the_same_outcomes(outcomes: list[tuple[str, int, str | None]]) -> None:
    got = unpack_outcomes(pack_outcomes(outcomes))
    assert sorted(got, key=repr) == sorted(outcomes, key=repr)
    # one prompt's outcomes stay in the order they came
    for prefix in {t.rpartition("/")[0] for t, _, _ in outcomes}:
        mine = [o for o in outcomes if o[0].rpartition("/")[0] == prefix and o[0] != "x/01"]
        assert [o for o in got if o in mine] == mine


def test_outcomes_of_one_prompt_are_much_smaller_than_one_list_each() -> None:
    outcomes = [(f"g000123/{i}", 4096 - i % 2, "stop") for i in range(8)]
    packed = pack_outcomes(outcomes)
    assert packed == [["g000123", *range(8)], [4096, 4095] * 4, "stop"]
    plain = [list(o) for o in outcomes]
    size = len(pickle.dumps(packed, protocol=5))
    assert size < len(pickle.dumps(plain, protocol=5)) / 2
    assert pack_outcomes([]) is None and unpack_outcomes(None) == []


def test_outcomes_that_do_not_line_up_are_refused() -> None:
    with pytest.raises(ValueError, match="do not line up"):
        unpack_outcomes([["g1", 0, 1], [5], "stop"])


def test_poll_arguments_and_answers() -> None:
    assert poll_args({}) == ()
    assert poll_args({"ack": 7}) == (7,)
    assert poll_args({"full": True}) == (None, True)
    assert unpack_poll(None) is None
    delta: dict[int, Any] = {0: 3}
    got = unpack_poll([delta, [["g1", 0, 1], [3, 4], [None, "stop"]], ["g2", 5]])
    assert got == {
        "snapshot": delta,
        "outcomes": [["g1/0", 3, None], ["g1/1", 4, "stop"]],
        "refused": ["g2/5"],
        "errors": [],
    }
    assert unpack_poll([None, None, None, [{"trajectory_id": "t", "error": "e"}]]) == {
        "snapshot": None,
        "outcomes": [],
        "refused": [],
        "errors": [{"trajectory_id": "t", "error": "e"}],
    }
