"""Every decision setting reaches both shells — the simulator and the Ray deployment — or is
listed here as belonging to one of them, with the reason; and every other setting is
classified by what the simulator does with it.

Both shells build their control core from ``control.config.core_config(app_config)``; a
setting that changes that config reaches both. The few settings a shell reads itself (its cycle
period, its retry delay) must be read by both shells' code. A new field in the sections below
fails this test until it is classified.

Outside the protocol and coordinator sections:

* :data:`SIM_SPEC` — both shells run by it: the deployment reads it, and a change shows in the
  simulator's spec (checked here, one key at a time);
* :data:`SIM_CODE` — both shells' code reads it (outside the spec), named per shell;
* :data:`MODELLED` — a real component's setting (what is learned, which engine, where a
  process runs) that the simulator stands in for with the ``sim`` keys named beside it
  (checked to exist), so a user knows which knob moves the simulation instead;
* ``sim.*`` — the simulator's own model of the hardware and the workload: each one changes the
  simulator's spec (checked here, under the setting that makes it apply, where one is needed).

A new field there fails :func:`test_every_setting_is_classified` until it is put in one of
them.
"""

from __future__ import annotations

import typing
from pathlib import Path

import attrs
import pytest

from rollout_coordinator import PROFILES
from rollout_coordinator import CoordinatorConfig as PackageCoordinatorConfig
from staleflow_trainer.config import STRATEGY_FIELDS, AppConfig, load_config
from staleflow_trainer.control.config import core_config
from staleflow_trainer.sim.spec import spec_from_app_config

SRC = Path(__file__).resolve().parents[1] / "src" / "staleflow_trainer"
RAY_SHELL = [SRC / "actors" / "control.py", SRC / "actors" / "shell_io.py"]
SIM_SHELL = [SRC / "sim" / "shell.py", SRC / "sim" / "spec.py"]

#: a valid other value for each decision setting (the base is examples' defaults below)
CHANGES = {
    "protocol.batch_size": "6",
    "protocol.group_size": "6",
    "protocol.eta": "3",
    "protocol.batch_redundancy": "1",
    "protocol.group_redundancy": "1",
    "protocol.stuck_threshold": "2",
    "protocol.stuck_after_s": "9.5",
    "protocol.unbounded_inflight_batches": "5",
    "coordinator.policy": "vanilla-sync",
    "coordinator.profile": "paper",
    "coordinator.cost_model": "qwen-7b-h20",
    "coordinator.theta": "0.5",
    "coordinator.theta_slack": "0.1",
    "coordinator.route_kv_limit": "0.8",
    "coordinator.sync_kv_threshold": "0.6",
    "coordinator.migration_ratio": "7.0",
    "coordinator.migration_indicator": "running",
    "coordinator.migration_min_speedup": "off",
    "coordinator.sync_retries": "2",
    "trainer.steps": "7",
    "trainer.dynamic_sampling": "true",
    "trainer.max_filtered_in_row": "9",
    "trainer.stream_batch": "true",
    "run.checkpoint_every": "3",
    "run.seed": "5",
    "data.shuffle": "false",
}
#: settings a shell reads itself: the attribute both shells' code must read
SHELL_READ = {
    "coordinator.snapshot_interval_s": ".snapshot_interval_s",
}
#: settings that apply to one shell only, and why
ONE_SHELL = {
    "coordinator.sync_retry_backoff_s": "a real-time delay before retrying a failed sync; "
    "simulated instances never fail to sync",
    "coordinator.sync_timeout_s": "a real-time limit on a sync call; a simulated sync takes "
    "its modelled time and never hangs",
    "coordinator.call_timeout_s": "a real-time limit on a call to an instance; a simulated "
    "instance answers in modelled time and never hangs",
    "coordinator.poll_timeout_s": "a real-time limit on a poll of an instance; a simulated "
    "instance answers in modelled time and never hangs",
    "coordinator.instance_error_limit": "failed calls to a live instance; a simulated "
    "instance's calls never fail (its death is a fault the simulator injects)",
    "coordinator.generate_error_limit": "failed generations on a live instance; a "
    "simulated instance's generations never fail (its death is a fault the simulator injects)",
}
#: settings only meaningful with eta=unbounded (checked on such a config)
UNBOUNDED_ONLY = {"protocol.unbounded_inflight_batches"}
#: settings only meaningful with dynamic sampling on (checked on such a config)
DYNAMIC_SAMPLING_ONLY = {"trainer.max_filtered_in_row"}
BASE = ["protocol.eta=2", "protocol.stuck_threshold=1", "protocol.batch_size=4"]


