"""The ids and answers between the control shell, the reward workers and the trainer."""

from __future__ import annotations

import math
import pickle

import pytest

from engine_adapters import pack_ids, unpack_ids
from staleflow_trainer.actors.work_wire import (
    batch_members,
    compact,
    pack_scores,
    score_rows,
    train_batch,
)


def test_scores_come_back_by_position_with_the_reasons_of_the_missing() -> None:
    ids = ["g1/0", "g2/0", "x", "g1/1", "g2/3"]
    packed = pack_ids(ids)
    order = unpack_ids(packed)  # the order a worker scores them in: by prompt
    assert order == ["g1/0", "g1/1", "g2/0", "g2/3", "x"] != ids
    score = {"g1/0": 1.0, "g1/1": None, "g2/0": 0.25, "g2/3": None, "x": 0.0}
    reason = {"g1/1": "timed out", "x": "wrong"}
    answer = pack_scores([(score[t], reason.get(t)) for t in order])
    rows = {t: (s, r) for t, s, r in score_rows(packed, answer)}
    assert rows == {
        "g1/0": (1.0, None),
        "g1/1": (None, "timed out"),
        "g2/0": (0.25, None),
        "g2/3": (None, "no reason given"),
        "x": (0.0, None),  # a reason beside a score is not kept
    }


def test_an_answer_that_does_not_line_up_is_refused() -> None:
    with pytest.raises(ValueError, match="2 scores for 3 ids"):
        score_rows(pack_ids(["g/0", "g/1", "g/2"]), pack_scores([(1.0, None)] * 2))


def test_a_batch_keeps_each_members_staleness_and_reward() -> None:
    members = [["g7/2", "g7/0", "g7/5"], ["a/1", "odd-id", "a/3"]]
    staleness = [[1, 0, 2], [3, 1, 0]]
    rewards = [[0.5, 1.0, 0.0], [0.25, 0.75, 1.0]]
    batch = train_batch(4, ["g7", "a"], members, staleness, rewards)
    got = {
        t: (s, r)
        for ids, ss, rr in zip(
            batch_members(batch), batch["staleness"], batch["rewards"], strict=True
        )
        for t, s, r in zip(ids, ss, rr, strict=True)
    }
    want = {
        t: (s, r)
        for ids, ss, rr in zip(members, staleness, rewards, strict=True)
        for t, s, r in zip(ids, ss, rr, strict=True)
    }
    assert got == want and batch["version"] == 4 and batch["group_ids"] == ["g7", "a"]
    assert [sorted(m) for m in batch_members(batch)] == [sorted(m) for m in members]


def test_a_batch_with_a_repeated_member_is_refused() -> None:
    with pytest.raises(ValueError, match="repeats"):
        train_batch(1, ["g"], [["g/0", "g/0"]], [[0, 0]], [[1.0, 0.0]])


def test_packed_ids_cost_less_than_the_ids() -> None:
    members = [[f"g{g}/{i}" for i in range(16)] for g in range(100, 164)]
    batch = train_batch(1, [f"g{g}" for g in range(100, 164)], members,
                        [[1] * 16] * 64, [[0.5] * 16] * 64)  # fmt: skip
    plain = {"members": members}
    assert len(pickle.dumps(batch["members"])) < 0.4 * len(pickle.dumps(plain["members"]))


@pytest.mark.parametrize(
    ("x", "sent"),
    [(1.0, 1), (0.0, 0), (-3.0, -3), (0.25, 0.25), (-0.0, -0.0), (2.0**31, 2.0**31),
     (1e300, 1e300), (float("inf"), float("inf")), (True, 1), (2, 2)],
)  # fmt: skip
def test_integral_scores_and_rewards_travel_as_ints(x: float, sent: float) -> None:
    got = compact(x)
    assert got == sent and type(got) is type(sent)
    back = float(got)
    assert back == float(x) and math.copysign(1.0, back) == math.copysign(1.0, float(x))


def test_integral_scores_cost_a_few_bytes_and_arrive_as_floats() -> None:
    ids = [f"g{g}/{i}" for g in range(8) for i in range(8)]
    packed = pack_ids(ids)
    scores = [(float(i % 2), None) for i in range(64)]
    answer = pack_scores(scores)
    assert len(pickle.dumps(answer)) < 64 * 3  # not 9 bytes a float
    rows = score_rows(packed, answer)
    assert [r[1] for r in rows] == [s for s, _ in scores]
    assert all(type(r[1]) is float for r in rows)
    nan = score_rows(pack_ids(["g/0"]), pack_scores([(float("nan"), None)]))[0][1]
    assert math.isnan(nan)
    batch = train_batch(1, ["g"], [["g/0", "g/1"]], [[0, 1]], [[1.0, 0.5]])
    assert batch["rewards"] == [[1, 0.5]] and type(batch["rewards"][0][0]) is int
