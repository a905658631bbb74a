"""Careless input gets the CLI's one-line error, before anything is started or written: an
unusable run directory, text that is not UTF-8, a damaged checkpoint, an unknown policy, and
a simulator error names keys the user can set."""

from __future__ import annotations

import json
import os
from pathlib import Path

import attrs
import pytest

from staleflow_trainer.actors.reconcile import STATE_FILE, TRAINER_FILE, TS_FILE
from staleflow_trainer.atomic_files import atomic_write_bytes
from staleflow_trainer.cli import main
from staleflow_trainer.config import load_config, to_dict
from staleflow_trainer.data import load_dataset
from staleflow_trainer.errors import CheckpointError, DataError
from staleflow_trainer.sim.spec import SimSpec, spec_from_app_config
from trajectory_server import TrajectoryStore
from trajectory_server.checkpoint import save_checkpoint

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
SIM = str(EXAMPLES / "sim-tiny.yaml")


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_run_dir_that_is_or_lies_under_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    run_dir = f if where == "file" else f / "run"
    over = [f"run_dir={run_dir}", "trainer.steps=2"]
    for argv in (["simulate", SIM, *over], ["compare", SIM, *over, "--policies", "staleflow"]):
        assert main(argv) == 2
        assert "config error at run.run_dir" in _one_line_error(capsys)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_read_only_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert main(["simulate", SIM, f"run_dir={ro}", "trainer.steps=2"]) == 2
        assert "run.run_dir" in _one_line_error(capsys)
    finally:
        ro.chmod(0o755)


def test_non_utf8_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(b"run:\n  run_dir: caf\xe9\n")
    assert main(["config", str(cfg)]) == 2
    err = _one_line_error(capsys)
    assert str(cfg) in err and "UTF-8" in err


def test_non_utf8_dataset_names_file_and_line(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl: line 2 is not UTF-8") as e:
        load_dataset(data, answer_key="answer")
    assert e.value.path == str(data)


def _checkpoint(d: Path, *, rows: int = 8) -> Path:
    d.mkdir(parents=True)
    atomic_write_bytes(d / STATE_FILE, json.dumps({"feed": {"rows": rows}}).encode())
    atomic_write_bytes(d / TRAINER_FILE, b"weights")
    save_checkpoint(TrajectoryStore(), d / TS_FILE)
    return d


@pytest.mark.fault
def test_a_damaged_checkpoint_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from staleflow_trainer.runtime.prepare import verify_checkpoint

    verify_checkpoint(_checkpoint(tmp_path / "ok"), rows=8)
    bad = _checkpoint(tmp_path / "trainer")
    (bad / TRAINER_FILE).write_bytes(b"weightz")
    with pytest.raises(CheckpointError, match=r"trainer\.pt fails its SHA-256"):
        verify_checkpoint(bad, rows=8)
    bad = _checkpoint(tmp_path / "ts")
    (bad / TS_FILE).write_bytes((bad / TS_FILE).read_bytes()[:-3])
    with pytest.raises(CheckpointError, match=r"trajectory_store\.bin"):
        verify_checkpoint(bad, rows=8)
    with pytest.raises(
        CheckpointError, match=r"dataset of 8 prompts; the configured dataset has 5"
    ):
        verify_checkpoint(_checkpoint(tmp_path / "rows"), rows=5)


def test_compare_with_an_unknown_policy_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "cmp"
    assert main(["compare", SIM, f"run_dir={run_dir}", "--policies", "bogus"]) == 2
    assert "--policies" in _one_line_error(capsys)
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("command", "flag", "value"),
    [("compare", "--policies", ","), ("compare", "--seeds", ""), ("plan", "--etas", ""),
     ("plan", "--fractions", " ")],
)  # fmt: skip
def test_a_list_option_given_empty_is_refused_not_read_as_its_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, flag: str, value: str
) -> None:
    run_dir = tmp_path / "out"
    assert main([command, SIM, f"run_dir={run_dir}", flag, value]) == 2
    assert f"config error at {flag}" in _one_line_error(capsys)
    assert not run_dir.exists()


