"""A lost instance's trajectories go back to the queue with the response length the store
holds for each — also those that already carry a version (routed before, so queued at their
V_traj level, not the unversioned one). The shell's I/O over a real trajectory store, through
its wire encoding; no Ray."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from staleflow_trainer.actors.shell_io import ShellIO
from staleflow_trainer.config import load_config
from staleflow_trainer.control.events import InstanceLost
from staleflow_trainer.data import PromptLengths
from trajectory_server import Segment, TrajectoryStore
from trajectory_server.client import InProcessTrajectoryClient

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml"


def _segment(tid: str, n: int, version: int) -> Segment:
    return Segment(
        trajectory_id=tid, start=0, token_ids=np.arange(n), logprobs=np.zeros(n),
        versions=np.full(n, version),
    )  # fmt: skip


async def test_lost_instance_requeues_versioned_partials_with_their_lengths(
    tmp_path: Path,
) -> None:
    store = TrajectoryStore()
    store.submit_group("g", [1, 2, 3], 4)
    store.route("i0", ["g/0", "g/1"], 2)
    store.return_partial("i0", [_segment("g/1", 3, 2)])  # back in the queue at level 2
    store.route("i0", ["g/1"], 3)  # and out again, with 3 tokens held
    store.route("i1", ["g/2"], 3)
    io = ShellIO(
        load_config(EXAMPLE, [f"run.run_dir={tmp_path}"]), prompts=PromptLengths(()),
        ts_address=("127.0.0.1", 1), ts_token="t", rollouts={"i0": None, "i1": None},
        trainer=None, rewards=[], reward_spec={},
    )  # fmt: skip
    io.ts = InProcessTrajectoryClient(store)

    lost = await io.lose("i0", RuntimeError("killed"), at=1.5)

    assert isinstance(lost, InstanceLost)
    assert lost.instance_id == "i0" and lost.at == 1.5
    assert sorted(lost.requeued) == [("g/0", 0), ("g/1", 3)]
    assert "i0" not in io.rollouts and "i1" in io.rollouts
    assert [x["instance_id"] for x in io.lost] == ["i0"]
    assert store.held_by("i1") == ("g/2",)  # the other instance keeps its work
    store.check_invariants()
