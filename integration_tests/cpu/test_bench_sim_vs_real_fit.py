"""The trainer calibration of ``benchmarks/bench_sim_vs_real.py``: a least-squares fit of
``train_s - push_s = a + b x tokens`` with ``a, b >= 0``, from hand-written step records."""

from __future__ import annotations

import json
from pathlib import Path

import bench_sim_vs_real
import pytest


def _run(tmp_path: Path, steps: list[tuple[int, float]]) -> Path:
    run = tmp_path / "real-eta1"
    (run / "model").mkdir(parents=True)
    (run / "model" / "model.safetensors").write_bytes(b"\0" * 100)
    t, rows = 10.0, []
    for i, (tokens, train) in enumerate(steps, start=1):
        t += 1.0
        rows.append({
            "step": i, "time_s": t, "step_s": 1.0, "tokens": tokens, "response_tokens": tokens - 8,
            "samples": 1, "train_s": train + 0.01, "trainer": {"push_s": 0.01},
            "response_lengths": [[tokens - 8]],
        })  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sync = {"state": "syncing", "start_s": 12.5, "end_s": 12.6}
    (run / "timeline.jsonl").write_text(json.dumps(sync) + "\n")
    return run


def test_an_affine_trainer_is_recovered(tmp_path: Path) -> None:
    run = _run(tmp_path, [(n, 0.05 + 0.001 * n) for n in (100, 200, 300, 400)])
    cal = bench_sim_vs_real.calibrate(run, 0, tmp_path)
    assert cal["trainer_time_a_s"] == pytest.approx(0.05)
    assert cal["trainer_time_b_s_per_token"] == pytest.approx(0.001)
    assert cal["syncs_measured"] == 1 and cal["sync_s"] == pytest.approx(0.1)


def test_a_negative_intercept_refits_the_slope_through_the_origin(tmp_path: Path) -> None:
    # the least-squares line is 0.002 x tokens - 0.1: a < 0 is not a time
    run = _run(tmp_path, [(n, 0.002 * n - 0.1) for n in (100, 200, 300, 400)])
    cal = bench_sim_vs_real.calibrate(run, 0, tmp_path)
    tokens = [100, 200, 300, 400]
    train = [0.002 * n - 0.1 for n in tokens]
    b = sum(t * y for t, y in zip(tokens, train, strict=True)) / sum(t * t for t in tokens)
    assert cal["trainer_time_a_s"] == 0.0
    assert cal["trainer_time_b_s_per_token"] == pytest.approx(b)


def test_a_falling_trend_keeps_a_flat_trainer(tmp_path: Path) -> None:
    run = _run(tmp_path, [(100, 0.4), (200, 0.3), (300, 0.2), (400, 0.1)])
    cal = bench_sim_vs_real.calibrate(run, 0, tmp_path)
    assert cal["trainer_time_b_s_per_token"] == 0.0
    assert cal["trainer_time_a_s"] == pytest.approx(0.25)


def test_the_shared_host_rows_take_the_trainer_alone_from_the_sync_run() -> None:
    cal = {"trainer_time_a_s": 0.24, "trainer_time_b_s_per_token": 1e-6, "sync_s": 0.08}
    sync = {"trainer_time_a_s": 0.12, "trainer_time_b_s_per_token": 2e-6, "sync_s": 0.05}
    alone = bench_sim_vs_real._alone(cal, sync)
    assert alone == {"trainer_time_a_s": 0.12, "trainer_time_b_s_per_token": 2e-6, "sync_s": 0.08}
