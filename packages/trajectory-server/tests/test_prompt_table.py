"""The prompt table: prompts put once under integer keys, groups submitted by key; in the
store, on the wire and through a real service on loopback."""

from __future__ import annotations

from typing import Any

import attrs
import msgpack
import pytest

from trajectory_server import GroupByKey, SamplingParams, Trajectory, TrajectoryStore
from trajectory_server import wire as w
from trajectory_server._packed import IntArray
from trajectory_server.client import InProcessTrajectoryClient, TrajectoryClient
from trajectory_server.errors import DuplicateTrajectory, InvalidRecord, MalformedMessage
from trajectory_server.service import TrajectoryService


def test_a_group_submitted_by_key_gets_the_prompt_and_its_metadata() -> None:
    store = TrajectoryStore()
    assert store.prompts.put([(3, [5, 6, 7], {"gt": "42", "src": "a"}), (9, [8], None)]) == 2
    ids = store.submit_group("g", None, 2, prompt_key=3, metadata={"src": "b"},
                             sampling=SamplingParams(seed=10))  # fmt: skip
    for i, tid in enumerate(ids):
        t = store.get(tid)
        assert t.prompt_token_ids.tolist() == [5, 6, 7]
        assert t.metadata == {"gt": "42", "src": "b"}  # what the submission names wins
        assert t.sampling.seed == 10 + i
    assert store.get(store.submit_group("h", None, 1, prompt_key=9)[0]).metadata == {}
    store.prompts.put([(9, [1, 2], None)])  # put again: replaced
    assert store.get(store.submit_group("k", None, 1, prompt_key=9)[0]).prompt_len == 2


@pytest.mark.parametrize(
    ("args", "kwargs", "field", "says"),
    [
        (("g", None, 2), {"prompt_key": 4}, "prompt_key", "no prompt under key 4 \\(1 put"),
        (("g", None, 2), {}, "prompt_key", "give prompt_token_ids or prompt_key, got neither"),
        (("g", [1], 2), {"prompt_key": 3}, "prompt_key", "got both"),
        (("g", None, 2), {"prompt_key": True}, "prompt_key", "prompt_key must be an int, got bool"),
        (("g", None, 2), {"prompt_key": 3.0}, "prompt_key", "must be an int, got float"),
    ],
)
def test_a_bad_submission_by_key_is_refused_and_changes_nothing(
    args: tuple[object, ...], kwargs: dict[str, object], field: str, says: str
) -> None:
    store = TrajectoryStore()
    store.prompts.put([(3, [5], None)])
    with pytest.raises(InvalidRecord, match=says) as err:
        store.submit_group(*args, **kwargs)  # type: ignore[arg-type]
    assert err.value.context["field"] == field
    assert len(store) == 0


@pytest.mark.parametrize(
    ("item", "field"),
    [
        ((-1, [1], None), "prompt_key"),
        ((2**63, [1], None), "prompt_key"),
        (("3", [1], None), "prompt_key"),
        ((3, [], None), "prompt_token_ids"),
        ((3, [2**40], None), "prompt_token_ids"),
        ((3, "abc", None), "prompt_token_ids"),
        ((3, [1], "not a map"), "metadata"),
        ((3, [1]), "prompts"),
    ],
)
def test_a_bad_prompt_refuses_the_whole_put(item: object, field: str) -> None:
    store = TrajectoryStore()
    with pytest.raises(InvalidRecord) as err:
        store.prompts.put([(0, [1, 2], None), item])  # type: ignore[list-item]
    assert err.value.context["field"] == field
    assert len(store.prompts) == 0  # all or none


def test_the_table_is_not_in_the_checkpoint() -> None:
    store = TrajectoryStore()
    store.prompts.put([(0, [1], None)])
    store.submit_group("g", None, 1, prompt_key=0)
    again = TrajectoryStore.from_dict(store.to_dict())
    assert len(again) == 1 and len(again.prompts) == 0


def test_a_submission_by_key_carries_no_prompt_on_the_wire() -> None:
    by_key = w.SubmitGroup(group_id="g7", prompt_token_ids=None, n=8, sampling=SamplingParams(),
                           metadata={}, prompt_key=123)  # fmt: skip
    body = msgpack.unpackb(w.encode_request(by_key, 1))["body"]
    assert set(body) == {"group_id", "n", "prompt_key", "sampling", "metadata"}
    assert w.decode_request(w.encode_request(by_key, 1)).request == by_key


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"keys": [1, 2], "prompt_token_ids": [b"\0\0\0\1"], "metadata": [None]}, "put_prompts"),
        ({"keys": [1], "prompt_token_ids": [b"\0\0\1"], "metadata": [None]},
         "put_prompts.prompt_token_ids[0]"),
        ({"keys": [1], "prompt_token_ids": [[1]], "metadata": [None]},
         "put_prompts.prompt_token_ids[0]"),
        ({"keys": [1], "prompt_token_ids": [b"\0\0\0\1"], "metadata": [3]},
         "put_prompts.metadata[0]"),
        ({"keys": ["a"], "prompt_token_ids": [b"\0\0\0\1"], "metadata": [None]},
         "put_prompts.keys[0]"),
    ],
)  # fmt: skip
def test_a_malformed_put_names_the_field(body: dict[str, object], field: str) -> None:
    frame = msgpack.packb({"schema": w.SCHEMA_VERSION, "type": "put_prompts", "id": 5,
                           "body": body})  # fmt: skip
    with pytest.raises(MalformedMessage) as err:
        w.decode_request(frame)
    assert err.value.context["field"] == field


