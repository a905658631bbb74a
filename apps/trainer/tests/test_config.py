from __future__ import annotations

import math
import typing
from pathlib import Path

import attrs
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
from staleflow_trainer.sim.spec import spec_from_app_config

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


@pytest.mark.parametrize(
    ("override", "key", "allowed_part"),
    [
        (["coordinator.policy=one-step", "protocol.eta=3"], "protocol.eta", "1 with policy"),
        (["coordinator.policy=sync", "protocol.eta=2"], "protocol.eta", "0 with policy"),
        (
            ["protocol.batch_size=8", "protocol.stuck_threshold=8"],
            "protocol.stuck_threshold",
            "< batch_size (8)",
        ),
    ],
)
def test_protocol_settings_the_policy_or_the_batch_rule_out(
    override: list[str], key: str, allowed_part: str
) -> None:
    """Refused when the config is read, for the deployment as for the simulator (the
    coordinator and the protocol would refuse them only once a run starts, naming their own
    fields)."""
    e = _err(override)
    assert e.key == key
    assert allowed_part in (e.allowed or "")


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
    # the simulated instances and the trainer fit in the GPU budget
    e = _err(
        ["rollout.backend=sim", "rollout.num_instances=5", "sim.train_gpus=4", "sim.total_gpus=8"]
    )
    assert e.key == "rollout.num_instances" and "sim.total_gpus=8" in str(e)
    assert str(e.allowed).startswith("<= 4")
    # the colocated sync policy's instances cover the budget exactly
    e = _err(["rollout.backend=sim", "coordinator.policy=sync", "protocol.eta=0",
              "rollout.num_instances=2", "sim.total_gpus=8"])  # fmt: skip
    assert e.key == "rollout.num_instances" and str(e.allowed).startswith("8")
    # a removed key says what replaced it
    e = _err(["sim.rollout_gpus=4"])
    assert e.key == "sim.rollout_gpus" and "rollout.num_instances" in str(e)
    # every attached SGLang server needs an instance (instance i takes server i mod count)
    urls = "rollout.sglang_url=http://127.0.0.1:1,http://127.0.0.1:2,http://127.0.0.1:3"
    e = _err(["rollout.backend=sglang", urls])
    assert e.key == "rollout.num_instances" and e.allowed == ">= 3 (or list fewer servers)"
    assert "3 servers" in str(e)
    load_config(None, ["rollout.backend=sglang", urls, "rollout.num_instances=3"])
    load_config(None, ["rollout.backend=sglang", urls, "rollout.num_instances=4"])


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
    "name",
    [
        "tiny.yaml",
        "sim-tiny.yaml",
        "sim-paper-30b-a3b.yaml",
        "sim-paper-30b-a3b-40k.yaml",
        "sim-paper-30b-a3b-rollout-bound.yaml",
        "sim-paper-7b.yaml",
        "sim-paper-14b.yaml",
    ],
)
def test_examples_load(name: str) -> None:
    cfg = load_config(EXAMPLES / name, ["run_dir=/tmp/r", "trainer.steps=2", "sim.warmup_steps=1"])
    assert cfg.trainer.steps == 2


def test_a_warmup_that_leaves_no_step_to_measure_is_refused() -> None:
    """The paper presets leave 6 warm-up steps out of their throughput: a 5-step run of one is
    refused, naming the key, where the warm-up used to be cut to 4 without a word; null is 2,
    or fewer in a run too short for that."""
    preset = EXAMPLES / "sim-paper-30b-a3b.yaml"
    e = _err(["trainer.steps=5"], str(preset))
    assert e.key == "sim.warmup_steps"
    assert "< 5" in (e.allowed or "")
    for steps, warmup in ((5, 2), (2, 1), (1, 0)):
        over = [f"trainer.steps={steps}", "sim.warmup_steps=null"]
        cfg = load_config(preset, over)
        assert spec_from_app_config(cfg).warmup_steps == warmup


def test_paper_preset_matches_the_published_setup() -> None:
    cfg = load_config(EXAMPLES / "sim-paper-30b-a3b.yaml")
    assert (cfg.protocol.batch_size, cfg.protocol.group_size) == (64, 16)
    assert (cfg.sim.total_gpus, cfg.rollout.num_instances, cfg.sim.train_gpus) == (64, 32, 32)
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


