from __future__ import annotations

from pathlib import Path

import pytest

from staleflow_trainer.checkpoints import RunCheckpoints, load_json, save_json
from staleflow_trainer.data import DataCursor
from staleflow_trainer.errors import CheckpointError


def test_json_round_trip_and_corruption(tmp_path: Path) -> None:
    p = save_json(tmp_path / "s.json", {"a": [1, 2]})
    assert load_json(p) == {"a": [1, 2]}
    p.write_text('{"a": [1, 3]}')
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_json(p)


def test_write_commit_latest_and_prune(tmp_path: Path) -> None:
    ck = RunCheckpoints(tmp_path, keep=2)
    assert ck.latest() is None and ck.resolve_resume("auto") is None
    with pytest.raises(CheckpointError, match="must"):
        ck.resolve_resume("must")
    for step in (1, 2, 3):
        cursor = DataCursor(5, seed=0)
        cursor.take(step)
        ck.write(step, lambda d, c=cursor: save_json(d / "cursor.json", c.state_dict()))
    assert ck.steps() == [2, 3]
    step, path = ck.latest()  # type: ignore[misc]
    assert step == 3 and load_json(path / "cursor.json")["position"] == 3
    assert ck.resolve_resume("never") is None


def test_failed_write_keeps_previous_checkpoint(tmp_path: Path) -> None:
    ck = RunCheckpoints(tmp_path)
    ck.write(1, lambda d: save_json(d / "x.json", 1))

    def boom(d: Path) -> None:
        save_json(d / "x.json", 2)
        raise RuntimeError("killed mid-checkpoint")

    with pytest.raises(RuntimeError):
        ck.write(2, boom)
    step, path = ck.latest()  # type: ignore[misc]
    assert step == 1 and load_json(path / "x.json") == 1
    assert ck.steps() == [1]
