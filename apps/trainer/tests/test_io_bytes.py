"""The control process's byte counts: per peer kind and call, and the parts of a poll answer."""

from __future__ import annotations

from staleflow_trainer.actors.io_bytes import ByteCounts, size
from staleflow_trainer.actors.rollout_wire import pack_outcomes, poll_parts


def test_a_poll_answer_is_counted_whole_and_by_its_parts() -> None:
    counts = ByteCounts()
    delta = {0: 7, 9: [[4, -3, "g1", 0, 1]]}
    outcomes = pack_outcomes([("g1/0", 16, "stop"), ("g1/1", 16, "stop")])
    answer = [delta, outcomes]
    counts.poll_answer(answer, watch=False)
    counts.poll_answer(None, watch=True)  # nothing happened: no parts
    stats = counts.stats(None)
    assert stats["by_call"] == {"instances.poll_answer": size(answer) + size(None)}
    assert stats["instances"] == size(answer) + size(None) and stats["watch"] == size(None)
    assert stats["parts"] == {
        "instances.poll_answer.snapshot": size(delta),
        "instances.poll_answer.outcomes": size(outcomes),
    }
    assert poll_parts([None, None, ["x"]]) == {"snapshot": None, "outcomes": None,
                                                "refused": ["x"]}  # fmt: skip