def test_coordinator_strategy_errors_say_off_where_the_file_takes_off() -> None:
    """The package spells a switched-off strategy None; the message names the YAML value."""
    e = _err(["coordinator.migration_min_speedup=0.5"])
    assert e.key == "coordinator.migration_min_speedup"
    assert str(e) == (
        "coordinator.migration_min_speedup must be a finite number >= 1 or off, got 0.5"
    )
    assert e.allowed == "a finite number >= 1 or off"
    e = _err(["coordinator.migration_min_running=0"])  # takes no off: none offered
    assert str(e) == "coordinator.migration_min_running must be an integer >= 1, got 0"
    e = _err(["coordinator.cost_model=/nonexistent/cost.json"])  # the package's detail kept
    assert str(e).startswith("coordinator.cost_model must be ")
    assert "cannot read cost model '/nonexistent/cost.json'" in str(e)


# ---------------------------------------------------------------------------------------------
# absurd protocol sizes (admission would never stop)


@pytest.mark.parametrize(
    ("override", "key", "allowed_part"),
    [
        ("protocol.eta=1000000000000", "protocol.eta", "<= 64"),
        ("protocol.eta=65", "protocol.eta", "<= 64"),
        ("protocol.batch_size=100000000", "protocol.batch_size", "<= 16384"),
        ("protocol.group_size=100000", "protocol.group_size", "<= 4096"),
        ("protocol.batch_redundancy=100000000", "protocol.batch_redundancy", "<= 16384"),
        (
            "protocol.unbounded_inflight_batches=1000000",
            "protocol.unbounded_inflight_batches",
            "65",
        ),
    ],
)
def test_absurd_protocol_sizes_are_refused(override: str, key: str, allowed_part: str) -> None:
    e = _err([override])
    assert e.key == key and str(e).startswith(key)
    assert allowed_part in (e.allowed or "")


def test_admission_ahead_of_training_is_capped() -> None:
    # each value within its own range, together 65 x 16384 x 8 = 8.5M trajectories in flight
    e = _err(["protocol.eta=64", "protocol.batch_size=16384"])
    assert e.key == "protocol.batch_size"
    assert "8,519,680 trajectories" in str(e) and "1,048,576" in str(e)
    assert e.allowed == "batch_size + batch_redundancy <= 2016 with these eta and group sizes"
    load_config(None, ["protocol.eta=64", "protocol.batch_size=2016"])  # the bound itself
    e = _err(["protocol.eta=unbounded", "coordinator.policy=all-vanilla",
              "protocol.unbounded_inflight_batches=65", "protocol.batch_size=16384"])  # fmt: skip
    assert e.key == "protocol.batch_size"
    e = _err(["protocol.group_size=4000", "protocol.group_redundancy=100"])
    assert e.key == "protocol.group_redundancy" and e.allowed == "<= 96"
    # the published setups are far inside the bounds
    cfg = load_config(EXAMPLES / "sim-paper-30b-a3b.yaml", ["protocol.eta=10"])
    assert cfg.protocol.eta == 10


# ---------------------------------------------------------------------------------------------
# override and YAML quirks


def test_underscored_integers_stay_integers() -> None:
    cfg = load_config(None, ["trainer.steps=1_000", "protocol.batch_size=1_024"])
    assert cfg.trainer.steps == 1000 and isinstance(cfg.trainer.steps, int)
    assert cfg.protocol.batch_size == 1024
    assert parse_override("trainer.lr=1e-3") == ("trainer.lr", 0.001)  # still a number
    e = _err(["trainer.steps=1e3"])  # a float for an integer key: refused, not truncated
    assert e.key == "trainer.steps" and "integer" in (e.allowed or "")


@pytest.mark.parametrize(
    "override",
    ["run_dir=", "run.run_dir=", "run.run_dir=' '", "reward.fn=", "param_server.bind_host="],
)
def test_an_empty_path_or_name_is_refused(override: str) -> None:
    key = {"run_dir": "run.run_dir"}.get(override.split("=")[0], override.split("=")[0])
    e = _err([override])
    assert e.key == key and "must not be empty" in str(e)


def test_an_empty_run_dir_in_the_file_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("run:\n  run_dir: ''\n")
    assert _err([], str(p)).key == "run.run_dir"


@pytest.mark.parametrize(
    ("text", "key", "line"),
    [
        ("trainer:\n  steps: 3\n  lr: 0.1\n  steps: 5\n", "trainer.steps", 4),
        ("trainer:\n  steps: 3\nrun:\n  seed: 1\ntrainer:\n  lr: 0.1\n", "trainer", 5),
        ("rollout:\n  sampling:\n    top_p: 0.9\n    top_p: 1.0\n", "rollout.sampling.top_p", 4),
        ("run_dir: a\nrun:\n  run_dir: b\n", "run.run_dir", None),
    ],
)
def test_a_key_given_twice_is_refused(tmp_path: Path, text: str, key: str, line: int) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    e = _err([], str(p))
    assert e.key == key
    if line is not None:
        assert f"c.yaml:{line}: duplicate key {key!r}" in str(e)


