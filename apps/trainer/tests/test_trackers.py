"""Experiment trackers: what MetricsWriter hands them, and a real W&B run in offline mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from staleflow_trainer.config import load_config
from staleflow_trainer.errors import ConfigError
from staleflow_trainer.report.metrics import MetricsWriter
from staleflow_trainer.report.trackers import RUN_ID_FILE, WandbTracker, trackers_from_config

RECORD = {
    "step": 2,
    "version": 2,
    "tokens_per_s": 120.0,
    "gen_tokens_per_s": 300.0,
    "max_staleness": 1,
    "mean_staleness": 0.5,
    "reward_mean": 0.25,
    "trainer_wait_s": 0.1,
    "staleness_hist": {"0": 2, "1": 2},
    "trainer": {"loss": 0.7},
    "note": "not a number",
}


class _Recorder:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, float], int]] = []
        self.closed = False

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.logged.append((dict(scalars), step))

    def close(self) -> None:
        self.closed = True


def test_writer_hands_trackers_the_tensorboard_scalars(tmp_path: Path) -> None:
    rec = _Recorder()
    with MetricsWriter(tmp_path, tensorboard=False, trackers=[rec]) as w:
        w.log_step(RECORD)
    ((scalars, step),) = rec.logged
    assert step == 2 and rec.closed
    assert scalars["tokens_per_s"] == 120.0 and scalars["gen_tokens_per_s"] == 300.0
    assert scalars["trainer/loss"] == 0.7 and "step" not in scalars and "note" not in scalars


def test_trackers_are_off_by_default_and_need_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert trackers_from_config(load_config(None, [f"run_dir={tmp_path}"])) == []
    import staleflow_trainer.report.trackers as trackers

    def missing(name: str) -> Any:
        raise ImportError(name)

    monkeypatch.setattr(trackers.importlib, "import_module", missing)
    cfg = load_config(None, [f"run_dir={tmp_path}", "metrics.wandb.enabled=true"])
    with pytest.raises(ConfigError, match="not installed") as e:
        trackers_from_config(cfg)
    assert e.value.key == "metrics.wandb.enabled"


def test_bad_wandb_mode_names_the_allowed_values(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"run_dir={tmp_path}", "metrics.wandb.mode=cloud"])
    assert e.value.key == "metrics.wandb.mode" and "offline" in str(e.value.allowed)


def test_wandb_offline_run_is_written_and_resumed(tmp_path: Path) -> None:
    """The real package, offline (no account, no network): a run file under RUN_DIR/wandb;
    a resumed writer continues the same run id."""
    cfg = load_config(
        None,
        [f"run_dir={tmp_path}", "metrics.wandb.enabled=true", "metrics.wandb.mode=offline"],
    )
    (tracker,) = trackers_from_config(cfg)
    assert isinstance(tracker, WandbTracker)
    with MetricsWriter(tmp_path, tensorboard=False, trackers=[tracker]) as w:
        w.log_step(RECORD)
    run_id = (tmp_path / RUN_ID_FILE).read_text().strip()
    assert run_id == tracker.run_id
    files = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    (again,) = trackers_from_config(cfg, resume=True)
    again.close()
    assert again.run_id == run_id
