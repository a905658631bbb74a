"""``sim.host_cores``: the instances and the trainer share a host's CPU cores. While the trainer
computes, every thread gets ``min(1, cores / threads)`` of a core: the instances slow down by
that share and the trainer's step takes longer by as much; without the setting nothing
changes."""

from __future__ import annotations

import math
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


@pytest.mark.parametrize(
    ("cores", "busy", "load", "pace", "factor"),
    [
        # 2 engines + the trainer + 0.6 of load on 2 cores: 2/3.6 of a core each, against
        # 2/2.6 for the engines without the trainer and a whole core for the trainer alone
        (2, 2, 0.6, (2 / 3.6) / (2 / 2.6), 3.6 / 2),
        (2, 1, 0.6, (2 / 2.6) / 1.0, 2.6 / 2),  # 1.6 threads alone fit; 2.6 do not
        (2, 0, 0.6, 1.0, 1.0),  # the trainer beside the load alone: its time alone
        (1, 1, 0.5, (1 / 2.5) / (1 / 1.5), 2.5 / 1.5),  # the trainer alone shares the core too
        (1, 0, 0.5, 1.0, 1.0),
        (8, 3, 2.0, 1.0, 1.0),  # 6 threads on 8 cores: no one waits
    ],
)
def test_host_shares_with_a_load(
    cores: int, busy: int, load: float, pace: float, factor: float
) -> None:
    spec = SimSpec(host_cores=cores, host_load_threads=load)
    assert spec.host_shares(busy) == pytest.approx((pace, factor))


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


def test_an_instance_counts_the_threads_it_keeps_runnable() -> None:
    """``sim.host_instance_threads`` replaces the engine's threads on the shared host: 2 busy
    instances of 1.5 threads, the trainer and 0.5 of load on 2 cores: 2/4.5 of a core each,
    against 2/3.5 without the trainer."""
    spec = SimSpec(host_cores=2, host_instance_threads=1.5, host_load_threads=0.5)
    assert spec.host_shares(2) == pytest.approx(((2 / 4.5) / (2 / 3.5), 4.5 / 2))
    assert spec.host_shares(0) == (1.0, 1.0)
    assert SimSpec(host_cores=2, host_instance_threads=1.0).host_shares(2) == pytest.approx(
        SimSpec(host_cores=2).host_shares(2)
    )  # null: the engine's one thread


def test_the_host_threads_come_from_the_sim_section() -> None:
    spec = spec_from_app_config(
        _cfg("sim.host_cores=2", "sim.host_load_threads=0.6", "sim.host_instance_threads=1.7")
    )
    assert (spec.host_cores, spec.host_load_threads, spec.host_instance_threads) == (2, 0.6, 1.7)
    spec = spec_from_app_config(_cfg())
    assert (spec.host_load_threads, spec.host_instance_threads) == (0.0, None)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "some"])
def test_bad_host_instance_threads_name_the_field(value: str) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg("sim.host_cores=2", f"sim.host_instance_threads={value}")
    assert e.value.key == "sim.host_instance_threads"


@pytest.mark.parametrize("value", ["-0.5", "nan", "inf", "some"])
def test_bad_host_load_names_the_field(value: str) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg("sim.host_cores=2", f"sim.host_load_threads={value}")
    assert e.value.key == "sim.host_load_threads"


@pytest.mark.parametrize(
    ("key", "value"), [("host_load_threads", 0.5), ("host_instance_threads", 1.5)]
)
def test_host_threads_need_a_shared_host(key: str, value: float) -> None:
    """When the config loads, and in a spec built without it."""
    with pytest.raises(ConfigError) as e:
        _cfg(f"sim.{key}={value}")
    assert e.value.key == f"sim.{key}" and "sim.host_cores" in str(e.value)
    assert e.value.allowed
    with pytest.raises(ConfigError) as e:
        SimSpec(**{key: value})
    assert e.value.key == f"sim.{key}"
    assert _cfg("sim.host_load_threads=0").sim.host_load_threads == 0.0


def test_host_cores_refuses_a_streamed_batch() -> None:
    """When the config loads (and in a spec built without it)."""
    with pytest.raises(ConfigError) as e:
        _cfg("sim.host_cores=2", "trainer.stream_batch=true")
    assert e.value.key == "sim.host_cores" and "stream_batch" in str(e.value)
    assert e.value.allowed
    with pytest.raises(ConfigError) as e:
        SimSpec(host_cores=2, stream_batch=True)
    assert e.value.key == "sim.host_cores"


def _steps(cfg: Any) -> list[dict[str, Any]]:
    from staleflow_trainer.sim import run_simulation

    return run_simulation(cfg).rec.steps


def test_enough_cores_change_nothing() -> None:
    """4 instances and the trainer on 5 cores (or more) never wait for one another."""
    plain = _steps(_cfg())
    for cores in (5, 64):
        assert _steps(_cfg(f"sim.host_cores={cores}")) == plain