@pytest.mark.parametrize("override", ["trainer={}", "trainer={steps: 3}", "rollout.sampling={}"])
def test_assigning_a_mapping_to_a_section_is_refused(tmp_path: Path, override: str) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("trainer:\n  steps: 3\n  lr: 0.01\n")
    e = _err([override], str(p))
    assert e.key == override.split("=")[0]
    assert "is a section" in str(e) and "KEY=VALUE" in str(e)
    assert load_config(p, ["trainer.steps=4"]).trainer.lr == 0.01  # the way to set one key


# ---------------------------------------------------------------------------------------------
# non-finite numbers and the cost model


def _float_keys(cls: type = AppConfig, prefix: str = "") -> list[str]:
    out = []
    for a in attrs.fields(cls):
        key = f"{prefix}{a.name}"
        if attrs.has(a.type):
            out += _float_keys(a.type, key + ".")
        elif float in typing.get_args(a.type) or a.type is float:
            out.append(key)
    return out


FLOAT_KEYS = _float_keys()


def test_the_float_fields_include_the_ones_that_took_inf() -> None:
    named = {"trainer.lr", "trainer.tis_cap", "coordinator.migration_ratio",
             "coordinator.snapshot_interval_s", "reward.timeout_s"}  # fmt: skip
    assert named <= set(FLOAT_KEYS) and len(FLOAT_KEYS) > 40


@pytest.mark.parametrize("value", ["inf", "-inf", ".inf", "nan", ".nan", "1e400"])
def test_every_float_field_refuses_non_finite_values(value: str) -> None:
    for key in FLOAT_KEYS:
        e = _err([f"{key}={value}"])
        assert e.key == key, f"{key}={value}: {e}"
        assert "finite" in str(e), f"{key}={value}: {e}"
    assert _err([f"trainer.betas=[0.9, {value}]"]).key.startswith("trainer.betas")


def test_non_finite_values_are_refused_in_the_file_and_in_code(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("reward:\n  timeout_s: .inf\n")
    assert _err([], str(p)).key == "reward.timeout_s"
    with pytest.raises(ConfigError) as info:
        TrainerConfig(tis_cap=math.inf)
    assert info.value.key == "trainer.tis_cap"
    with pytest.raises(ConfigError) as info:
        TrainerConfig(lr=10**400)  # an int beyond float range
    assert info.value.key == "trainer.lr"


@pytest.mark.parametrize("backend", ["vllm", "sim"])
def test_a_cost_model_file_is_read_when_the_config_is_loaded(tmp_path: Path, backend: str) -> None:
    base = [f"rollout.backend={backend}"]
    if backend == "sim":
        base += ["sim.total_gpus=3"]
    e = _err([*base, f"coordinator.cost_model={tmp_path / 'missing.json'}"])
    assert e.key == "coordinator.cost_model" and "missing.json" in str(e)
    bad = tmp_path / "bad.json"
    bad.write_text('{"k1": 1e-8}')
    e = _err([*base, f"coordinator.cost_model={bad}"])
    assert e.key == "coordinator.cost_model" and "k2" in str(e)
    if backend == "sim":
        e = _err([*base, f"sim.cost_model={tmp_path / 'missing.json'}"])
        assert e.key == "sim.cost_model" and "missing.json" in str(e)


def test_a_setting_of_another_trainer_model_or_length_kind_is_refused() -> None:
    """A setting that applies under one trainer model or length distribution would change
    nothing under another: refused by name, with what it applies with; null is its default."""
    e = _err(["sim.active_params=7e9"])  # the default trainer model is linear
    assert e.key == "sim.active_params" and "'flops'" in str(e) and "null" in str(e.allowed)
    e = _err(["sim.trainer_model=megatron", "sim.trainer_time_a_s=2"])
    assert e.key == "sim.trainer_time_a_s" and "'linear'" in str(e)
    e = _err(["sim.workload.alpha=2"])  # lognormal lengths by default
    assert e.key == "sim.workload.alpha" and "'power_law'" in str(e)
    e = _err(["sim.workload.trace_path=/tmp/x.jsonl"])
    assert e.key == "sim.workload.trace_path" and "'group_trace'" in str(e)
    cfg = load_config(None, ["sim.trainer_model=flops", "sim.mfu=0.4", "sim.workload.prompt_len=8"])
    spec = spec_from_app_config(cfg)
    assert (spec.mfu, spec.active_params, spec.trainer_time_a_s) == (0.4, 3e9, 0.5)
