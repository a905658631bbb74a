"""More rollout instances than the CPUs a local run can use are refused before anything
starts (with ``ray.num_cpus`` unset too); actors Ray cannot place are named, not waited on."""

from __future__ import annotations

from pathlib import Path

import pytest

from staleflow_trainer.config import load_config
from staleflow_trainer.errors import ConfigError
from staleflow_trainer.runtime import prepare

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml"


def test_more_instances_than_effective_cpus_is_refused_before_ray_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from staleflow_trainer.runtime.deployment import Deployment

    def no_ray(cfg: object) -> bool:
        raise AssertionError("Ray would be started")

    monkeypatch.setattr("staleflow_trainer.runtime.deployment.init_ray", no_ray)
    monkeypatch.setattr(prepare.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(prepare.os, "cpu_count", lambda: 64)
    cfg = load_config(EXAMPLE, [f"run_dir={tmp_path}", "rollout.num_instances=3"])
    assert cfg.ray.num_cpus is None
    with pytest.raises(ConfigError, match=r"3 rollout instances .* exceed the 2") as e:
        Deployment(cfg).start()
    assert e.value.key == "rollout.num_instances"
    assert e.value.allowed is not None and e.value.allowed.startswith("<= 2")


def test_explicit_num_cpus_and_fitting_runs_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepare.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    prepare.check_local_cpus(load_config(EXAMPLE, ["rollout.num_instances=2"]))
    prepare.check_local_cpus(load_config(EXAMPLE, ["rollout.num_instances=4", "ray.num_cpus=4"]))
    assert 1 <= prepare.effective_cpus() <= 2


def test_missing_resources_names_what_the_cluster_lacks() -> None:
    lacking = prepare.missing_resources({"CPU": 1.0, "GPU": 0.0}, 3, {"CPU": 2.0, "GPU": 1.0})
    assert lacking == ["CPU: 3 needed, 2 in the cluster"]
    assert prepare.missing_resources({"GPU": 1.0}, 2, {"CPU": 8.0}) == [
        "GPU: 2 needed, 0 in the cluster"
    ]
    assert prepare.missing_resources({"CPU": 1.0}, 2, {"CPU": 2.0}) == []


def test_ray_token_auth_notice_is_quiet_and_other_warnings_are_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    name = "ray._private.authentication.authentication_token_setup"
    prepare._quiet_token_auth_notice()
    prepare._quiet_token_auth_notice()  # once only
    logger = logging.getLogger(name)
    assert sum(isinstance(f, prepare._TokenAuthNotice) for f in logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=name):
        logger.warning("Token authentication is enabled for this Ray cluster. Set ...")
        logger.warning("Token authentication is disabled for this Ray cluster. Anyone ...")
    assert [r.getMessage()[:34] for r in caplog.records] == ["Token authentication is disabled f"]


def test_a_ray_address_on_loopback_is_reached_on_loopback() -> None:
    for address in ("127.0.0.1:6379", "localhost:6379", "ray://127.0.0.1:10001", "[::1]:6379"):
        assert prepare._on_loopback(address), address
    for address in ("10.0.0.5:6379", "ray://head.example:10001", "auto"):
        assert not prepare._on_loopback(address), address
