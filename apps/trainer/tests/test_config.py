from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from staleflow_trainer.config import (
    AppConfig,
    TrainerConfig,
    dump_config,
    load_config,
    parse_override,
)
from staleflow_trainer.config_sim import base_cost_model
from staleflow_trainer.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _err(overrides: list[str], path: str | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value


def test_defaults_and_contract_overrides() -> None:
    cfg = load_config(None, ["run_dir=/tmp/somewhere", "trainer.steps=7"])
    assert cfg.run.run_dir == "/tmp/somewhere"
    assert cfg.run_dir == Path("/tmp/somewhere")
    assert cfg.trainer.steps == 7
    assert cfg.trainer.clip_low == 0.2 and cfg.trainer.clip_high == 0.28


def test_override_values_are_yaml_scalars() -> None:
    cfg = load_config(
        None,
        [
            "trainer.lr=3e-4",
            "trainer.use_tis=false",
            "protocol.eta=unbounded",
            "coordinator.policy=all-vanilla",
            "ray.num_cpus=8",
            "trainer.betas=[0.9, 0.95]",
            "rollout.sampling.temperature=1",
        ],
    )
    assert cfg.trainer.lr == pytest.approx(3e-4)
    assert cfg.trainer.use_tis is False
    assert cfg.protocol.eta == "unbounded"
    assert cfg.ray.num_cpus == 8
    assert cfg.trainer.betas == (0.9, 0.95)
    assert isinstance(cfg.rollout.sampling.temperature, float)
    assert parse_override("a.b=") == ("a.b", "")


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.learning_rate=1", "trainer.learning_rate"),
        ("nosuch.key=1", "nosuch"),
        ("rollout.sampling.temp=1", "rollout.sampling.temp"),
        ("trainer.lr.x=1", "trainer.lr.x"),
    ],
)
def test_unknown_keys_name_the_full_key(override: str, key: str) -> None:
    e = _err([override])
    assert e.key == key
    assert key in str(e)
    assert e.allowed


def test_unknown_key_in_file(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("trainer:\n  steps: 3\n  stpes: 4\n")
    e = _err([], str(p))
    assert e.key == "trainer.stpes"
    assert "steps" in (e.allowed or "")


@pytest.mark.parametrize(
    ("override", "key", "allowed_part"),
    [
        ("trainer.steps=1.5", "trainer.steps", "integer"),
        ("trainer.steps=true", "trainer.steps", "integer"),
        ("trainer.lr=fast", "trainer.lr", "number"),
        ("rollout.backend=tgi", "rollout.backend", "'vllm'"),
        ("trainer.use_tis=1", "trainer.use_tis", "true/false"),
        ("coordinator.policy=greedy", "coordinator.policy", "'staleflow'"),
        ("protocol.eta=lots", "protocol.eta", "'unbounded'"),
    ],
)
def test_wrong_types(override: str, key: str, allowed_part: str) -> None:
    e = _err([override])
    assert e.key == key
    assert allowed_part in (e.allowed or "")


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("protocol.eta=-1", "protocol.eta"),
        ("coordinator.theta=0", "coordinator.theta"),
        ("coordinator.theta=1.5", "coordinator.theta"),
        ("coordinator.sync_kv_threshold=1.2", "coordinator.sync_kv_threshold"),
        ("coordinator.migration_ratio=1", "coordinator.migration_ratio"),
        ("trainer.clip_low=1.0", "trainer.clip_low"),
        ("trainer.tis_cap=0.5", "trainer.tis_cap"),
        ("rollout.sampling.top_p=0", "rollout.sampling.top_p"),
        ("protocol.batch_size=0", "protocol.batch_size"),
        ("trainer.lr=0", "trainer.lr"),
    ],
)
def test_out_of_range(override: str, key: str) -> None:
    e = _err([override])
    assert e.key == key
    assert str(e).startswith(key)


def test_batch_not_divisible() -> None:
    e = _err(["protocol.batch_size=3", "protocol.group_size=3", "trainer.mini_batches=2"])
    assert e.key == "trainer.mini_batches"
    assert "9" in str(e)
    e = _err(["trainer.micro_batch_size=5"])  # 64 samples
    assert e.key == "trainer.micro_batch_size"


def test_more_instances_than_resources() -> None:
    e = _err(["ray.num_cpus=2", "rollout.num_instances=3"])
    assert e.key == "rollout.num_instances"
    assert "ray.num_cpus=2" in str(e)
    e = _err(
        ["rollout.backend=sim", "rollout.num_instances=5", "sim.rollout_gpus=4", "sim.total_gpus=8"]
    )
    assert e.key == "rollout.num_instances"
    e = _err(["sim.rollout_gpus=4", "sim.train_gpus=4", "sim.total_gpus=6"])
    assert e.key == "sim.rollout_gpus"


