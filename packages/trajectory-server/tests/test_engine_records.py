"""The sampling settings and finish reasons are engine-adapters' records: the store exports the
very same classes, reports a peer's bad sampling field as ``InvalidRecord`` naming it, and
never finishes a trajectory as interrupted."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest

import engine_adapters
import trajectory_server
from trajectory_server import (
    Completion,
    FinishedTrajectory,
    FinishReason,
    SamplingParams,
    Trajectory,
    TrajectoryStore,
)
from trajectory_server import wire as w
from trajectory_server._plain import sampling_to_plain
from trajectory_server.errors import CheckpointCorrupt, InvalidRecord, MalformedMessage
from trajectory_server.service import Dispatcher

GOOD = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 9, "stop_token_ids": [2], "seed": 3}
#: wire-decodable values (right types) that the sampling record refuses, with the field named
BAD_VALUES = [
    ("temperature", -0.5),
    ("temperature", math.inf),
    ("temperature", math.nan),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", math.nan),
    ("max_new_tokens", 0),
]


def test_the_store_exports_the_engines_records() -> None:
    assert trajectory_server.SamplingParams is engine_adapters.SamplingParams
    assert trajectory_server.FinishReason is engine_adapters.FinishReason


def _submit_group_frame(sampling: dict[str, Any]) -> bytes:
    body = {"group_id": "g", "n": 2, "prompt_token_ids": b"\x01\x00\x00\x00",
            "sampling": sampling, "metadata": {}}  # fmt: skip
    env = {"schema": w.SCHEMA_VERSION, "type": "submit_group", "id": 7, "body": body}
    return msgpack.packb(env, use_bin_type=True)


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_a_bad_sampling_field_over_the_wire_is_an_invalid_record(field: str, value: Any) -> None:
    frame = _submit_group_frame({**GOOD, field: value})
    with pytest.raises(InvalidRecord) as err:
        w.decode_request(frame)
    assert err.value.field == field
    assert field in err.value.message


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_the_service_answers_a_bad_sampling_field_with_invalid_record(
    field: str, value: Any
) -> None:
    """The service's answer, as a client raises it again: ``InvalidRecord`` naming the field
    (not an internal error), and the store unchanged."""
    store = TrajectoryStore()
    before = store.to_dict()
    frame = _submit_group_frame({**GOOD, field: value})
    answer = w.decode_response(Dispatcher(store).handle_frame(frame))
    assert not answer.ok
    assert type(answer.body) is InvalidRecord
    assert answer.body.field == field
    assert store.to_dict() == before


def test_a_good_sampling_field_over_the_wire_decodes_to_the_engines_record() -> None:
    frame = _submit_group_frame(GOOD)
    req = w.decode_request(frame).request
    assert type(req.sampling) is engine_adapters.SamplingParams
    assert req.sampling == SamplingParams(
        temperature=0.7, top_p=0.9, max_new_tokens=9, stop_token_ids=(2,), seed=3
    )


def test_the_sampling_record_travels_as_the_same_plain_dict() -> None:
    s = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=9, stop_token_ids=(2,), seed=3)
    assert sampling_to_plain(s) == GOOD
    assert sampling_to_plain(SamplingParams()) == {
        "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 256, "stop_token_ids": [],
        "seed": None,
    }  # fmt: skip


def test_a_bad_sampling_field_in_a_checkpoint_is_named() -> None:
    store = TrajectoryStore()
    store.submit_group("g", [1, 2], 1, sampling=SamplingParams(max_new_tokens=4))
    state = store.to_dict()
    state["payloads"][0]["sampling"]["top_p"] = 0.0
    with pytest.raises(CheckpointCorrupt) as err:
        TrajectoryStore.from_dict(state)
    assert err.value.field == "top_p"


def _completion(reason: Any) -> Completion:
    return Completion(
        trajectory_id="g/0", start=0, token_ids=[4], logprobs=[-0.5], versions=[0],
        finish_reason=reason,
    )  # fmt: skip


@pytest.mark.parametrize("reason", [FinishReason.INTERRUPTED, "interrupted", "abort", None])
def test_a_completion_is_never_interrupted(reason: Any) -> None:
    with pytest.raises(InvalidRecord) as err:
        _completion(reason)
    assert err.value.field == "finish_reason"
    assert "'stop' or 'length'" in err.value.message


def test_a_finished_trajectory_is_never_interrupted() -> None:
    t = Trajectory(trajectory_id="g/0", group_id="g", prompt_token_ids=[1])
    with pytest.raises(InvalidRecord) as err:
        FinishedTrajectory(trajectory=t, finish_reason=FinishReason.INTERRUPTED, instance_id="i")
    assert err.value.field == "finish_reason"
    assert "'stop' or 'length'" in err.value.message
    done = FinishedTrajectory(trajectory=t, finish_reason="stop", instance_id="i")
    assert done.finish_reason is FinishReason.STOP


@pytest.mark.parametrize("reason", ["stop", "length", FinishReason.STOP, FinishReason.LENGTH])
def test_a_completion_finishes_with_stop_or_length(reason: Any) -> None:
    assert _completion(reason).finish_reason is FinishReason(reason)


def test_an_interrupted_finish_over_the_wire_is_refused() -> None:
    seg = {"trajectory_id": "a", "start": 0, "token_ids": b"", "logprobs": b"", "versions": b"",
           "finish_reason": "interrupted"}  # fmt: skip
    env = {"schema": w.SCHEMA_VERSION, "type": "finish", "id": 3,
           "body": {"instance_id": "i", "completions": [seg]}}  # fmt: skip
    with pytest.raises(MalformedMessage) as err:
        w.decode_request(msgpack.packb(env, use_bin_type=True))
    assert err.value.field == "finish.completions[0].finish_reason"
    assert "'stop' or 'length'" in err.value.message


def test_a_checkpoint_that_finished_a_trajectory_as_interrupted_is_refused() -> None:
    store = TrajectoryStore()
    store.submit_group("g", [1, 2], 1, sampling=SamplingParams(max_new_tokens=4))
    store.route("i", ["g/0"], 0)
    store.finish("i", [_completion("stop")])
    state = store.to_dict()
    assert state["finished"][0][1] == "stop"  # the reason travels as its string value
    state["finished"][0][1] = "interrupted"
    with pytest.raises(CheckpointCorrupt) as err:
        TrajectoryStore.from_dict(state)
    assert err.value.field == "finish_reason"
