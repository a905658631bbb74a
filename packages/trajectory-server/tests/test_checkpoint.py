"""Checkpoint files: exact round trip, atomic replace, corruption detected with a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from trajectory_server import Completion, SamplingParams, Segment, TrajectoryStore
from trajectory_server.checkpoint import MAGIC, encode_checkpoint, load_checkpoint, save_checkpoint
from trajectory_server.errors import CheckpointCorrupt, CheckpointError


def busy_store() -> TrajectoryStore:
    s = TrajectoryStore()
    s.submit_group(
        "a",
        range(100),
        4,
        sampling=SamplingParams(max_new_tokens=64, seed=1),
        metadata={"ground_truth": "12", "data_source": "gsm8k"},
        target_lengths=[5, 6, 7, 8],
    )
    s.route("i0", ["a/0", "a/1", "a/2"], 3)
    s.return_partial(
        "i0",
        [
            Segment(
                trajectory_id="a/0",
                start=0,
                token_ids=[1, 2],
                logprobs=[-0.1, float("-inf")],
                versions=[3, 4],
            )
        ],
    )
    s.finish(
        "i0",
        [
            Completion(
                trajectory_id="a/1",
                start=0,
                token_ids=[5],
                logprobs=[-2.5],
                versions=[3],
                finish_reason="stop",
            )
        ],
    )
    s.drop(["a/3"], "filtered")
    return s


def test_round_trip_is_exact(tmp_path: Path) -> None:
    s = busy_store()
    path = save_checkpoint(s, tmp_path / "ts.ckpt")
    again = load_checkpoint(path)
    assert again.to_dict() == s.to_dict()
    assert again.get("a/0").generated_logprobs.tolist() == [-0.1, float("-inf")]
    assert again.queue_view() == s.queue_view()
    assert again.held_by("i0") == ("a/2",)
    assert (
        TrajectoryStore.load_checkpoint(s.save_checkpoint(tmp_path / "b.ckpt")).to_dict()
        == s.to_dict()
    )


def test_save_replaces_atomically_and_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "ts.ckpt"
    save_checkpoint(TrajectoryStore(), path)
    s = busy_store()
    save_checkpoint(s, path)
    assert [p.name for p in tmp_path.iterdir()] == ["ts.ckpt"]
    assert load_checkpoint(path).to_dict() == s.to_dict()


def test_unwritable_target_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(busy_store(), tmp_path / "missing-dir" / "ts.ckpt")
    assert "missing-dir" in str(err.value)
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "nope.ckpt")


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum"),
        (lambda b: b[: len(b) // 2], "truncated"),
        (lambda b: b + b"x", "truncated or padded"),
        (lambda b: b"NOTMAGIC" + b[8:], "bad magic"),
        (lambda b: b[:8] + (2).to_bytes(4, "big") + b[12:], "format 2"),
        (lambda b: b[:10], "shorter than its header"),
    ],
)
def test_corruption_detected(tmp_path: Path, mutate, why: str) -> None:  # type: ignore[no-untyped-def]
    data = encode_checkpoint(busy_store())
    assert data.startswith(MAGIC)
    path = tmp_path / "bad.ckpt"
    path.write_bytes(mutate(data))
    with pytest.raises(CheckpointCorrupt) as err:
        load_checkpoint(path)
    assert why in str(err.value)
    assert err.value.path == str(path)


def test_inconsistent_state_with_valid_checksum_is_rejected() -> None:
    state = busy_store().to_dict()
    state["locations"]["a/0"] = {"state": "running", "instance_id": "i9", "reason": None}
    with pytest.raises(CheckpointCorrupt):
        TrajectoryStore.from_dict(state)
    state = busy_store().to_dict()
    state["payloads"][0]["v_traj"] = "3"
    with pytest.raises(CheckpointCorrupt) as err:
        TrajectoryStore.from_dict(state)
    assert err.value.field == "state.payloads[0].v_traj"


def test_a_payload_outside_its_group_or_an_id_queued_twice_is_rejected() -> None:
    store = TrajectoryStore()
    for gid in ("a", "b"):
        store.submit_group(gid, [1], 2, sampling=SamplingParams(max_new_tokens=4))
    state = store.to_dict()
    for p in state["payloads"]:
        if p["trajectory_id"] == "b/0":
            p["group_id"] = "z"  # the queue order reads a payload's group
    with pytest.raises(CheckpointCorrupt, match="not a member of its group"):
        TrajectoryStore.from_dict(state)
    state = store.to_dict()
    state["queue"].append(list(state["queue"][0]))
    with pytest.raises(CheckpointCorrupt, match="queued twice"):
        TrajectoryStore.from_dict(state)