async def test_prompts_put_over_tcp_in_several_requests_serve_submissions_by_key() -> None:
    store = TrajectoryStore()
    svc = TrajectoryService(store, token="tok")
    client = await TrajectoryClient.connect(*(await svc.start()), token="tok")
    try:
        prompts = [(k, list(range(1, 40 + k)), {"row": k}) for k in range(50)]
        assert await client.put_prompts(prompts, frame_bytes=1000) == 50
        put = client.wire_bytes()["put_prompts"]
        assert put["requests"] > 5 and put["sent"] > 50 * 39 * 4  # the tokens, in several
        assert len(store.prompts) == 50
        ids = await client.submit_group("g", None, 4, prompt_key=49)
        assert client.wire_bytes()["submit_group"]["sent"] < 200  # not 88 tokens (352 B)
        assert store.get(ids[3]).prompt_token_ids.tolist() == list(range(1, 89))
        assert store.get(ids[3]).metadata == {"row": 49}
        assert await client.submit_group("h2", None, 4, prompt_key=3, echo=False) == 4
        assert client.wire_bytes()["submit_group"]["received"] < 60 + 40  # a count, no ids
        assert store.group("h2") == tuple(f"h2/{i}" for i in range(4))
        with pytest.raises(InvalidRecord, match="no prompt under key 50"):
            await client.submit_group("h", None, 4, prompt_key=50)
    finally:
        await client.close()
        await svc.stop()


async def test_the_in_process_client_puts_and_submits_by_key() -> None:
    client = InProcessTrajectoryClient()
    assert await client.put_prompts([(0, IntArray([4, 5]), None)]) == 1
    ids = await client.submit_group("g", None, 2, prompt_key=0)
    assert [client.store.get(t).prompt_token_ids.tolist() for t in ids] == [[4, 5], [4, 5]]


# -- several groups by key in one request ------------------------------------------------------


def _table(*keys: int) -> TrajectoryStore:
    store = TrajectoryStore()
    store.prompts.put([(k, [k + 1, k + 2], {"row": k}) for k in keys])
    return store


def test_groups_by_key_share_the_sampling_and_keep_their_seeds() -> None:
    store = _table(0, 1)
    shared = SamplingParams(max_new_tokens=9, seed=100)
    groups = [GroupByKey(group_id="a", n=2, prompt_key=1, seed=7),
              GroupByKey(group_id="b", n=3, prompt_key=0)]  # fmt: skip
    assert store.submit_groups(groups, sampling=shared) == 5
    a1, b2 = store.get("a/1"), store.get("b/2")
    assert a1.prompt_token_ids.tolist() == [2, 3] and a1.metadata == {"row": 1}
    assert (a1.sampling.seed, a1.sampling.max_new_tokens) == (8, 9)  # its seed + 1
    assert (b2.sampling.seed, b2.prompt_token_ids.tolist()) == (102, [1, 2])  # the batch's + 2
    # the same as one submit_group each
    one = _table(0, 1)
    one.submit_group("a", None, 2, prompt_key=1, sampling=attrs.evolve(shared, seed=7))
    assert one.get("a/1") == a1


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda s: s.submit_groups([GroupByKey(group_id="a", n=1, prompt_key=0)],
                                   sampling={"seed": 1}), "sampling"),  # type: ignore[arg-type]
        (lambda s: s.submit_groups("ab"), "groups"),  # type: ignore[arg-type]
        (lambda s: s.submit_groups([("a", 1, 0)]), "groups"),  # type: ignore[list-item]
        (lambda s: s.submit_groups([GroupByKey(group_id=f"g{i}", n=4096, prompt_key=0)
                                    for i in range(257)]), "groups"),  # 2**20 + 4096 members
    ],
)  # fmt: skip
def test_a_malformed_batch_names_the_field_and_submits_none(call: Any, field: str) -> None:
    store = _table(0)
    with pytest.raises(InvalidRecord) as err:
        call(store)
    assert err.value.context["field"] == field
    assert store.stats().queued == 0


