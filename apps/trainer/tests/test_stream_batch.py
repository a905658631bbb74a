"""``trainer.stream_batch`` in the control core and the simulator: the groups settled in the
next batch go to the trainer early, each once, and only groups that batch then holds; the
simulated step hides the streamed work behind the wait."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import pytest

from staleflow_trainer.config import load_config
from staleflow_trainer.control import ControlCore, core_config
from staleflow_trainer.control import effects as fx
from staleflow_trainer.errors import ConfigError
from staleflow_trainer.sim import Simulation
from staleflow_trainer.sim.faults import FaultPlan, FaultySimulation
from staleflow_trainer.sim.spec import SimSpec
from staleflow_trainer.sim.testing import sim_config


def _cfg(*over: str) -> Any:
    cfg = sim_config(steps=8, batch_size=4, group_size=4, response_len_median=300,
                     max_response_len=2048, prompt_len=64, kv_capacity_tokens=200_000)  # fmt: skip
    return cfg.evolve("protocol.eta=1", *over)


def _effects(cfg: Any) -> tuple[Simulation, list[fx.Effect]]:
    """A simulated run and every effect its core emitted, in order."""
    sim = Simulation(cfg)
    seen: list[fx.Effect] = []
    apply = sim.apply

    def spy(effects: list[fx.Effect]) -> None:
        seen.extend(effects)
        apply(effects)

    sim.apply = spy  # type: ignore[method-assign]
    sim.run()
    return sim, seen


def test_parts_carry_only_groups_their_batch_then_trains_each_once() -> None:
    sim, seen = _effects(_cfg("trainer.stream_batch=true"))
    trains = {e.version: e for e in seen if isinstance(e, fx.Train)}
    parts = [e for e in seen if isinstance(e, fx.TrainPart)]
    assert parts and len(trains) == 8
    streamed: dict[int, list[str]] = {}
    for p in parts:
        t = trains[p.version]
        rows = zip(t.trajectory_ids, t.staleness, t.rewards, strict=True)
        by_group = dict(zip(t.group_ids, rows, strict=True))
        mine = zip(p.group_ids, p.trajectory_ids, p.staleness, p.rewards, strict=True)
        for g, ids, stale, rewards in mine:
            assert by_group[g] == (ids, stale, rewards)  # the members the step trains, as it does
        streamed.setdefault(p.version, []).extend(p.group_ids)
    for version, groups in streamed.items():
        assert len(groups) == len(set(groups)) < len(trains[version].group_ids)
    # every part of a step comes after the previous step's Train and before its own
    order = [(type(e).__name__, e.version) for e in seen if isinstance(e, fx.Train | fx.TrainPart)]
    for i, (kind, version) in enumerate(order):
        if kind == "TrainPart":
            assert ("Train", version) in order[i + 1 :]
            assert ("Train", version - 1) not in order[i + 1 :]
    assert sim.core.counters["streamed_groups"] == sum(len(g) for g in streamed.values())


def test_without_the_setting_nothing_is_streamed() -> None:
    sim, seen = _effects(_cfg())
    assert not any(isinstance(e, fx.TrainPart) for e in seen)
    assert sim.rec.summary()["streamed_groups"] == 0


def test_streaming_hides_the_per_sample_work_behind_the_wait() -> None:
    """Where the trainer waits for each batch (η = 1, a slow tail), a streamed step ends sooner
    after its batch is complete: less idle trainer, more tokens a second (virtual time)."""
    base = _cfg("sim.trainer_time_a_s=2.0", "sim.trainer_time_b_s_per_token=1e-3")
    plain = Simulation(base).run().summary()
    streamed = Simulation(base.evolve("trainer.stream_batch=true")).run().summary()
    assert streamed["streamed_groups"] > 0
    assert streamed["trainer_idle_frac"] < plain["trainer_idle_frac"]
    assert streamed["tokens_per_s"] > plain["tokens_per_s"]
    assert streamed["max_staleness"] <= 1


def test_the_trainer_timeline_shows_streaming_inside_its_waits() -> None:
    """The simulated trainer's timeline: back-to-back phases; ``streaming`` spans only where
    it would otherwise wait, adding up to the streamed work the steps report done before their
    batch was complete."""
    base = _cfg("sim.trainer_time_a_s=2.0", "sim.trainer_time_b_s_per_token=1e-3")
    sim = Simulation(base.evolve("trainer.stream_batch=true"))
    sim.run()
    spans = [(state, a, b) for lane, state, a, b, _ in sim.rec.timeline if lane == "trainer"]
    assert all(b0 == a1 for (_, _, b0), (_, a1, _) in pairwise(spans))
    order = [state for state, _, _ in spans]
    assert "streaming" in order
    for i, state in enumerate(order):
        if state == "streaming":  # inside a wait, maybe at its very start or end
            assert order[i - 1] in ("waiting", "pushing")  # a part may come as it waits
            assert order[i + 1] in ("waiting", "training")
    streaming = sum(b - a for state, a, b in spans if state == "streaming")
    busy = sum(r["trainer"].get("stream_busy_s", 0.0) for r in sim.rec.steps)
    assert streaming == pytest.approx(busy, rel=1e-9, abs=1e-9)
    plain = Simulation(base)
    plain.run()
    assert not any(s == "streaming" for _, s, _, _, _ in plain.rec.timeline)


@pytest.mark.parametrize("model", ["linear", "flops", "megatron"])
def test_the_step_splits_into_what_streams_and_what_does_not(model: str) -> None:
    over = {"megatron": ["sim.model=qwen3-30b-a3b", "sim.trainer_setup=qwen3-30b-a3b",
                         "sim.total_gpus=64", "sim.train_gpus=32"]}.get(model, [])  # fmt: skip
    cfg = _cfg(f"sim.trainer_model={model}", "trainer.step_delay_s=3", *over)
    from staleflow_trainer.sim.spec import spec_from_app_config

    spec: SimSpec = spec_from_app_config(cfg)
    per_sample, per_step = spec.train_split(100_000, 100_000 * 4096.0)
    assert per_sample > 0 and per_step >= 3.0
    assert spec.train_seconds(100_000, 100_000 * 4096.0) == pytest.approx(per_sample + per_step)
    half, _ = spec.train_split(50_000, 50_000 * 4096.0)
    assert 2 * half == pytest.approx(per_sample)  # the per-sample part adds up over the parts


def _stopped_at_first_part(cfg: Any) -> tuple[Simulation, fx.TrainPart]:
    """A simulated run stopped right after the first ``TrainPart`` its core emitted."""
    sim = Simulation(cfg)
    first: list[fx.TrainPart] = []
    apply = sim.apply

    def stop_at_first_part(effects: list[fx.Effect]) -> None:
        apply(effects)
        first.extend(e for e in effects if isinstance(e, fx.TrainPart))
        if first:
            raise StopIteration

    sim.apply = stop_at_first_part  # type: ignore[method-assign]
    with pytest.raises(StopIteration):
        sim.run()
    return sim, first[0]


def _parts_after_restore(state: dict[str, Any], config: Any) -> tuple[ControlCore, list[Any]]:
    restored = ControlCore.restore(state, config, prompt_len=lambda row: 64)
    out: list[fx.Effect] = []
    restored._maybe_train(out)
    return restored, [e for e in out if isinstance(e, fx.TrainPart)]


def test_a_restored_core_sends_and_counts_each_group_once() -> None:
    sim, first = _stopped_at_first_part(_cfg("trainer.stream_batch=true"))
    core = sim.core
    counted = core.counters["streamed_groups"]
    assert counted == len(first.group_ids)
    restored, again = _parts_after_restore(core.to_dict(), core.config)
    assert restored.streamed == set(first.group_ids)
    sent_again = {g for p in again for g in p.group_ids}
    assert not sent_again & set(first.group_ids)
    assert restored.counters["streamed_groups"] == counted + len(sent_again)


def test_a_state_saved_without_the_streamed_set_sends_the_settled_groups_again() -> None:
    sim, first = _stopped_at_first_part(_cfg("trainer.stream_batch=true"))
    state = sim.core.to_dict()
    del state["streamed"]  # as written before the set was saved
    _, again = _parts_after_restore(state, sim.core.config)
    assert len(again) == 1 and again[0].version == first.version
    assert set(first.group_ids) <= set(again[0].group_ids)


def test_a_crashed_trainer_loses_its_streamed_parts_and_the_run_goes_on() -> None:
    """Trainer crashes roll the app back to its last checkpoint; the parts the dead trainer
    held are gone (the simulated step does their work again) and the run finishes with every
    ledger check passing."""
    cfg = _cfg("trainer.stream_batch=true", "trainer.steps=12", "run.checkpoint_every=2")
    sim = FaultySimulation(cfg, FaultPlan(seed=7, trainer_crash_rate=1 / 400))
    crash = sim._crash
    held: list[tuple[bool, bool]] = []  # per crash: parts held before it, after it

    def spy() -> None:
        before = sim._streamed is not None
        crash()
        held.append((before, sim._streamed is not None))

    sim._crash = spy  # type: ignore[method-assign]
    sim.run()
    assert (True, False) in held and all(not after for _, after in held)
    assert sim.core.steps_done == 12
    assert 0 < sim.core.counters["streamed_groups"] <= 12 * 4


def test_the_simulators_colocated_sync_streams_nothing() -> None:
    cfg = _cfg("trainer.stream_batch=true", "coordinator.policy=sync", "protocol.eta=0")
    assert core_config(cfg, rows=None).stream_batch is False


@pytest.mark.parametrize(
    ("over", "says"),
    [
        ("trainer.mini_batches=2", "trainer.mini_batches 2"),
        ("trainer.fsdp=true", "trainer.fsdp"),
        ("model.dtype=float16", "model.dtype float16"),
    ],
)
def test_settings_a_streamed_step_cannot_take_are_refused(over: str, says: str) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.stream_batch") as e:
        load_config(None, ["trainer.stream_batch=true", over])
    assert says in str(e.value)