def test_cross_field_rules() -> None:
    assert _err(["rollout.sampling.max_new_tokens=200"]).key == "rollout.sampling.max_new_tokens"
    assert _err(["model.tiny.num_heads=4"]).key == "model.tiny.num_heads"
    assert _err(["param_server.bind_host=0.0.0.0"]).key == "param_server.auth_token"
    load_config(None, ["param_server.bind_host=0.0.0.0", "param_server.auth_token=s3cret"])
    assert _err(["sim.cost_model=custom"]).key == "sim.k1"
    assert _err(["coordinator.cost_model=fast"]).key == "coordinator.cost_model"
    # eta unbounded: only with a greedy-sync policy that admits by the protocol alone
    for policy in ("sync", "one-step", "coarse-async", "staleflow", "vanilla-routing"):
        e = _err([f"coordinator.policy={policy}", "protocol.eta=unbounded"])
        assert e.key == "coordinator.policy" and "all-vanilla" in (e.allowed or "")
    for policy in ("all-vanilla", "vanilla-sync"):
        load_config(None, [f"coordinator.policy={policy}", "protocol.eta=unbounded"])
    e = _err(
        ["coordinator.policy=all-vanilla", "protocol.eta=unbounded", "protocol.batch_redundancy=2"]
    )
    assert e.key == "protocol.batch_redundancy"
    assert (
        _err(["protocol.unbounded_inflight_batches=0"]).key == "protocol.unbounded_inflight_batches"
    )


def test_section_and_malformed_overrides() -> None:
    assert _err(["trainer=5"]).key == "trainer"
    assert _err(["trainer.steps"]).allowed == "key=value"


def test_file_errors(tmp_path: Path) -> None:
    assert _err([], str(tmp_path / "missing.yaml")).key == "<file>"
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    assert _err([], str(p)).key == "<root>"
    p.write_text("trainer: 5\n")
    assert _err([], str(p)).key == "trainer"


def test_empty_section_means_defaults(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("trainer:\nrun:\n  seed: 3\n")
    cfg = load_config(p)
    assert cfg.trainer == TrainerConfig() and cfg.run.seed == 3


def test_direct_construction_validates() -> None:
    with pytest.raises(ConfigError) as info:
        TrainerConfig(lr=-1.0)
    assert info.value.key == "trainer.lr"


def test_dump_round_trip(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "trainer.steps=3",
            "protocol.eta=unbounded",
            "coordinator.policy=all-vanilla",
            "run_dir=/x",
        ],
    )
    out = dump_config(cfg, tmp_path / "resolved.yaml")
    again = load_config(out)
    assert again == cfg
    assert yaml.safe_load(out.read_text())["run"]["run_dir"] == "/x"


def test_evolve() -> None:
    cfg = AppConfig()
    assert cfg.evolve("trainer.steps=2").trainer.steps == 2
    assert cfg.trainer.steps == 20  # unchanged


@pytest.mark.parametrize(
    "name", ["tiny.yaml", "sim-tiny.yaml", "sim-paper-30b-a3b.yaml", "sim-paper-30b-a3b-40k.yaml"]
)
def test_examples_load(name: str) -> None:
    cfg = load_config(EXAMPLES / name, ["run_dir=/tmp/r", "trainer.steps=2"])
    assert cfg.trainer.steps == 2


def test_paper_preset_matches_the_published_setup() -> None:
    cfg = load_config(EXAMPLES / "sim-paper-30b-a3b.yaml")
    assert (cfg.protocol.batch_size, cfg.protocol.group_size) == (64, 16)
    assert (cfg.sim.total_gpus, cfg.sim.rollout_gpus, cfg.sim.train_gpus) == (64, 32, 32)
    assert cfg.rollout.sampling.max_new_tokens == 20480
    assert base_cost_model(cfg).name == "qwen3-30b-a3b-h20"  # the router's model, for the engines
    assert cfg.sim.kv_capacity_tokens is None  # derived from the model's geometry


def test_unquoted_off_means_off() -> None:
    """YAML reads an unquoted ``off`` as false; the fields that accept ``off`` take it so."""
    cfg = AppConfig().evolve("sim.max_num_batched_tokens=off", "coordinator.sync_max_lag=off")
    assert cfg.sim.max_num_batched_tokens == "off"
    assert cfg.coordinator.sync_max_lag == "off"
    with pytest.raises(ConfigError, match=r"sim\.gpu_memory_utilization"):
        AppConfig().evolve("sim.gpu_memory_utilization=off")
