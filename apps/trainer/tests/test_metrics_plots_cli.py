from __future__ import annotations

import json
from pathlib import Path

import pytest

from staleflow_trainer import cli
from staleflow_trainer.errors import CommandUnavailable
from staleflow_trainer.report.metrics import (
    REQUIRED_KEYS,
    MetricsError,
    MetricsWriter,
    TimelineWriter,
    busy_fractions,
    read_jsonl,
    staleness_summary,
)
from staleflow_trainer.report.plots import PlotError, plot_run
from staleflow_trainer.report.progress import ProgressBar


def _record(step: int) -> dict:
    return {
        "step": step,
        "version": step + 1,
        "tokens_per_s": 100.0 + step,
        "reward_mean": 0.1 * step,
        "trainer_wait_s": 0.5,
        **staleness_summary([0, 1, 1, 2][: 1 + step % 4]),
        "instance_busy": {"i0": 0.9, "i1": 0.4},
        "syncs": 1,
        "migrations": 0,
        "interrupts": 2,
        "queue_depths": {"trajectory_server": 3},
    }


def _write_run(run: Path, steps: int = 6) -> None:
    with MetricsWriter(run, tensorboard=True) as w:
        for s in range(steps):
            w.log_step(_record(s))
    tl = TimelineWriter(run)
    for i, inst in enumerate(("i0", "i1")):
        tl.interval(inst, "busy", 0.0, 2.0 + i, version=0)
        tl.interval(inst, "syncing", 2.0 + i, 2.5 + i, version=1)
        tl.interval(inst, "idle", 2.5 + i, 4.0, version=1)
    tl.close()


def test_staleness_summary() -> None:
    s = staleness_summary([1, 1, 0, 3])
    assert s == {
        "max_staleness": 3,
        "mean_staleness": 1.25,
        "staleness_hist": {"0": 1, "1": 2, "3": 1},
    }
    assert staleness_summary([])["max_staleness"] == 0


def test_metrics_jsonl_and_tensorboard(tmp_path: Path) -> None:
    _write_run(tmp_path)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6))
    assert all(set(REQUIRED_KEYS) <= set(r) for r in rows)
    assert rows[3]["staleness_hist"] == {"0": 1, "1": 2, "2": 1}
    assert any((tmp_path / "tensorboard").iterdir())


def test_metrics_rejects_incomplete_records(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        with pytest.raises(MetricsError, match="reward_mean"):
            w.log_step({k: 0 for k in REQUIRED_KEYS if k != "reward_mean"})
        with pytest.raises(MetricsError, match="JSON"):
            w.log_step({**_record(0), "bad": object()})
        w.log_step({**_record(0), "nan_metric": float("nan")})
    (row,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert row["nan_metric"] is None


def test_metrics_resume_truncates_steps_after_the_checkpoint(tmp_path: Path) -> None:
    _write_run(tmp_path, steps=6)
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 6, "torn')  # crash mid-write
    with MetricsWriter(tmp_path, tensorboard=False, resume_step=3) as w:
        w.log_step(_record(4))
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4]


def test_timeline_and_busy_fractions(tmp_path: Path) -> None:
    _write_run(tmp_path)
    rows = read_jsonl(tmp_path / "timeline.jsonl")
    assert busy_fractions(rows, start_s=0.0, end_s=4.0) == {"i0": 0.5, "i1": 0.75}
    tl = TimelineWriter(tmp_path)
    with pytest.raises(MetricsError):
        tl.interval("i0", "sleeping", 0, 1)
    with pytest.raises(MetricsError):
        tl.interval("i0", "busy", 2, 1)
    tl.close()


def test_progress_bar_smoke() -> None:
    with ProgressBar(3, enabled=True) as bar:
        bar.update(1, _record(1))
    with ProgressBar(3, enabled=False) as bar:
        bar.update(1, _record(1))


def test_plot_run_writes_pngs(tmp_path: Path) -> None:
    _write_run(tmp_path)
    files = plot_run(tmp_path)
    names = sorted(p.name for p in files)
    assert names == ["reward.png", "staleness_hist.png", "throughput.png", "timeline.png"]
    for p in files:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 2000


def test_plot_empty_run_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(PlotError, match="neither"):
        plot_run(tmp_path)
    with pytest.raises(PlotError, match="no such directory"):
        plot_run(tmp_path / "missing")


def test_cli_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_run(tmp_path)
    assert cli.main(["plot", str(tmp_path)]) == 0
    assert "timeline.png" in capsys.readouterr().out
    assert cli.main(["plot", str(tmp_path / "empty")]) == 1


def test_cli_config_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", "/nonexistent.yaml"]) == 2
    examples = Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml"
    assert cli.main(["config", str(examples), "trainer.stepz=3"]) == 2
    err = capsys.readouterr().err
    assert "trainer.stepz" in err and "allowed" in err
    assert cli.main(["config", str(examples), "run_dir=/tmp/x", "trainer.steps=3"]) == 0
    assert "steps: 3" in capsys.readouterr().out


def test_cli_missing_implementation_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(CommandUnavailable, match="not available yet"):
        cli._lazy("staleflow_trainer.no_such_module")
    real_lazy = cli._lazy
    monkeypatch.setattr(cli, "_lazy", lambda m: real_lazy(m.replace("wiring", "no_wiring")))
    examples = Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml"
    # its own run directory: the README's main job may have finished runs/tiny, and a
    # finished run answers before the deployment module is imported
    assert cli.main(["train", str(examples), f"run_dir={tmp_path / 'run'}"]) == 1
    assert "not available yet" in capsys.readouterr().err


def test_metrics_file_is_plain_json_lines(tmp_path: Path) -> None:
    _write_run(tmp_path, steps=2)
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        assert isinstance(json.loads(line), dict)
