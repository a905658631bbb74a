"""``staleflow train`` with sim engines ends each trajectory at the response length the
simulator draws for it: every ``sim.workload`` setting (the distribution, its parameters, the
group correlation) reaches both shells. The rollout instance finds a trajectory's length from
its id (``sim.workload.GroupLengths.of``); no length crosses the control process. (The Ray
shell once drew its own lognormal lengths, and a ``power_law`` or trace workload reached the
simulator only.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine_adapters.sim import SimConfig
from staleflow_trainer.actors.rollout import RolloutActor
from staleflow_trainer.actors.rollout_wire import unpack_outcomes
from staleflow_trainer.config import load_config
from staleflow_trainer.runtime.prepare import rollout_kwargs
from staleflow_trainer.sim.shell import Simulation
from staleflow_trainer.sim.workload import engine_lengths
from trajectory_server import SamplingParams, TrajectoryStore
from trajectory_server.service import TrajectoryService

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
def test_a_trajectory_id_draws_the_simulators_length(tmp_path: Path, workload: list[str]) -> None:
    cfg = load_config(SIM_TINY, [f"run.run_dir={tmp_path}", *workload])
    assert cfg.protocol.group_size == MEMBERS
    lengths = engine_lengths(cfg)
    stream = Simulation(cfg).stream
    cap = cfg.rollout.sampling.max_new_tokens
    for index in (0, 1, 64, 299):  # group g<index>, across the stream's chunks
        want = [min(x, cap) for x in stream.group(index).response_lens[:MEMBERS]]
        assert [lengths.of(f"g{index}/{m}", cap) for m in range(MEMBERS)] == want
        assert [lengths.of(f"g{index:06d}/{m}", cap) for m in range(MEMBERS)] == want  # minted
        assert lengths.targets(index, MEMBERS, cap) == want
    assert lengths.of("g3/1", 5) == min(lengths.targets(3, 2, cap)[1], 5)  # capped
    for other in ("x/1", "g3", "g3/x", "g/1", "gx/1", "g3/1/2", "g\u00b2/1", "g3/\u0663"):
        assert lengths.of(other, cap) is None


def test_only_sim_instances_get_lengths(tmp_path: Path) -> None:
    cfg = load_config(SIM_TINY, [f"run.run_dir={tmp_path}", "rollout.backend=vllm"])
    kwargs = rollout_kwargs(cfg, 0, tmp_path)
    assert kwargs["backend"] == "vllm" and kwargs["lengths"] is None


def test_a_config_written_for_real_engines_runs_sim_engines_too(tmp_path: Path) -> None:
    # the tiny example's prompts are shorter than a simulation's (the simulator refuses this
    # config); sim engines under `staleflow train` need the lengths alone
    tiny = SIM_TINY.parent / "tiny.yaml"
    over = ["rollout.backend=sim", "sim.total_gpus=3"]
    cfg = load_config(tiny, [f"run.run_dir={tmp_path}", *over])
    cap = cfg.rollout.sampling.max_new_tokens
    got = engine_lengths(cfg).targets(0, cfg.protocol.group_size, cap)
    assert len(got) == cfg.protocol.group_size
    assert all(1 <= x <= cap for x in got)


async def test_a_sim_instance_ends_each_trajectory_at_its_ids_length(tmp_path: Path) -> None:
    """A real rollout actor with a sim engine, its work from a trajectory-server service on
    loopback whose records carry no length: each trajectory ends (EOS) at the length the
    workload gives its id."""
    over = ["sim.workload.response_len_median=12", "sim.workload.response_len_sigma=1.0"]
    cfg = load_config(SIM_TINY, [f"run.run_dir={tmp_path}", *over])
    lengths, cap, eos = engine_lengths(cfg), 40, 2
    store = TrajectoryStore()
    sampling = SamplingParams(max_new_tokens=cap, stop_token_ids=(eos,))
    ids = list(store.submit_group("g7", [5, 6, 7], MEMBERS, sampling=sampling))
    want = {t: lengths.of(t, cap) for t in ids}
    assert len(set(want.values())) > 1  # lengths that differ: each came from its own id
    svc = TrajectoryService(store, token="tok")
    address = await svc.start()
    actor = RolloutActor(instance_id="sim-0", backend="sim",
                         engine_kwargs={"config": SimConfig(eos_token_id=eos)},
                         ts_address=address, ts_token="tok", lengths=lengths)  # fmt: skip
    try:
        await actor.start()
        assert await actor.submit(0, ids) == MEMBERS
        got: dict[str, int] = {}
        async with asyncio.timeout(60):
            while len(got) < MEMBERS:
                await actor.wait_results(1.0)
                answer = await actor.poll(None, True)
                if answer and len(answer) > 1:
                    got |= {t: n for t, n, _ in unpack_outcomes(answer[1])}
        assert got == want
        assert all(len(store.get(t).generated_token_ids) == want[t] for t in ids)
    finally:
        await actor.close()
        await svc.stop()


def test_lengths_drawn_again_after_their_chunk_was_evicted_are_the_same(tmp_path: Path) -> None:
    from staleflow_trainer.sim.workload import CHUNK, KEEP_CHUNKS

    cfg = load_config(SIM_TINY, [f"run.run_dir={tmp_path}"])
    lengths, cap = engine_lengths(cfg), cfg.rollout.sampling.max_new_tokens
    first = [lengths.of(f"g{i:06d}/1", cap) for i in range(3)]
    for c in range(1, KEEP_CHUNKS + 2):  # more chunks than it keeps: the first goes
        lengths.of(f"g{c * CHUNK}/0", cap)
    assert len(lengths._chunks) == KEEP_CHUNKS and 0 not in lengths._chunks
    assert [lengths.of(f"g{i:06d}/1", cap) for i in range(3)] == first
