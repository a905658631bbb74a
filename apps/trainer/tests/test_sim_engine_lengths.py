"""``staleflow train`` with sim engines gives each group the response lengths the simulator
draws for it: every ``sim.workload`` setting (the distribution, its parameters, the group
correlation) reaches both shells. (The Ray shell once drew its own lognormal lengths, and a
``power_law`` or trace workload reached the simulator only.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from staleflow_trainer.actors.shell_io import ShellIO
from staleflow_trainer.config import load_config
from staleflow_trainer.data import EncodedPrompts
from staleflow_trainer.sim.shell import Simulation

SIM_TINY = Path(__file__).resolve().parents[3] / "examples" / "sim-tiny.yaml"
MEMBERS = 4  # sim-tiny's group size


@pytest.mark.parametrize(
    "workload",
    [
        [],
        ["sim.workload.response_len_median=50", "sim.workload.group_correlation=0.9"],
        ["sim.workload.kind=power_law", "sim.workload.alpha=1.2"],
        ["sim.workload.kind=bimodal", "sim.workload.median2=900"],
    ],
)
def test_the_ray_shell_gives_sim_engines_the_simulators_lengths(
    tmp_path: Path, workload: list[str]
) -> None:
    cfg = load_config(SIM_TINY, [f"run.run_dir={tmp_path}", *workload])
    assert cfg.protocol.group_size == MEMBERS
    io = ShellIO(cfg, prompts=EncodedPrompts((), ()), ts_address=("127.0.0.1", 1), ts_token="t",
                 rollouts={}, trainer=None, rewards=[], reward_spec={})  # fmt: skip
    stream = Simulation(cfg).stream
    cap = cfg.rollout.sampling.max_new_tokens
    for serial in (1, 2, 65, 300):  # group g<serial - 1>, across the stream's chunks
        want = [min(x, cap) for x in stream.group(serial - 1).response_lens[:MEMBERS]]
        assert io.groups.target_lengths(serial, MEMBERS) == want


def test_real_engines_get_no_target_lengths(tmp_path: Path) -> None:
    cfg = load_config(SIM_TINY, [f"run.run_dir={tmp_path}", "rollout.backend=vllm"])
    io = ShellIO(cfg, prompts=EncodedPrompts((), ()), ts_address=("127.0.0.1", 1), ts_token="t",
                 rollouts={}, trainer=None, rewards=[], reward_spec={})  # fmt: skip
    assert io.groups.target_lengths(1, MEMBERS) is None


def test_a_config_written_for_real_engines_runs_sim_engines_too(tmp_path: Path) -> None:
    # the tiny example's prompts are shorter than a simulation's (the simulator refuses this
    # config); sim engines under `staleflow train` need the lengths alone
    tiny = SIM_TINY.parent / "tiny.yaml"
    over = ["rollout.backend=sim", "sim.total_gpus=3", "sim.rollout_gpus=2"]
    cfg = load_config(tiny, [f"run.run_dir={tmp_path}", *over])
    io = ShellIO(cfg, prompts=EncodedPrompts((), ()), ts_address=("127.0.0.1", 1), ts_token="t",
                 rollouts={}, trainer=None, rewards=[], reward_spec={})  # fmt: skip
    cap = cfg.rollout.sampling.max_new_tokens
    got = io.groups.target_lengths(1, cfg.protocol.group_size)
    assert got is not None and len(got) == cfg.protocol.group_size
    assert all(1 <= x <= cap for x in got)
