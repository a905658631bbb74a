"""Every step record carries the trained batch's response lengths, one list per group (a group
trace ``sim.workload.kind: group_trace`` replays), from the control core, so the Ray deployment
and the simulator write the same; the training batch in the core's saved state keeps them."""

from __future__ import annotations

from staleflow_trainer.control import effects as fx
from staleflow_trainer.control.state import _train_from_dict, _train_to_dict
from staleflow_trainer.sim import run_simulation
from staleflow_trainer.sim.testing import sim_config


def test_step_records_hold_each_groups_response_lengths() -> None:
    cfg = sim_config(
        steps=3, batch_size=2, group_size=3, total_gpus=4, rollout_gpus=2, train_gpus=2,
        prompt_len=32, prompt_len_max=64, response_len_median=50, response_len_sigma=0.5,
        max_response_len=200,
    )  # fmt: skip
    rows = run_simulation(cfg).rec.steps
    assert len(rows) == 3
    for r in rows:
        groups = r["response_lengths"]
        assert [len(g) for g in groups] == [3, 3]  # B groups of n
        assert sum(map(sum, groups)) == r["response_tokens"]
        assert all(1 <= n <= 200 for g in groups for n in g)
    # lengths are drawn per group, not one value for the run
    assert len({n for r in rows for g in r["response_lengths"] for n in g}) > 1


def test_the_training_batch_keeps_its_lengths_in_the_saved_state() -> None:
    t = fx.Train(
        version=3, group_ids=("g1", "g2"), trajectory_ids=(("g1/0", "g1/1"), ("g2/0", "g2/1")),
        staleness=((0, 1), (1, 1)), rewards=((1.0, 0.0), (0.5, 0.5)), tokens=40,
        response_tokens=24, response_lengths=((5, 7), (6, 6)),
    )  # fmt: skip
    assert _train_from_dict(_train_to_dict(t)) == t
    older = _train_to_dict(t)
    del older["response_lengths"]  # a journal written before the field existed
    assert _train_from_dict(older).response_lengths == ()
