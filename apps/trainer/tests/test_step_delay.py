"""``trainer.step_delay_s`` — a slower trainer by config — is validated, reaches the Ray
deployment's trainer actor and the simulator's trainer model, and in the simulator lets the
unbounded FIFO's staleness grow while a bounded run stays within its η."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from staleflow_trainer.config import MAX_STEP_DELAY_S, load_config
from staleflow_trainer.errors import ConfigError


@pytest.mark.parametrize("value", ["-0.5", "slow", ".inf", ".nan", str(MAX_STEP_DELAY_S + 1)])
def test_bad_values_name_the_field_and_the_range(value: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"trainer.step_delay_s={value}"])
    assert e.value.key == "trainer.step_delay_s"
    assert e.value.allowed
    assert "trainer.step_delay_s" in str(e.value)


def test_default_is_no_delay_and_a_value_loads() -> None:
    assert load_config(None, []).trainer.step_delay_s == 0.0
    assert load_config(None, ["trainer.step_delay_s=1.5"]).trainer.step_delay_s == 1.5


@pytest.mark.parametrize("model", ["linear", "flops", "megatron"])
def test_the_simulator_adds_the_delay_to_every_trainer_model(model: str) -> None:
    from staleflow_trainer.sim.spec import spec_from_app_config
    from staleflow_trainer.sim.testing import sim_config

    cfg = sim_config(
        steps=2, total_gpus=4, rollout_gpus=2, train_gpus=2, prompt_len=32, prompt_len_max=64
    )
    base = spec_from_app_config(cfg.evolve(f"sim.trainer_model={model}"))
    slow = spec_from_app_config(
        cfg.evolve(f"sim.trainer_model={model}", "trainer.step_delay_s=2.5")
    )
    assert slow.trainer_step_delay_s == 2.5
    assert slow.train_seconds(10_000, 1e6) == pytest.approx(base.train_seconds(10_000, 1e6) + 2.5)


def test_a_slower_trainer_grows_unbounded_staleness_in_the_simulator() -> None:
    """The same workload with a trainer 30 s slower per step (a few rollouts' time): with no
    bound the FIFO keeps filling while the trainer lags, so consumed staleness grows to the
    step count; η = 2 stays within 2 on the same schedule."""
    from staleflow_trainer.sim import Simulation, with_policy
    from staleflow_trainer.sim.testing import sim_config

    cfg = sim_config(
        steps=12, batch_size=2, group_size=2, total_gpus=4, rollout_gpus=2, train_gpus=2,
        max_running=32, kv_capacity_tokens=24_000, prompt_len=32, prompt_len_max=64,
        response_len_median=800, response_len_sigma=0.3, max_response_len=2048,
        trainer_time_a_s=0.2, trainer_time_b_s_per_token=0.0, cycle_period_s=0.1,
        warmup_steps=1, unbounded_inflight_batches=2, eta="unbounded", policy="all-vanilla",
    )  # fmt: skip

    def max_staleness(delay: float, eta: int | str) -> int:
        slower = cfg.evolve(f"trainer.step_delay_s={delay}")
        sim = Simulation(with_policy(slower, "all-vanilla", eta))
        sim.run()
        return max(sim.core.protocol.stats().staleness_histogram)

    fast, slow = max_staleness(0.0, "unbounded"), max_staleness(30.0, "unbounded")
    assert slow >= fast + 4 and slow >= 10, (fast, slow)
    assert max_staleness(30.0, 2) <= 2


class _Pushed:
    def __init__(self, version: int) -> None:
        self.version, self.complete, self.nbytes = version, True, 0


class _FakeParamServer:
    """Stands in for ``param_server.ParamServerClient`` (the trainer actor only pushes here)."""

    def __init__(self, *_a: Any, **_k: Any) -> None:
        pass

    def push(self, version: int, tensors: Any) -> _Pushed:
        return _Pushed(int(version))

    def close(self) -> None:
        pass


@pytest.mark.parametrize("delay", [0.0, 0.25])
def test_the_ray_trainer_actor_waits_the_delay_after_each_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, delay: float
) -> None:
    """The real trainer actor (real trainer, fake parameter server): a step with a delay
    sleeps exactly that long after training and before its version is pushed; none without."""
    import param_server
    from staleflow_trainer.actors import trainer_actor
    from staleflow_trainer.config import to_dict
    from staleflow_trainer.tiny_model import resolve_model_path

    monkeypatch.setattr(param_server, "ParamServerClient", _FakeParamServer)
    cfg = load_config(
        None,
        [f"run_dir={tmp_path}", "trainer.device=cpu", f"trainer.step_delay_s={delay}",
         "protocol.batch_size=1", "protocol.group_size=2", "rollout.sampling.max_new_tokens=2"],
    )  # fmt: skip
    actor = trainer_actor.TrainerActor(
        cfg=to_dict(cfg), model_path=str(resolve_model_path(cfg)), ps_address=("127.0.0.1", 1)
    )
    events: list[tuple[str, float]] = []
    monkeypatch.setattr(trainer_actor.time, "sleep", lambda s: events.append(("sleep", s)))
    push = actor.push
    monkeypatch.setattr(actor, "push", lambda: (events.append(("push", 0.0)), push())[1])
    samples = [
        {"group_id": "g0", "prompt_ids": [3, 4], "response_ids": [5, 6],
         "rollout_logprobs": [-1.0, -1.2], "reward": r}
        for r in (0.0, 1.0)
    ]  # fmt: skip
    metrics = actor.train_step(samples, consumed_version=0)
    assert metrics["version"] == 1
    assert events == ([("sleep", delay)] if delay else []) + [("push", 0.0)]
