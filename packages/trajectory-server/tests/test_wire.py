"""Wire format: every request round-trips; bad frames are rejected naming the field."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from trajectory_server import (
    ALL_LEVELS,
    Completion,
    GroupByKey,
    IntArray,
    SamplingParams,
    Segment,
    Trajectory,
    TrajectoryStore,
)
from trajectory_server import wire as w
from trajectory_server.errors import (
    InvalidRecord,
    MalformedMessage,
    MessageTooLarge,
    SchemaMismatch,
    UnknownMessageType,
    WrongOwner,
)

TRAJ = Trajectory(
    trajectory_id="g/0",
    group_id="g",
    prompt_token_ids=[1, 2, 3],
    sampling=SamplingParams(
        temperature=0.7, top_p=0.9, max_new_tokens=9, stop_token_ids=[2], seed=3
    ),
    metadata={"ground_truth": "x", "n": [1, {"a": None}]},
    target_length=5,
)
SEG = Segment(trajectory_id="g/0", start=2, token_ids=[4], logprobs=[-0.125], versions=[6])
DONE = Completion(
    trajectory_id="g/0",
    start=0,
    token_ids=[4],
    logprobs=[-1e-9],
    versions=[1],
    finish_reason="length",
)

REQUESTS = [
    w.Submit(trajectories=(TRAJ,)),
    w.SubmitGroup(
        group_id="h",
        prompt_token_ids=IntArray([5, 6]),
        n=4,
        sampling=SamplingParams(),
        metadata={"k": 1.5},
        target_lengths=(1, 2, 3, 4),
    ),
    w.SubmitGroup(
        group_id="h", prompt_token_ids=IntArray([5]), n=1, sampling=SamplingParams(), metadata={}
    ),
    w.SubmitGroup(
        group_id="h",
        prompt_token_ids=None,
        n=2,
        sampling=SamplingParams(),
        metadata={},
        prompt_key=7,
    ),
    w.SubmitGroup(
        group_id="h",
        prompt_token_ids=IntArray([5]),
        n=2,
        sampling=SamplingParams(),
        metadata={},
        echo=False,
    ),
    w.SubmitGroups(
        groups=(
            GroupByKey(group_id="a", n=2, prompt_key=7, seed=9),
            GroupByKey(group_id="b", n=1, prompt_key=0),
        ),
        sampling=SamplingParams(max_new_tokens=5),
    ),
    w.SubmitGroups(groups=(), sampling=SamplingParams(), skip_existing=True),
    w.PutPrompts(
        keys=(0, 7),
        prompt_token_ids=(IntArray([1, 2]), IntArray([3])),
        metadata=({"gt": "4"}, None),
    ),
    w.Route(instance_id="i0", trajectory_ids=("a", "b"), version=3),
    w.ReturnPartial(instance_id="i0", segments=(SEG,)),
    w.Finish(instance_id="i0", completions=(DONE,)),
    w.Finish(instance_id="i0", completions=(DONE,), echo=False),
    w.Drop(trajectory_ids=("a",), reason="filtered"),
    w.DropGroup(group_id="g", reason="filtered"),
    w.InstanceLost(instance_id="i3"),
    w.Release(trajectory_ids=("a",)),
    w.Free(trajectory_ids=("a", "b")),
    w.GetFinished(trajectory_ids=None),
    w.FinishedIds(),
    w.GetFinished(trajectory_ids=("a",)),
    w.QueueView(limit=None, level=ALL_LEVELS),
    w.QueueView(limit=3, level=None),
    w.QueueView(limit=0, level=7),
    w.Stats(),
    w.Locate(trajectory_ids=("a",)),
    w.Get(trajectory_ids=("a",)),
    w.History(trajectory_id="a"),
    w.HeldBy(instance_id="i0"),
    w.Group(group_id="g"),
    w.SaveCheckpoint(),
    w.Ping(),
]


@pytest.mark.parametrize("req", REQUESTS, ids=lambda r: type(r).__name__)
def test_every_request_round_trips(req: Any) -> None:
    frame = w.decode_request(w.encode_request(req, 17, "tok"))
    assert (frame.request_id, frame.token) == (17, "tok")
    assert frame.request == req


def test_every_request_type_is_covered() -> None:
    assert {type(r) for r in REQUESTS} == set(w.REQUEST_TYPES.values())


def test_token_arrays_travel_as_packed_bytes() -> None:
    seg = Segment(
        trajectory_id="t",
        start=0,
        token_ids=range(8000),
        logprobs=[0.5] * 8000,
        versions=[1] * 8000,
    )
    data = w.encode_request(w.ReturnPartial(instance_id="i", segments=(seg,)), 1)
    assert len(data) < 8000 * (4 + 8 + 4) + 300  # packed, not msgpack ints/floats
    body = msgpack.unpackb(data)["body"]["segments"][0]
    assert isinstance(body["token_ids"], bytes)


def test_results_round_trip_through_a_real_store() -> None:
    store = TrajectoryStore()
    store.submit([TRAJ])
    from trajectory_server.service import Dispatcher

    d = Dispatcher(store)
    route = w.Route(instance_id="i0", trajectory_ids=("g/0",), version=6)
    result = d.execute(route)
    assert (
        w.decode_result(route, msgpack.unpackb(msgpack.packb(w.encode_result(route, result))))
        == result
    )
    stats = w.Stats()
    assert w.decode_result(stats, w.encode_result(stats, d.execute(stats))) == store.stats()


@pytest.mark.parametrize(
    "req", [w.Free(trajectory_ids=("a",)), w.Finish(instance_id="i", completions=(), echo=False)]
)
def test_count_answers_refuse_anything_else(req: Any) -> None:
    """``free`` and ``finish`` with ``echo=False`` answer a count."""
    assert w.decode_result(req, w.encode_result(req, 3)) == 3
    for bad in (None, -1, True, "3", [1]):
        with pytest.raises(MalformedMessage) as ei:
            w.decode_result(req, bad)
        assert ei.value.field == f"{req.TYPE}.result"


def test_finish_echo_must_be_a_bool() -> None:
    body = msgpack.unpackb(w.encode_request(w.Finish(instance_id="i", completions=()), 1))
    assert "echo" not in body["body"]  # the default is not sent: older servers read it
    body["body"]["echo"] = 1
    with pytest.raises(MalformedMessage) as ei:
        w.decode_request(msgpack.packb(body, use_bin_type=True))
    assert ei.value.field == "finish.echo"


def _frame(**overrides: Any) -> bytes:
    env: dict[str, Any] = {
        "schema": w.SCHEMA_VERSION,
        "type": "route",
        "id": 5,
        "token": None,
        "body": {"instance_id": "i0", "trajectory_ids": ["a"], "version": 1},
    }
    env.update(overrides)
    return msgpack.packb(env, use_bin_type=True)


def test_wrong_schema_version_rejected() -> None:
    with pytest.raises(SchemaMismatch) as err:
        w.decode_request(_frame(schema=w.SCHEMA_VERSION + 1))
    assert (err.value.got, err.value.expected) == (w.SCHEMA_VERSION + 1, w.SCHEMA_VERSION)
    with pytest.raises(SchemaMismatch):
        w.decode_request(_frame(schema="1"))


def test_unknown_type_rejected() -> None:
    with pytest.raises(UnknownMessageType) as err:
        w.decode_request(_frame(type="reboot"))
    assert err.value.message_type == "reboot"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"instance_id": 3, "trajectory_ids": ["a"], "version": 1}, "route.instance_id"),
        ({"instance_id": "i", "trajectory_ids": "a", "version": 1}, "route.trajectory_ids"),
        ({"instance_id": "i", "trajectory_ids": ["a", 2], "version": 1}, "route.trajectory_ids[1]"),
        ({"instance_id": "i", "trajectory_ids": ["a"], "version": True}, "route.version"),
        ({"instance_id": "i", "trajectory_ids": ["a"], "version": 1.0}, "route.version"),
        ({"instance_id": "i", "trajectory_ids": ["a"]}, "route.version"),
        ({"instance_id": "i", "trajectory_ids": ["a"], "version": 1, "x": 1}, "route.x"),
    ],
)
def test_bad_field_types_are_named(body: dict[str, Any], field: str) -> None:
    with pytest.raises(MalformedMessage) as err:
        w.decode_request(_frame(body=body))
    assert err.value.field == field


def test_bad_nested_fields_are_named() -> None:
    seg = {
        "trajectory_id": "a",
        "start": 0,
        "token_ids": b"\x00" * 5,
        "logprobs": b"",
        "versions": b"",
    }
    with pytest.raises(MalformedMessage) as err:
        w.decode_request(
            _frame(type="return_partial", body={"instance_id": "i", "segments": [seg]})
        )
    assert err.value.field == "return_partial.segments[0].token_ids"
    seg = {
        "trajectory_id": "a",
        "start": 0,
        "token_ids": b"\x00" * 4,
        "logprobs": b"",
        "versions": b"",
    }
    with pytest.raises(InvalidRecord) as err2:  # decodes, but the record is inconsistent
        w.decode_request(
            _frame(type="return_partial", body={"instance_id": "i", "segments": [seg]})
        )
    assert err2.value.field == "logprobs"
    done = dict(seg, token_ids=b"", finish_reason="abort")
    with pytest.raises(MalformedMessage) as err3:
        w.decode_request(_frame(type="finish", body={"instance_id": "i", "completions": [done]}))
    assert err3.value.field == "finish.completions[0].finish_reason"


def test_not_msgpack_and_not_a_map_rejected() -> None:
    with pytest.raises(MalformedMessage) as err:
        w.decode_request(b"\xc1garbage")
    assert err.value.field == "frame"
    with pytest.raises(MalformedMessage) as err2:
        w.decode_request(msgpack.packb([1, 2, 3]))
    assert err2.value.field == "envelope"
    with pytest.raises(MalformedMessage):
        w.decode_request(msgpack.packb({1: 2}, use_bin_type=True))


def test_oversized_rejected_before_decoding() -> None:
    data = _frame(body={"instance_id": "i" * 5000, "trajectory_ids": [], "version": 1})
    with pytest.raises(MessageTooLarge) as err:
        w.decode_request(data, max_bytes=1024)
    assert (err.value.size, err.value.limit) == (len(data), 1024)


def test_error_responses_rebuild_the_same_class() -> None:
    exc = WrongOwner("nope", trajectory_id="a", instance_id="i1", owner="i0", state="running")
    frame = w.decode_response(w.encode_error(9, exc))
    assert frame.request_id == 9 and not frame.ok
    assert isinstance(frame.body, WrongOwner)
    assert (frame.body.trajectory_id, frame.body.owner) == ("a", "i0")
