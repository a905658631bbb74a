"""Every decision setting reaches both shells — the simulator and the Ray deployment — or is
listed here as belonging to one of them, with the reason.

Both shells build their control core from ``control.config.core_config(app_config)``; a
setting that changes that config reaches both. The few settings a shell reads itself (its cycle
period, its retry delay) must be read by both shells' code. A new field in the sections below
fails this test until it is classified."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from rollout_coordinator import PROFILES
from rollout_coordinator import CoordinatorConfig as PackageCoordinatorConfig
from staleflow_trainer.config import STRATEGY_FIELDS, AppConfig, load_config
from staleflow_trainer.control.config import core_config

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