def test_a_group_only_partly_here_is_left_as_it_is() -> None:
    """With ``skip_existing`` a group any member of which is already here is skipped whole."""
    store = _table(0)
    store.submit([Trajectory(trajectory_id="a/1", group_id="a", prompt_token_ids=[1])])
    batch = [
        GroupByKey(group_id="a", n=3, prompt_key=0),
        GroupByKey(group_id="b", n=2, prompt_key=0),
    ]
    assert store.submit_groups(batch, skip_existing=True) == 2
    assert store.group("a") == ("a/1",) and store.group("b") == ("b/0", "b/1")


def test_groups_already_there_are_skipped_only_when_asked() -> None:
    store = _table(0)
    store.submit_group("a", None, 2, prompt_key=0)
    again = [
        GroupByKey(group_id="a", n=2, prompt_key=0),
        GroupByKey(group_id="b", n=1, prompt_key=0),
    ]
    with pytest.raises(DuplicateTrajectory, match="a/0"):
        store.submit_groups(again)
    assert store.group("a") == ("a/0", "a/1") and store.stats().queued == 2
    assert store.submit_groups(again, skip_existing=True) == 1
    assert store.group("b") == ("b/0",)


@pytest.mark.parametrize(
    ("groups", "error", "field"),
    [
        ([("a", 1, 0), ("b", 1, 5)], InvalidRecord, "prompt_key"),  # key never put
        ([("a", 1, 0), ("a", 1, 0)], DuplicateTrajectory, None),  # the same group twice
    ],
)
def test_a_bad_batch_of_groups_submits_none(groups: list, error: type, field: str | None) -> None:
    store = _table(0)
    recs = [GroupByKey(group_id=g, n=n, prompt_key=k) for g, n, k in groups]
    with pytest.raises(error) as err:
        store.submit_groups(recs)
    if field is not None:
        assert err.value.context["field"] == field
    assert store.stats().queued == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"group_id": "", "n": 1, "prompt_key": 0}, "group_id"),
        ({"group_id": "a", "n": 0, "prompt_key": 0}, "n"),
        ({"group_id": "a", "n": 5000, "prompt_key": 0}, "n"),
        ({"group_id": "a", "n": 1, "prompt_key": "0"}, "prompt_key"),
        ({"group_id": "a", "n": 1, "prompt_key": 0, "seed": 1.5}, "seed"),
        ({"group_id": "a", "n": 1, "prompt_key": -1}, "prompt_key"),
        ({"group_id": "a", "n": 1, "prompt_key": 2**62 + 1}, "prompt_key"),
        ({"group_id": "a", "n": 1, "prompt_key": 0, "seed": 2**63 - 1}, "seed"),  # + i overflows
        ({"group_id": "a", "n": 1, "prompt_key": 0, "seed": -(2**63) - 1}, "seed"),
    ],
)
def test_a_bad_group_record_names_its_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRecord) as err:
        GroupByKey(**kwargs)
    assert err.value.context["field"] == field


@pytest.mark.parametrize(
    ("groups", "field"),
    [
        ([["a", 1]], "submit_groups.groups[0]"),
        ([["a", 1, 0], "b"], "submit_groups.groups[1]"),
        ([["a", 0, 0]], "submit_groups.groups[0].n"),
        ([["a", 1, 0, "s"]], "submit_groups.groups[0].seed"),
    ],
)
def test_a_malformed_batch_of_groups_names_the_field(groups: list, field: str) -> None:
    body = {"groups": groups, "sampling": {"temperature": 1.0, "top_p": 1.0,
                                           "max_new_tokens": 4, "stop_token_ids": []}}  # fmt: skip
    frame = msgpack.packb({"schema": w.SCHEMA_VERSION, "type": "submit_groups", "id": 5,
                           "body": body})  # fmt: skip
    with pytest.raises((InvalidRecord, MalformedMessage)) as err:
        w.decode_request(frame)
    assert err.value.context["field"] == field


async def test_groups_by_key_over_tcp_cost_a_few_bytes_each() -> None:
    """Sixteen groups in one request: the sampling once, each group its id, size, key and
    seed; the answer a count."""
    store = _table(*range(16))
    svc = TrajectoryService(store, token="tok")
    client = await TrajectoryClient.connect(*(await svc.start()), token="tok")
    try:
        groups = [GroupByKey(group_id=f"g{k:06d}", n=8, prompt_key=k, seed=1_000_000 + 64 * k)
                  for k in range(16)]  # fmt: skip
        sampling = SamplingParams(temperature=0.7, max_new_tokens=512, stop_token_ids=(2,))
        assert await client.submit_groups(groups, sampling=sampling) == 128
        sent = client.wire_bytes()["submit_groups"]
        assert sent["requests"] == 1 and sent["sent"] < 16 * 20 + 150 and sent["received"] < 40
        assert store.get("g000015/7").sampling == attrs.evolve(
            sampling, seed=1_000_000 + 64 * 15 + 7
        )
        assert await client.submit_groups(groups, skip_existing=True) == 0
        with pytest.raises(DuplicateTrajectory):
            await client.submit_groups(groups[:1])
    finally:
        await client.close()
        await svc.stop()
