"""`staleflow profile` on a real vLLM-CPU engine, then `staleflow fit-cost-model` on its output.

The README's tiny model and ``examples/tiny.yaml`` with ``rollout.max_running=8``: the profile
grid is running in {1, 2, 4, 8} x two KV sizes per trajectory (8 points, 8 decode steps each),
the fewest the fit accepts (it holds 20 % out and needs 6 to fit). Asserted: the JSONL holds
exactly the grid with positive finite latencies from the vllm backend; the fit command succeeds
and writes coefficients that load back as the coordinator's cost model and predict a positive
step latency at every profiled point. Measured values are not asserted (the machine is shared).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rollout_coordinator.cost_model import CostModel
from staleflow_trainer.cli import main

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MAX_MODEL_LEN, STEPS = 32, 8  # tiny.yaml's rollout.max_model_len; profile's default steps
RUNNING = (1, 2, 4, 8)


def test_profile_then_fit_round_trips(
    tmp_path: Path, engine_required: object, capsys: pytest.CaptureFixture[str]
) -> None:
    engine_required("vllm")  # type: ignore[operator]
    rc = main(
        [
            "profile",
            str(EXAMPLES / "tiny.yaml"),
            f"run_dir={tmp_path}",
            "rollout.max_running=8",
            "metrics.tensorboard=false",
            "metrics.progress_bar=false",
        ]
    )
    assert rc == 0
    profile = tmp_path / "profile.jsonl"
    records = [json.loads(line) for line in profile.read_text().splitlines()]
    per_traj = sorted({(MAX_MODEL_LEN - STEPS) // 2, MAX_MODEL_LEN - STEPS})
    grid = {(n, n * length) for n in RUNNING for length in per_traj}
    assert {(r["running"], r["kv_tokens"]) for r in records} == grid
    assert len(records) == len(grid)
    for r in records:
        assert r["backend"] == "vllm"
        assert 0 < r["step_latency_s"] < 60 and math.isfinite(r["step_latency_s"])

    out = tmp_path / "cost_model.json"
    assert main(["fit-cost-model", str(profile), "-o", str(out)]) == 0
    assert "records: 6 fit, 2 held out" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["records"] == len(grid)
    model = CostModel.load(out)
    for k in ("k1", "k2", "k3", "k4", "b"):
        assert getattr(model, k) >= 0 and getattr(model, k) == pytest.approx(saved[k])
    for n, kv in grid:
        assert model.step_latency(n, kv) > 0