def _fields(section: str) -> list[str]:
    cls = attrs.fields_dict(AppConfig)[section].type
    assert isinstance(cls, type)
    return [f"{section}.{f.name}" for f in attrs.fields(cls)]


def test_every_protocol_and_coordinator_setting_is_classified() -> None:
    strategy = {f"coordinator.{f}" for f in STRATEGY_FIELDS}
    for key in _fields("protocol") + _fields("coordinator"):
        assert key in CHANGES or key in SHELL_READ or key in ONE_SHELL or key in strategy, (
            f"{key}: classify it — a decision setting (CHANGES), read by both shells "
            "(SHELL_READ) or one shell's only (ONE_SHELL, with the reason)"
        )


@pytest.mark.parametrize("key", sorted(CHANGES))
def test_a_decision_setting_changes_the_core_both_shells_run(key: str) -> None:
    unbounded = ["protocol.eta=unbounded", "coordinator.policy=all-vanilla",
                 "protocol.stuck_threshold=0"]  # fmt: skip
    base = [*BASE, *unbounded] if key in UNBOUNDED_ONLY else BASE
    if key in DYNAMIC_SAMPLING_ONLY:
        base = [*base, "trainer.dynamic_sampling=true"]
    if key == "coordinator.policy" and key in CHANGES:
        base = [*base, "protocol.stuck_threshold=0"]
    a = core_config(load_config(None, base), rows=100)
    b = core_config(load_config(None, [*base, f"{key}={CHANGES[key]}"]), rows=100)
    assert a != b, f"{key} does not reach the control core"


@pytest.mark.parametrize("key", sorted(SHELL_READ))
def test_a_shell_setting_is_read_by_both_shells(key: str) -> None:
    attr = SHELL_READ[key]
    for name, files in (("ray", RAY_SHELL), ("sim", SIM_SHELL)):
        text = "".join(f.read_text() for f in files)
        assert attr in text, f"the {name} shell does not read {key}"


def test_every_coordinator_package_setting_can_be_set_in_the_app() -> None:
    """The app's ``coordinator`` section takes every field of the package's config: the
    strategy fields, and ``policy`` and ``cost_model`` as settings of their own."""
    app = set(attrs.fields_dict(attrs.fields_dict(AppConfig)["coordinator"].type))
    missing = set(attrs.fields_dict(PackageCoordinatorConfig)) - set(STRATEGY_FIELDS) - app
    assert not missing, f"add to STRATEGY_FIELDS and the app's coordinator section: {missing}"


@pytest.mark.parametrize("name", STRATEGY_FIELDS)
def test_a_strategy_setting_reaches_the_coordinator_of_both_shells(name: str) -> None:
    """Each strategy field is one of the coordinator package's own settings, and a value set in
    the app config is the value the core's coordinator runs with (both shells build the core
    from the same ``core_config``)."""
    assert name in attrs.fields_dict(PackageCoordinatorConfig)
    value = PROFILES["paper"].get(name)
    if value is None:  # no non-default value at hand: membership is what can be checked
        return
    text = str(value).lower() if isinstance(value, bool) else str(value)
    cc = core_config(load_config(None, [*BASE, f"coordinator.{name}={text}"]), rows=100)
    assert getattr(cc.coordinator, name) == value


