"""Random message sequences thrown at the service core (Dispatcher.handle_frame).

Frames are a mix of well-formed requests with random (often wrong) ids, instances, versions and
segments, plus garbage: random bytes, flipped and truncated frames, wrong schema versions,
unknown types and wrong tokens. For every frame the dispatcher must answer with a decodable
response; when it is an error the store must be exactly as before; the store's invariants must
hold throughout and no trajectory may vanish.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import msgpack
from hypothesis import given, settings

from trajectory_server import (
    ALL_LEVELS,
    Completion,
    GroupByKey,
    IntArray,
    SamplingParams,
    Segment,
)
from trajectory_server import wire as w
from trajectory_server.service import Dispatcher

TOKEN = "s3cret"
IDS = [f"g{g}/{i}" for g in range(3) for i in range(2)] + ["zz", "g9/0"]
INSTANCES = ["i0", "i1", "ghost"]

ids = st.sampled_from(IDS)
id_lists = st.lists(ids, min_size=0, max_size=3)
route_lists = st.lists(ids, min_size=1, max_size=2, unique=True)
instances = st.sampled_from(INSTANCES)
versions = st.integers(0, 4)


@st.composite
def segments(draw: st.DrawFn, final: bool) -> Any:
    n = draw(st.integers(0, 3))
    fields = {
        "trajectory_id": draw(ids),
        "start": draw(st.integers(0, 3)),
        "token_ids": draw(st.lists(st.integers(0, 50), min_size=n, max_size=n)),
        "logprobs": [-0.5] * n,
        "versions": draw(st.lists(versions, min_size=n, max_size=n)),
    }
    if final:
        return Completion(**fields, finish_reason=draw(st.sampled_from(["stop", "length"])))
    return Segment(**fields)


requests = st.one_of(
    st.builds(
        lambda g, n: w.SubmitGroup(
            group_id=f"g{g}",
            prompt_token_ids=IntArray([1, 2]),
            n=n,
            sampling=SamplingParams(max_new_tokens=6),
            metadata={"gt": "1"},
        ),
        st.integers(2, 4),
        st.integers(1, 2),
    ),
    st.builds(  # keys 0 and 1 are put (the test's set-up); 2 is not
        lambda gs, skip: w.SubmitGroups(
            groups=tuple(GroupByKey(group_id=f"g{g}", n=n, prompt_key=k) for g, n, k in gs),
            sampling=SamplingParams(max_new_tokens=6, seed=3),
            skip_existing=skip,
        ),
        st.lists(st.tuples(st.integers(2, 5), st.integers(1, 2), st.integers(0, 2)), max_size=3),
        st.booleans(),
    ),
    st.builds(
        lambda i, t, v: w.Route(instance_id=i, trajectory_ids=tuple(t), version=v),
        instances,
        route_lists,
        versions,
    ),
    st.builds(
        lambda i, s: w.ReturnPartial(instance_id=i, segments=tuple(s)),
        instances,
        st.lists(segments(False), max_size=2),
    ),
    st.builds(
        lambda i, s, e: w.Finish(instance_id=i, completions=tuple(s), echo=e),
        instances,
        st.lists(segments(True), max_size=2),
        st.booleans(),
    ),
    st.builds(lambda t: w.Drop(trajectory_ids=tuple(t), reason="r"), id_lists),
    st.builds(lambda g: w.DropGroup(group_id=f"g{g}", reason="r"), st.integers(0, 3)),
    st.builds(lambda i: w.InstanceLost(instance_id=i), instances),
    st.builds(lambda t: w.Release(trajectory_ids=tuple(t)), id_lists),
    st.builds(lambda t: w.Free(trajectory_ids=tuple(t)), id_lists),
    st.just(w.FinishedIds()),
    st.builds(lambda t: w.Get(trajectory_ids=tuple(t)), id_lists),
    st.builds(lambda t: w.History(trajectory_id=t), ids),
    st.just(w.QueueView(limit=None, level=ALL_LEVELS)),
    st.just(w.Stats()),
    st.just(w.SaveCheckpoint()),  # no path configured: a clean error
)


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    req = draw(requests)
    good = w.encode_request(req, draw(st.integers(1, 1000)), TOKEN)
    how = draw(
        st.sampled_from(
            ["good"] * 6 + ["bytes", "flip", "truncate", "schema", "type", "token", "no-token"]
        )
    )
    if how == "good":
        return good
    if how == "bytes":
        return draw(st.binary(max_size=64))
    if how == "flip":
        i = draw(st.integers(0, len(good) - 1))
        return good[:i] + bytes([good[i] ^ draw(st.integers(1, 255))]) + good[i + 1 :]
    if how == "truncate":
        return good[: draw(st.integers(0, len(good) - 1))]
    env = msgpack.unpackb(good, raw=False)
    if how == "schema":
        env["schema"] = draw(st.sampled_from([0, 2, "1", None]))
    elif how == "type":
        env["type"] = draw(st.sampled_from(["reboot", "", "ok", "Route"]))
    elif how == "token":
        env["token"] = draw(st.sampled_from(["s3cre", "s3cret ", "x" * 40, ""]))
    else:
        del env["token"]
    return msgpack.packb(env, use_bin_type=True)


def informed_frame(d: Dispatcher, data: st.DataObject) -> bytes | None:
    """A request aimed at the store's actual state (so many succeed), or None if nothing runs."""
    running = [(i, t) for i in d.store.instances() for t in d.store.held_by(i)]
    queued = [e.trajectory_id for e in d.store.queue_view()]
    choice = data.draw(st.sampled_from(["output", "output", "route"]))
    if choice == "route" and queued:
        tid = data.draw(st.sampled_from(queued))
        req: Any = w.Route(
            instance_id=data.draw(instances), trajectory_ids=(tid,), version=data.draw(versions)
        )
        return w.encode_request(req, 1, TOKEN)
    if not running:
        return None
    inst, tid = data.draw(st.sampled_from(running))
    t = d.store.get(tid)
    assert t.v_traj is not None
    held = t.generated_len
    start = max(0, held - data.draw(st.integers(-1, 2)))  # mostly exact, sometimes a gap/overlap
    new = data.draw(st.integers(0, 3))
    keep = t.generated_token_ids[start:].tolist()
    fields: dict[str, Any] = {
        "trajectory_id": tid,
        "start": start,
        "token_ids": keep + [9] * new,
        "logprobs": t.generated_logprobs[start:].tolist() + [-0.25] * new,
        "versions": t.generated_versions[start:].tolist()
        + [t.v_traj + data.draw(st.integers(-1, 1))] * new,
    }
    if len(fields["token_ids"]) != len(fields["versions"]):  # start beyond held: pad consistently
        fields["logprobs"] = [-0.25] * len(fields["token_ids"])
        fields["versions"] = [t.v_traj] * len(fields["token_ids"])
    if data.draw(st.booleans()):
        req = w.ReturnPartial(instance_id=inst, segments=(Segment(**fields),))
    else:
        reason = data.draw(st.sampled_from(["stop", "length"]))
        req = w.Finish(instance_id=inst, completions=(Completion(**fields, finish_reason=reason),))
    return w.encode_request(req, 2, TOKEN)


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(1, 40))
def test_random_message_sequences_never_corrupt_the_store(data: st.DataObject, steps: int) -> None:
    d = Dispatcher(token=TOKEN)
    d.store.prompts.put([(0, [1, 2], None), (1, [3], {"gt": "1"})])
    for g in range(3):
        d.store.submit_group(f"g{g}", [1, 2], 2, sampling=SamplingParams(max_new_tokens=6))
    seen = set(d.store.ledger())
    for _ in range(steps):
        frame = informed_frame(d, data) if data.draw(st.booleans()) else None
        frame = frame if frame is not None else data.draw(frames())
        before = d.store.to_dict()
        response = w.decode_response(d.handle_frame(frame))
        if not response.ok:
            assert d.store.to_dict() == before, f"rejected {response.body!r} but state changed"
        d.store.check_invariants()
        ledger = set(d.store.ledger())
        assert seen <= ledger, "a trajectory vanished"
        seen = ledger


def test_every_request_type_has_a_handler() -> None:
    """A request type added to the wire without a handler fails here, not at a peer's call."""
    import inspect

    from trajectory_server import _requests
    from trajectory_server._dispatch import _HANDLERS

    kinds = {
        c
        for _, c in inspect.getmembers(_requests, inspect.isclass)
        if c.__module__ == _requests.__name__
    }
    assert kinds == set(_HANDLERS)
