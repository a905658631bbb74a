"""`staleflow simulate` against `staleflow train` with the sim backend: they agree on counts.

Both commands run on the same config — ``examples/sim-tiny.yaml`` shortened (3 steps, 2 sim
instances, 8-token median responses so the real run is quick) — through the command line entry
point: ``simulate`` in one process under a virtual clock, ``train`` on Ray with sim engines in
real time, the real trajectory server, param server and PyTorch trainer. Timing differs by
design; the counts must not: steps completed, trajectories consumed per step (B x n), the
version after every step, staleness within eta, a balanced ledger and the shared metrics keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from staleflow_trainer.cli import main
from staleflow_trainer.report.metrics import REQUIRED_KEYS, read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.sim, pytest.mark.timeout(900)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS, BATCH, GROUP, ETA = 3, 8, 4, 2  # sim-tiny.yaml: B = 8, n = 4, eta = 2
OVERRIDES = [
    f"trainer.steps={STEPS}",
    "rollout.num_instances=2",
    "sim.total_gpus=4",
    "sim.train_gpus=2",
    "sim.workload.response_len_median=8",
    "run.checkpoint_every=0",
    "metrics.tensorboard=false",
    "metrics.progress_bar=false",
]
# keys both commands write besides the contract's REQUIRED_KEYS (metrics.py's conventions)
SHARED_KEYS = {
    "staleness_hist",
    "tokens",
    "time_s",
    "train_s",
    "instance_busy_frac",
    "syncs",
    "migrations",
    "interrupts",
    "aborts",
    "queue_depth",
}


def _run(command: str, run_dir: Path) -> dict[str, Any]:
    rc = main([command, str(EXAMPLES / "sim-tiny.yaml"), f"run_dir={run_dir}", *OVERRIDES])
    assert rc == 0, f"staleflow {command} exited {rc}"
    return {
        "metrics": read_jsonl(run_dir / "metrics.jsonl"),
        "summary": json.loads((run_dir / "summary.json").read_text()),
    }


@pytest.fixture(scope="module")
def runs(
    ray_session: None, tmp_path_factory: pytest.TempPathFactory, engine_required: Any
) -> dict[str, dict[str, Any]]:
    engine_required("sim")
    return {
        "simulate": _run("simulate", tmp_path_factory.mktemp("simulate")),
        "train": _run("train", tmp_path_factory.mktemp("train_sim")),
    }


def test_steps_and_versions_agree(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["train"]["summary"]["steps_done"] == STEPS
    assert runs["train"]["summary"]["version"] == STEPS
    assert runs["simulate"]["summary"]["steps"] == STEPS
    for name, run in runs.items():
        rows = run["metrics"]
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), name
        assert [r["version"] for r in rows] == list(range(1, STEPS + 1)), name


def test_each_step_consumes_one_batch_within_eta(runs: dict[str, dict[str, Any]]) -> None:
    for name, run in runs.items():
        for r in run["metrics"]:
            assert sum(r["staleness_hist"].values()) == BATCH * GROUP, (name, r["step"])
            assert 0 <= r["max_staleness"] <= ETA, (name, r["step"])
            assert max(int(s) for s in r["staleness_hist"]) == r["max_staleness"], name


def test_ledgers_balance_with_the_same_consumed_count(runs: dict[str, dict[str, Any]]) -> None:
    consumed = STEPS * BATCH * GROUP
    train = runs["train"]["summary"]["ledger"]
    assert train["problems"] == []
    assert train["consumed"] == consumed
    assert (
        train["consumed"] + train["in_flight"] + train["waiting_consume"] + train["dropped"]
        == train["trajectories"]
    )
    # the simulator's ledger check raises on any disagreement with the protocol; its summary
    # carries the per-state counts only when it passed
    sim = runs["simulate"]["summary"]["ledger"]
    assert sim["consumed"] == consumed
    assert sim["dropped"] == train["dropped"] == 0  # no filter, no redundancy in this config


def test_same_metrics_keys(runs: dict[str, dict[str, Any]]) -> None:
    wanted = set(REQUIRED_KEYS) | SHARED_KEYS
    for name, run in runs.items():
        for r in run["metrics"]:
            missing = wanted - set(r)
            assert not missing, f"{name} step {r['step']} lacks {sorted(missing)}"