@pytest.mark.parametrize("n", [1, 3])
def test_the_simulator_runs_rollout_num_instances(n: int) -> None:
    """``rollout.num_instances`` is the fleet in both shells: the Ray shell starts that many
    instances, the simulator that many engines (beside ``sim.train_gpus``, and the colocated
    sync on the same budget)."""
    from staleflow_trainer.sim.shell import Simulation
    from staleflow_trainer.sim.spec import with_policy

    cfg = load_config(
        None,
        [*BASE, f"rollout.num_instances={n}", "sim.train_gpus=2", "sim.workload.prompt_len=32"],
    )
    shell = Simulation(cfg)
    assert len(shell.engines) == n
    assert (shell.spec.rollout_gpus, shell.spec.total_gpus) == (n, n + 2)
    sync = Simulation(with_policy(cfg, "sync"))
    assert len(sync.engines) == n + 2 and sync.spec.total_gpus == n + 2


# ---- every other section -------------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
SIM_BASE = str(EXAMPLES / "sim-tiny.yaml")

#: settings of the run both shells read; a valid other value for each (on examples/sim-tiny)
SIM_SPEC = {
    "rollout.num_instances": "3",
    "rollout.max_running": "8",
    "rollout.max_model_len": "4096",
    "rollout.sampling.max_new_tokens": "512",
    "data.max_prompt_len": "256",
    "trainer.step_delay_s": "0.5",
    "metrics.timeline": "false",
    # in the control core too (CHANGES)
    "run.seed": "7",
    "trainer.steps": "9",
}
#: settings both shells' code reads outside the spec: what to find (an attribute, or the
#: function that reads them) in the Ray shell's files and in the simulator's
SIM_CODE = {
    "rollout.replace_lost": (".replace_lost", ["runtime/replacements.py", "runtime/deployment.py"],
                             ["sim/faults.py"]),
    "run.run_dir": (".run_dir", ["runtime/deployment.py"], ["simulate.py"]),
    "metrics.tensorboard": (".tensorboard", ["runtime/drive.py"], ["simulate.py"]),
    "metrics.progress_bar": (".progress_bar", ["runtime/drive.py"], ["simulate.py"]),
    "metrics.log_every": (".log_every", ["runtime/drive.py"], ["simulate.py"]),
    **{f"metrics.wandb.{k}": ("trackers_from_config", ["runtime/drive.py"], ["simulate.py"])
       for k in ("enabled", "project", "name", "mode")},
}  # fmt: skip
_TRAINS = "sim.trainer_model"  # what a training step costs in the simulator
#: real components' settings and the sim keys that model them in the simulator
MODELLED = {
    "run.keep_checkpoints": "sim.warmup_steps",  # no checkpoint files; measured steps instead
    "run.resume": "sim.warmup_steps",
    "run.coordinator_restarts": "sim.warmup_steps",
    "model.path": "sim.model",
    "model.dtype": "sim.model",
    "model.tiny.hidden_size": "sim.model",
    "model.tiny.intermediate_size": "sim.model",
    "model.tiny.num_layers": "sim.model",
    "model.tiny.num_heads": "sim.model",
    "model.tiny.num_kv_heads": "sim.model",
    "model.tiny.max_position_embeddings": "sim.model",
    "data.path": "sim.workload.prompt_len",
    "data.toy_task": "sim.workload.prompt_len",
    "data.toy_size": "sim.workload.prompt_len",
    "data.prompt_key": "sim.workload.prompt_len",
    "data.answer_key": "sim.workload.reward_mean",
    "data.apply_chat_template": "sim.workload.prompt_len",
    "rollout.backend": "sim.cost_model",
    "rollout.cpus_per_instance": "sim.gpus_per_instance",
    "rollout.gpus_per_instance": "sim.gpus_per_instance",
    "rollout.kv_cache_gib": "sim.gpu_memory_utilization",
    "rollout.enforce_eager": "sim.cost_model",
    "rollout.sglang_url": "sim.cost_model",
    "rollout.sampling.temperature": "sim.workload.response_len_median",
    "rollout.sampling.top_p": "sim.workload.response_len_median",
    "trainer.lr": _TRAINS,
    "trainer.warmup_steps": _TRAINS,
    "trainer.weight_decay": _TRAINS,
    "trainer.betas": _TRAINS,
    "trainer.grad_clip": _TRAINS,
    "trainer.clip_low": _TRAINS,
    "trainer.clip_high": _TRAINS,
    "trainer.use_tis": _TRAINS,
    "trainer.tis_cap": _TRAINS,
    "trainer.adv_eps": _TRAINS,
    "trainer.mini_batches": _TRAINS,
    "trainer.micro_batch_size": _TRAINS,
    "trainer.overlong.enabled": "sim.workload.reward_mean",
    "trainer.overlong.buffer_len": "sim.workload.reward_mean",
    "trainer.overlong.penalty_factor": "sim.workload.reward_mean",
    "trainer.device": _TRAINS,
    "trainer.fsdp": _TRAINS,
    "trainer.num_gpus": "sim.train_gpus",
    "trainer.torch_threads": _TRAINS,
    "reward.fn": "sim.workload.reward_mean",
    "reward.num_workers": "sim.reward_time_s",
    "reward.retries": "sim.reward_time_s",
    "reward.timeout_s": "sim.reward_time_s",
    "reward.max_failures_in_row": "sim.reward_time_s",
    "param_server.num_workers": "sim.push_bandwidth_gb_s",
    "param_server.keep_versions": "sim.model_bytes",
    "param_server.replication": "sim.pull_bandwidth_gb_s",
    "param_server.push_retry_s": "sim.transfer_overhead_s",
    "param_server.transport": "sim.pull_bandwidth_gb_s",
    "param_server.bind_host": "sim.transfer_overhead_s",
    "param_server.auth_token": "sim.transfer_overhead_s",
    "ray.address": "sim.total_gpus",
    "ray.num_cpus": "sim.total_gpus",
    "ray.num_gpus": "sim.total_gpus",
    "ray.object_store_mb": "sim.transfer_overhead_s",
    "ray.control_resource": "sim.total_gpus",
    "ray.rollout_resource": "sim.gpus_per_instance",
    "ray.trainer_resource": "sim.train_gpus",
    "ray.reward_resource": "sim.reward_time_s",
    "ray.trajectory_server_host": "sim.transfer_overhead_s",
}
#: examples/sim-tiny.yaml's linear trainer settings, cleared for another trainer model
_NOT_LINEAR = ["sim.trainer_time_a_s=null", "sim.trainer_time_b_s_per_token=null"]
#: sim keys that apply under another setting: what makes them apply
SIM_CONTEXT = {
    **{f"sim.{k}": ["sim.cost_model=custom", "sim.k1=1e-7", "sim.k2=0.01", "sim.k3=1e-4",
                    "sim.k4=0.005"] for k in ("k1", "k2", "k3", "k4", "b")},
    "sim.trainer_model": _NOT_LINEAR,
    "sim.trainer_setup": [*_NOT_LINEAR, "sim.trainer_model=megatron"],
    "sim.gpus_per_instance": ["sim.total_gpus=12"],
    **{f"sim.{k}": [*_NOT_LINEAR, "sim.trainer_model=flops"]
       for k in ("active_params", "peak_flops_per_gpu", "mfu", "train_overhead_s")},
    **{f"sim.workload.{k}": ["sim.workload.kind=power_law"] for k in ("alpha", "x_min")},
    **{f"sim.workload.{k}": ["sim.workload.kind=bimodal"]
       for k in ("median2", "sigma2", "weight2")},
    "sim.host_load_threads": ["sim.host_cores=2"],
    "sim.host_instance_threads": ["sim.host_cores=2"],
}  # fmt: skip
#: sim keys whose other value cannot be derived from the type
SIM_VALUES = {
    "sim.cost_model": "qwen-14b-h20",
    "sim.model": "qwen2.5-14b",
    "sim.trainer_setup": "qwen2.5-14b",
    "sim.active_params": "7e9",
    "sim.peak_flops_per_gpu": "989e12",
    "sim.mfu": "0.4",
    "sim.train_overhead_s": "2.0",
    "sim.gpus_per_instance": "2",
    "sim.train_gpus": "1",
    "sim.max_num_batched_tokens": "4096",
    "sim.model_bytes": "1000000000",
    "sim.prefill_s_per_token": "1e-4",
    "sim.prefill_s_per_token_position": "1e-8",
    "sim.workload.alpha": "2.0",
    "sim.workload.x_min": "100",
    "sim.workload.median2": "2000",
    "sim.workload.sigma2": "0.5",
    "sim.workload.weight2": "0.2",
    "sim.workload.prompt_len": "64",
    "sim.kv_capacity_tokens": "30000",
    "sim.total_gpus": "12",
    "sim.b": "0.001",
    "sim.warmup_steps": "5",
    "sim.host_cores": "2",
    "sim.host_instance_threads": "1.5",
}
#: sim keys a separate test covers (a trace file is needed)
SIM_ELSEWHERE = {
    "sim.workload.trace_path": "test_sim_engine_lengths (group traces)",
    "sim.gpu": "one GPU preset (h20) so far: nothing to change it to",
}


