"""The prompt table: prompts put once under integer keys, groups submitted by key; in the
store, on the wire and through a real service on loopback."""

from __future__ import annotations

import msgpack
import pytest

from trajectory_server import SamplingParams, TrajectoryStore
from trajectory_server import wire as w
from trajectory_server._packed import IntArray
from trajectory_server.client import InProcessTrajectoryClient, TrajectoryClient
from trajectory_server.errors import InvalidRecord, MalformedMessage
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