def test_overrides_may_follow_a_commands_options(tmp_path: Path) -> None:
    """``plan CONFIG --etas 1 KEY=VALUE`` applies the overrides after the options (argparse
    alone ends them at the first option and refuses the rest)."""
    run_dir = tmp_path / "plan"
    argv = ["plan", SIM, "--etas", "1", "--fractions", "0.5", "trainer.steps=3"]
    assert main([*argv, f"run.run_dir={run_dir}"]) == 0
    assert json.loads((run_dir / "plan.json").read_text())["results"]


def test_a_stray_word_after_the_options_is_still_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "plan"
    with pytest.raises(SystemExit) as exc:
        main(["plan", SIM, "--etas", "1", "steps", f"run.run_dir={run_dir}"])
    assert exc.value.code == 2
    assert "unrecognized arguments: steps" in capsys.readouterr().err
    assert not run_dir.exists()


def _keys(d: dict[str, object], prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        out.add(prefix + k)
        if isinstance(v, dict):
            out |= _keys(v, prefix + k + ".")
    return out


def test_every_simulator_field_names_a_real_config_key() -> None:
    from staleflow_trainer.sim.spec import config_key

    keys = _keys(to_dict(load_config(None)))
    # built from many keys by config_sim, whose errors name those keys themselves
    derived = {"engine", "router_cost", "speed_factors", "lengths", "megatron"}
    missing = {a.name: config_key(a.name) for a in attrs.fields(SimSpec)
               if a.name not in derived and config_key(a.name) not in keys}  # fmt: skip
    assert not missing


def test_simulate_with_an_engine_config_names_real_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """examples/tiny.yaml is written for vLLM (16-token prompts); simulating it fails on the
    simulator's default prompt length, and the error names keys that exist."""
    keys = _keys(to_dict(load_config(None)))
    cfg = load_config(EXAMPLES / "tiny.yaml", [f"run_dir={tmp_path / 'r'}"])
    with pytest.raises(Exception) as e:
        spec_from_app_config(cfg)
    assert getattr(e.value, "key", None) in keys
    assert main(["simulate", str(EXAMPLES / "tiny.yaml"), f"run_dir={tmp_path / 'r'}"]) == 2
    err = _one_line_error(capsys)
    assert "sim.workload.prompt_len" in err and "data.max_prompt_len" in err
    assert "sim.prompt_len_max" not in err


def test_simulate_routes_by_a_fitted_cost_model_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``coordinator.cost_model`` as a fitted file: read when the config loads (a missing one
    is the one-line error, nothing written), then the simulator's router and engines use it."""
    from engine_adapters.cost_model import PRESETS
    from staleflow_trainer.config_sim import engine_config
    from staleflow_trainer.sim.shell import Simulation

    run_dir = tmp_path / "r"
    missing = tmp_path / "missing.json"
    assert main(["simulate", SIM, f"run_dir={run_dir}", f"coordinator.cost_model={missing}"]) == 2
    assert "coordinator.cost_model" in _one_line_error(capsys)
    assert not run_dir.exists()

    fitted = attrs.evolve(PRESETS["qwen-7b-h20"], name="fitted", k3=5e-4, k4=0.004)
    fitted.save(tmp_path / "cm.json")
    over = [f"run_dir={run_dir}", f"coordinator.cost_model={tmp_path / 'cm.json'}"]
    cfg = load_config(SIM, [*over, "trainer.steps=2"])
    assert Simulation(cfg).core.config.coordinator.cost_model == fitted
    assert spec_from_app_config(cfg).router_cost == fitted
    assert engine_config(cfg).cost == fitted  # sim.cost_model: coordinator
    assert main(["simulate", SIM, *over, "trainer.steps=2"]) == 0
    assert (run_dir / "metrics.jsonl").is_file()
