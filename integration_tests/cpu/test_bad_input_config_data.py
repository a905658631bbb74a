"""Bad config and bad data at the app's front door: ``staleflow train`` and
``Deployment.start`` refuse them with an error naming the key / row and field, before Ray or
any actor starts, and nothing already in the run directory (a checkpoint) is touched.

The per-key config rules and the dataset loaders have unit tests in ``apps/trainer/tests``
(``test_config.py``, ``test_data.py``); these cover what those do not: the CLI exit path, the
gaps (replication vs workers, thresholds, nested unknown keys, types), and bad data stopping a
deployment before it starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from staleflow_trainer.config import load_config
from staleflow_trainer.errors import ConfigError, DataError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = EXAMPLES / "tiny.yaml"


@pytest.mark.parametrize(
    ("override", "key", "hint"),
    [
        ("rollout.sampling.temprature=1", "rollout.sampling.temprature", "unknown"),
        ("protocol.eta=-1", "protocol.eta", ">= 0"),
        ("protocol.eta=soon", "protocol.eta", "unbounded"),
        ("protocol.stuck_threshold=-2", "protocol.stuck_threshold", ">= 0"),
        ("coordinator.route_kv_limit=1.5", "coordinator.route_kv_limit", "1"),
        ("coordinator.sync_kv_threshold=-0.1", "coordinator.sync_kv_threshold", "0"),
        ("trainer.dynamic_sampling=maybe", "trainer.dynamic_sampling", "true/false"),
        ("rollout.num_instances=two", "rollout.num_instances", "int"),
        ("param_server.replication=3", "param_server.replication", "<= 1"),
        ("param_server.push_retry_s=-1", "param_server.push_retry_s", ">= 0"),
        ("reward.retries=-1", "reward.retries", ">= 0"),
    ],
)
def test_config_errors_name_the_key(override: str, key: str, hint: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [override])
    assert info.value.key == key
    assert key in str(info.value)
    assert hint in str(info.value) or hint in str(info.value.allowed)


def test_cli_refuses_bad_config_before_starting_anything(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "staleflow_trainer.cli", "train", str(TINY),
         f"run_dir={run_dir}", "protocol.batch_size=3", "protocol.group_size=3",
         "trainer.mini_batches=2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "trainer.mini_batches" in proc.stderr + proc.stdout
    assert not run_dir.exists()  # nothing created, no Ray started


def _write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("rows", "row", "field"),
    [
        ([{"prompt": "1+1=", "ground_truth": "2"}, {"prompt": "2+2="}], 1,
         "reward_model.ground_truth"),
        ([{"prompt": "1+1=", "ground_truth": "2"}, {"ground_truth": "4"}], 1, "prompt"),
        ([{"prompt": "", "ground_truth": "2"}], 0, "prompt"),
        ([{"prompt": "1+1=", "ground_truth": "2"}, {"prompt": "9" * 200, "ground_truth": "1"}],
         1, "prompt"),
    ],
)  # fmt: skip
def test_bad_data_stops_the_deployment_before_it_starts(
    tmp_path: Path, rows: list[dict[str, object]], row: int, field: str
) -> None:
    import ray

    from staleflow_trainer.runtime.wiring import Deployment

    run_dir = tmp_path / "run"
    old = run_dir / "checkpoints" / "step_000002"
    old.mkdir(parents=True)
    (old / "trainer.pt").write_bytes(b"an earlier run's checkpoint")
    data = _write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = load_config(
        TINY,
        [f"run_dir={run_dir}", f"data.path={data}", "run.resume=never", "data.max_prompt_len=16"],
    )
    with pytest.raises(DataError) as info:
        Deployment(cfg).start()
    assert info.value.row == row
    assert info.value.field == field
    assert f"row {row}" in str(info.value)
    assert info.value.path == str(data) and str(data) in str(info.value)  # names the file
    assert not ray.is_initialized()
    assert (old / "trainer.pt").read_bytes() == b"an earlier run's checkpoint"
