"""A reward that keeps failing stops the run with a clear error instead of burning prompts
forever; a reward function that cannot be imported is refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from staleflow_trainer.config import load_config
from staleflow_trainer.control.events import Reward, Rewarded
from staleflow_trainer.errors import ConfigError
from staleflow_trainer.sim import Simulation, SimulationHalted
from staleflow_trainer.sim.testing import sim_config

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml"


class _FailingRewards(Simulation):
    """The simulator with a reward function that fails on every trajectory ``fail`` says."""

    def __init__(self, cfg: object, fail: object) -> None:
        super().__init__(cfg)
        self._fail = fail

    def _score(self, tids: tuple[str, ...]) -> None:
        rewards = [
            Reward(trajectory_id=t, score=None, reason="error: ValueError('boom')")
            if self._fail(t)  # type: ignore[operator]
            else Reward(trajectory_id=t, score=float(hash(t) & 1))
            for t in tids
            if t in self.core.ledger.entries
        ]
        self._pending.append(Rewarded(at=self.now, rewards=rewards))


def _cfg(limit: int) -> object:
    cfg = sim_config(steps=3, batch_size=2, group_size=2, response_len_median=50, prompt_len=32,
                     max_response_len=128, kv_capacity_tokens=20_000)  # fmt: skip
    return cfg.evolve(f"reward.max_failures_in_row={limit}")  # type: ignore[attr-defined]


@pytest.mark.fault
def test_a_reward_that_always_fails_stops_the_run_naming_the_setting() -> None:
    sim = _FailingRewards(_cfg(10), lambda t: True)
    with pytest.raises(SimulationHalted, match=r"reward.*10 trajectories in a row") as e:
        sim.run()
    assert "reward.max_failures_in_row=10" in str(e.value) and "boom" in str(e.value)
    assert sim.core.counters["reward_dropped"] == 10
    assert sim.core.steps_done == 0


@pytest.mark.fault
def test_failures_that_are_not_in_a_row_do_not_stop_it() -> None:
    # every other group's rewards fail: never 10 in a row, the run completes
    sim = _FailingRewards(_cfg(10), lambda t: int(t[1:7]) % 2 == 0)
    sim.run()
    assert sim.core.steps_done == 3 and sim.core.counters["reward_dropped"] > 0


def test_an_unimportable_reward_function_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    from staleflow_trainer.runtime.prepare import preflight

    cfg = load_config(EXAMPLE, [f"run_dir={tmp_path}", "reward.fn=nosuchmodule:f"])
    with pytest.raises(ConfigError) as e:
        preflight(cfg, Path("unused"))
    assert e.value.key == "reward.fn" and "nosuchmodule" in str(e.value)
