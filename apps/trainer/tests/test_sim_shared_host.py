"""``sim.host_cores``: the instances and the trainer share a host's CPU cores. While the trainer
computes, every thread gets ``min(1, cores / threads)`` of a core: the instances slow down by
that share and the trainer's step takes longer by as much; without the setting nothing
changes."""

from __future__ import annotations

from typing import Any

import pytest

from staleflow_trainer.errors import ConfigError
from staleflow_trainer.sim.spec import SimSpec, spec_from_app_config
from staleflow_trainer.sim.testing import sim_config

A_S, B_S = 2.0, 1e-4  # the linear trainer model: a + b x tokens seconds a step


def _cfg(*over: str) -> Any:
    cfg = sim_config(
        steps=8, batch_size=2, group_size=4, total_gpus=6, rollout_gpus=4, train_gpus=2,
        max_running=32, kv_capacity_tokens=40_000, prompt_len=32, prompt_len_max=64,
        response_len_median=300, response_len_sigma=0.5, max_response_len=1024,
        trainer_time_a_s=A_S, trainer_time_b_s_per_token=B_S, cycle_period_s=0.1,
        warmup_steps=1, eta=2, policy="staleflow",
    )  # fmt: skip
    return cfg.evolve(*over)


@pytest.mark.parametrize(
    ("cores", "instance", "trainer", "busy", "pace", "factor"),
    [
        (2, 1, 1, 2, 2 / 3, 1.5),  # 3 threads on 2 cores: two thirds of a core each
        (2, 1, 1, 1, 1.0, 1.0),  # 2 threads on 2 cores: no one waits
        (2, 1, 1, 0, 1.0, 1.0),  # the trainer alone
        (1, 1, 1, 1, 0.5, 2.0),
        (4, 1, 2, 4, 2 / 3, 1.5),  # 6 threads on 4 cores
        (2, 1, 4, 2, 1 / 3, 1.5),  # the trainer: 2 cores alone, 4 x 1/3 beside 2 threads
        (8, 2, 1, 3, 1.0, 1.0),  # 7 threads on 8 cores: no one waits
    ],
)
def test_host_shares(
    cores: int, instance: int, trainer: int, busy: int, pace: float, factor: float
) -> None:
    spec = SimSpec(host_cores=cores, instance_threads=instance, trainer_threads=trainer)
    got = spec.host_shares(busy)
    assert got == pytest.approx((pace, factor))


def test_no_shared_host_by_default() -> None:
    assert SimSpec().host_shares(8) == (1.0, 1.0)
    spec = spec_from_app_config(_cfg())
    assert (spec.host_cores, spec.instance_threads, spec.trainer_threads) == (None, 1, 1)


def test_threads_come_from_the_rollout_and_trainer_settings() -> None:
    spec = spec_from_app_config(
        _cfg("sim.host_cores=4", "rollout.cpus_per_instance=2.5", "trainer.torch_threads=3")
    )
    assert (spec.host_cores, spec.instance_threads, spec.trainer_threads) == (4, 2, 3)
    spec = spec_from_app_config(_cfg("sim.host_cores=4", "rollout.cpus_per_instance=0"))
    assert spec.instance_threads == 1  # an engine computes on one thread at least


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_bad_host_cores_name_the_field(value: str) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(f"sim.host_cores={value}")
    assert e.value.key == "sim.host_cores"


def test_host_cores_refuses_a_streamed_batch() -> None:
    with pytest.raises(ConfigError) as e:
        spec_from_app_config(_cfg("sim.host_cores=2", "trainer.stream_batch=true"))
    assert e.value.key == "sim.host_cores" and "stream_batch" in str(e.value)
    assert e.value.allowed


def _steps(cfg: Any) -> list[dict[str, Any]]:
    from staleflow_trainer.sim import run_simulation

    return run_simulation(cfg).rec.steps


def test_enough_cores_change_nothing() -> None:
    """4 instances and the trainer on 5 cores (or more) never wait for one another."""
    plain = _steps(_cfg())
    for cores in (5, 64):
        assert _steps(_cfg(f"sim.host_cores={cores}")) == plain


def test_a_shared_core_slows_the_trainer_and_the_instances() -> None:
    """On one core, a step's training takes its time alone times the factor for the instances
    busy when it starts (one of the five possible), more than alone whenever one is busy; the
    instances, slowed while it trains, make fewer tokens a second."""
    cfg = _cfg("sim.host_cores=1")
    spec = spec_from_app_config(cfg)
    factors = [spec.host_shares(busy)[1] for busy in range(5)]
    shared, plain = _steps(cfg), _steps(_cfg())
    slowed = 0
    for row in shared:
        alone = A_S + B_S * row["tokens"]
        ratio = (row["train_s"] - row["trainer"]["push_s"]) / alone
        assert min(abs(ratio - f) for f in factors) < 1e-6, (ratio, factors)
        slowed += ratio > 1
    assert slowed >= len(shared) // 2
    tokens_per_s = [sum(r["tokens"] for r in rows) / sum(r["step_s"] for r in rows)
                    for rows in (shared, plain)]  # fmt: skip
    assert tokens_per_s[0] < 0.9 * tokens_per_s[1]


def test_the_instances_run_at_their_share_while_the_trainer_computes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each training start sets every instance's pace to the share for the instances busy
    then; its end sets it back to 1."""
    from engine_adapters.sim import SimEngineCore
    from staleflow_trainer.sim import Simulation

    cfg = _cfg("sim.host_cores=1")
    spec = spec_from_app_config(cfg)
    shares = {spec.host_shares(busy)[0] for busy in range(5)}
    calls: list[float] = []
    real = SimEngineCore.set_pace

    def recorded(self: SimEngineCore, pace: float, now: float) -> None:
        calls.append(pace)
        real(self, pace, now)

    monkeypatch.setattr(SimEngineCore, "set_pace", recorded)
    sim = Simulation(cfg)
    sim.run()
    slowed = [p for p in calls if p < 1]
    assert slowed and set(slowed) <= shares
    assert calls.count(1.0) >= len(slowed) - len(sim.engines)  # restored after each step
    assert all(eng.pace in shares | {1.0} for eng in sim.engines.values())