def _leaves(cls: type, prefix: str = "") -> list[tuple[str, attrs.Attribute[typing.Any]]]:
    out: list[tuple[str, attrs.Attribute[typing.Any]]] = []
    for f in attrs.fields(cls):
        if isinstance(f.type, type) and attrs.has(f.type):
            out += _leaves(f.type, f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, f))
    return out


ALL = dict(_leaves(AppConfig))


def test_every_setting_is_classified() -> None:
    classified = set(SIM_SPEC) | set(SIM_CODE) | set(MODELLED) | set(CHANGES)
    for key in ALL:
        if key.startswith(("protocol.", "coordinator.", "sim.")):
            continue  # above, and the simulator's own (below)
        assert key in classified, (
            f"{key}: classify it — read by both shells (SIM_SPEC or SIM_CODE) or a real "
            "component's setting the simulator models with a sim key (MODELLED)"
        )
    assert not (set(SIM_SPEC) & set(MODELLED)) and not (set(SIM_CODE) & set(MODELLED))


@pytest.mark.parametrize("key", sorted(SIM_SPEC))
def test_a_run_setting_reaches_the_simulator(key: str) -> None:
    a = spec_from_app_config(load_config(SIM_BASE))
    b = spec_from_app_config(load_config(SIM_BASE, [f"{key}={SIM_SPEC[key]}"]))
    assert a != b, f"{key} does not reach the simulator"


