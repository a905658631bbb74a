"""Dynamic sampling that filters every group stops the run, naming the setting, instead of
generating for ever (the simulator would never end, a deployment never train)."""

from __future__ import annotations

import pytest

from staleflow_trainer.config import load_config
from staleflow_trainer.control import ControlCore, core_config
from staleflow_trainer.control.config import FILTERED_BATCHES_IN_ROW
from staleflow_trainer.errors import ConfigError
from staleflow_trainer.sim import Simulation, SimulationHalted
from staleflow_trainer.sim.testing import sim_config


def _cfg(*over: str) -> object:
    cfg = sim_config(steps=3, batch_size=2, group_size=2, response_len_median=50, prompt_len=32,
                     max_response_len=128, kv_capacity_tokens=20_000)  # fmt: skip
    return cfg.evolve("trainer.dynamic_sampling=true", *over)  # type: ignore[attr-defined]


def test_every_group_filtered_stops_the_run_naming_the_setting() -> None:
    sim = Simulation(_cfg("sim.workload.reward_mean=0", "trainer.max_filtered_in_row=7"))
    with pytest.raises(SimulationHalted, match=r"^data: dynamic sampling filtered 7 groups") as e:
        sim.run()
    assert "trainer.max_filtered_in_row, is 7" in str(e.value)
    assert sim.core.counters["filtered"] == 7 and sim.core.steps_done == 0


def test_the_default_limit_is_batches_of_groups() -> None:
    sim = Simulation(_cfg("sim.workload.reward_mean=1"))
    with pytest.raises(SimulationHalted, match="reward is constant"):
        sim.run()
    assert sim.core.counters["filtered"] == FILTERED_BATCHES_IN_ROW * 2  # batch_size 2


def test_filtered_groups_not_in_a_row_do_not_stop_it() -> None:
    """Half the rewards are 1: some groups are filtered, never 40 in a row; a kept
    group starts the count again (and the count survives the core's state round trip)."""
    sim = Simulation(_cfg("sim.workload.reward_mean=0.5", "trainer.max_filtered_in_row=40"))
    sim.run()
    assert sim.core.steps_done == 3 and sim.core.counters["filtered"] > 0
    core = sim.core
    core._filtered_streak = 5
    again = ControlCore.restore(core.to_dict(), core.config, prompt_len=lambda row: 32)
    assert again._filtered_streak == 5


def test_the_limit_is_refused_without_dynamic_sampling_and_resolves_per_batch() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.max_filtered_in_row=5"])
    assert e.value.key == "trainer.max_filtered_in_row" and "dynamic_sampling" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.dynamic_sampling=true", "trainer.max_filtered_in_row=0"])
    assert e.value.key == "trainer.max_filtered_in_row"
    on = ["trainer.dynamic_sampling=true", "protocol.batch_size=6", "trainer.mini_batches=1"]
    assert core_config(load_config(None, on), rows=8).filtered_limit == FILTERED_BATCHES_IN_ROW * 6
    set_ = core_config(load_config(None, [*on, "trainer.max_filtered_in_row=3"]), rows=8)
    assert set_.filtered_limit == 3