def _traced(cfg: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run ``cfg`` and keep what the shared host did: the instances' pace over time (one
    instance's: all take the same), each training step's (start, end, tokens), and whether
    every instance was back at pace 1 whenever a trained version arrived."""
    from engine_adapters.sim import SimEngineCore
    from staleflow_trainer.control.events import Trained
    from staleflow_trainer.sim import Simulation
    from staleflow_trainer.sim.metrics import RunRecorder

    paces: list[tuple[float, float]] = [(0.0, 1.0)]
    phases: list[tuple[float, str]] = []
    tokens: list[int] = []
    set_pace, phase = SimEngineCore.set_pace, RunRecorder.trainer_phase

    def on_pace(self: SimEngineCore, pace: float, now: float) -> None:
        if self.instance_id == "r000":
            paces.append((now, pace))
        set_pace(self, pace, now)

    def on_phase(self: RunRecorder, now: float, name: str) -> None:
        phases.append((now, name))
        phase(self, now, name)

    monkeypatch.setattr(SimEngineCore, "set_pace", on_pace)
    monkeypatch.setattr(RunRecorder, "trainer_phase", on_phase)
    sim = Simulation(cfg)
    train = sim._train

    def on_train(e: Any) -> None:
        tokens.append(e.tokens)
        train(e)

    monkeypatch.setattr(sim, "_train", on_train)
    restored: list[bool] = []
    sim.on_event = lambda ev: (
        restored.append(all(g.pace == 1.0 for g in sim.engines.values()))
        if isinstance(ev, Trained)
        else None
    )
    sim.run()
    starts = [t for t, name in phases if name == "training"]
    ends = [t for t, name in phases if name == "pushing"]
    steps = list(zip(starts, ends, tokens, strict=False))
    return {"paces": paces, "steps": steps, "restored": restored, "spec": sim.spec}


def _compute_done(
    paces: list[tuple[float, float]], spec: SimSpec, start: float, end: float
) -> float:
    """Seconds of the trainer's compute (at its speed alone) done in ``[start, end]``: each
    stretch of constant pace counts at the factor of that pace (one factor per pace here)."""
    factor_of = {spec.host_shares(busy)[0]: spec.host_shares(busy)[1] for busy in range(5)}
    done = 0.0
    for (t0, pace), (t1, _) in zip(paces, [*paces[1:], (math.inf, 1.0)], strict=True):
        lo, hi = max(t0, start), min(t1, end)
        if hi > lo:
            done += (hi - lo) / factor_of[pace]
    return done


@pytest.mark.parametrize("load", [0.0, 0.5])
def test_the_trainer_computes_at_the_share_of_whoever_has_work(
    monkeypatch: pytest.MonkeyPatch, load: float
) -> None:
    """On one core, 4 instances (and a load beside them): every step's compute (its time
    alone, ``a + b x tokens``) is done at the factor for the instances with work at each
    moment, which changes within steps; the instances run at the matching pace, and at 1 again
    before the step's version arrives."""
    run = _traced(_cfg("sim.host_cores=1", f"sim.host_load_threads={load}"), monkeypatch)
    assert run["steps"] and all(run["restored"]) and len(run["restored"]) == len(run["steps"])
    mixed = 0
    for start, end, tokens in run["steps"]:
        alone = A_S + B_S * tokens
        done = _compute_done(run["paces"], run["spec"], start, end)
        assert done == pytest.approx(alone, rel=1e-9), (start, end, done, alone)
        during = {p for t, p in run["paces"] if start < t < end}
        mixed += len(during) > 0  # the shares were taken again within the step
    assert mixed >= len(run["steps"]) // 2
    assert any(p < 1.0 for _, p in run["paces"])


@pytest.mark.parametrize("load", [0.0, 0.5])
def test_idle_instances_leave_the_trainer_its_time_alone(
    monkeypatch: pytest.MonkeyPatch, load: float
) -> None:
    """At η = 0 the instances wait for the step's weights while the trainer computes: nothing
    but the load (which its time alone includes) shares the core, every step takes its time
    alone and no pace changes."""
    run = _traced(_cfg("sim.host_cores=1", "protocol.eta=0", f"sim.host_load_threads={load}"),
                  monkeypatch)  # fmt: skip
    assert run["steps"]
    for start, end, tokens in run["steps"]:
        assert end - start == pytest.approx(A_S + B_S * tokens, rel=1e-9)
    assert run["paces"] == [(0.0, 1.0)]


def test_the_step_delay_is_a_wait_the_instances_do_not_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``trainer.step_delay_s`` comes after the compute, at full pace: the instances are back
    at pace 1 for it."""
    run = _traced(_cfg("sim.host_cores=1", "trainer.step_delay_s=3"), monkeypatch)
    for start, end, tokens in run["steps"]:
        done = _compute_done(run["paces"], run["spec"], start, end - 3.0)
        assert done == pytest.approx(A_S + B_S * tokens, rel=1e-9)
        assert all(p == 1.0 for t, p in run["paces"] if end - 3.0 < t < end)
        assert [p for t, p in run["paces"] if t <= end - 3.0][-1] == 1.0


def test_a_load_slows_the_trainer_where_it_shares_the_host() -> None:
    """At η = 2 the trainer computes beside the instances on 2 cores: with 0.5 and then 1 core
    of load beside them (its time alone still a whole core) its steps take longer."""
    train_s = []
    for load in (0.0, 0.5, 1.0):
        steps = _steps(_cfg("sim.host_cores=2", f"sim.host_load_threads={load}"))
        train_s.append(sum(r["train_s"] for r in steps))
    assert train_s[0] < train_s[1] < train_s[2], train_s
