"""`staleflow profile` on a real vLLM-CPU engine, then `staleflow fit-cost-model` on its output.

The README's tiny model and ``examples/tiny.yaml`` with ``rollout.max_running=8`` and
``rollout.max_model_len=128``: the profile grid is running in {1, 2, 4, 8} x two KV sizes per
trajectory (8 points, the fewest the fit accepts: it holds 20 % out and needs 6 to fit), 32
decode steps each (the command's default of 8 is a ~25 ms window per point, too short on a
shared 2-core machine: one descheduling made the fit reject the data). ``profiling.profile`` is
what ``staleflow profile`` runs. Asserted: the JSONL holds exactly the grid with positive
finite latencies from the vllm backend; the fit command succeeds and writes coefficients that
load back as the coordinator's cost model and predict a positive step latency at every
profiled point. Measured values are not asserted (the machine is shared).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rollout_coordinator.cost_model import CostModel
from staleflow_trainer.cli import main
from staleflow_trainer.config import load_config
from staleflow_trainer.profiling import profile

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MAX_MODEL_LEN, STEPS = 128, 32  # room for 32 decode steps per point (tiny.yaml has 32)
RUNNING = (1, 2, 4, 8)


def test_profile_then_fit_round_trips(
    tmp_path: Path, engine_required: object, capsys: pytest.CaptureFixture[str]
) -> None:
    engine_required("vllm")  # type: ignore[operator]
    cfg = load_config(
        EXAMPLES / "tiny.yaml",
        [
            f"run_dir={tmp_path}",
            "rollout.max_running=8",
            f"rollout.max_model_len={MAX_MODEL_LEN}",
            "metrics.tensorboard=false",
            "metrics.progress_bar=false",
        ],
    )
    assert profile(cfg, steps=STEPS) == 0
    path = tmp_path / "profile.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    per_traj = sorted({max(STEPS, (MAX_MODEL_LEN - STEPS) // 2), MAX_MODEL_LEN - STEPS})
    grid = {(n, n * length) for n in RUNNING for length in per_traj}
    assert {(r["running"], r["kv_tokens"]) for r in records} == grid
    assert len(records) == len(grid)
    for r in records:
        assert r["backend"] == "vllm"
        assert 0 < r["step_latency_s"] < 60 and math.isfinite(r["step_latency_s"])

    out = tmp_path / "cost_model.json"
    assert main(["fit-cost-model", str(path), "-o", str(out)]) == 0
    assert "records: 6 fit, 2 held out" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["records"] == len(grid)
    model = CostModel.load(out)
    for k in ("k1", "k2", "k3", "k4", "b"):
        assert getattr(model, k) >= 0 and getattr(model, k) == pytest.approx(saved[k])
    for n, kv in grid:
        assert model.step_latency(n, kv) > 0