@pytest.mark.parametrize("key", sorted(SIM_CODE))
def test_a_run_setting_is_read_by_both_shells_code(key: str) -> None:
    needle, ray_files, sim_files = SIM_CODE[key]
    for name, files in (("ray", ray_files), ("sim", sim_files)):
        text = "".join((SRC / f).read_text() for f in files)
        assert needle in text, f"the {name} shell ({files}) does not read {key}"


@pytest.mark.parametrize("key", sorted(MODELLED))
def test_a_modelled_setting_names_a_sim_key(key: str) -> None:
    assert MODELLED[key] in ALL, f"{key} is modelled by {MODELLED[key]}, which is no setting"


def _other(key: str, value: typing.Any) -> str:
    if key in SIM_VALUES:
        return SIM_VALUES[key]
    if isinstance(value, bool):
        return str(not value).lower()
    if isinstance(value, int):
        return str(value + 1)
    if isinstance(value, float):
        return repr(value * 0.5 if value else 0.25)
    choices = [c for c in typing.get_args(ALL[key].type) if c != value and isinstance(c, str)]
    assert choices, f"give {key} another value in SIM_VALUES"
    return choices[0]


@pytest.mark.parametrize(
    "key", sorted(k for k in ALL if k.startswith("sim.") and k not in SIM_ELSEWHERE)
)
def test_a_sim_setting_changes_the_simulation(key: str) -> None:
    """Under the settings that make it apply (:data:`SIM_CONTEXT`)."""
    base = SIM_CONTEXT.get(key, [])
    cfg = load_config(SIM_BASE, base)
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    a = spec_from_app_config(cfg)
    b = spec_from_app_config(load_config(SIM_BASE, [*base, f"{key}={_other(key, value)}"]))
    assert a != b, f"{key} does not change the simulation"
