"""The first poll after a route waits until the engine holds the routed work
(``actors.admission``): it sees the routed trajectories running, and the instance does not ask
for a second poll when they start."""

from __future__ import annotations

import asyncio
from pathlib import Path

from engine_adapters import EngineSnapshot, RunningTrajectory, SnapshotDecoder
from engine_adapters.sim import SimConfig
from staleflow_trainer.actors.admission import admitted
from staleflow_trainer.actors.rollout import RolloutActor
from staleflow_trainer.config import load_config
from staleflow_trainer.sim.workload import engine_lengths
from trajectory_server import SamplingParams, TrajectoryStore
from trajectory_server.service import TrajectoryService

SIM_TINY = Path(__file__).resolve().parents[3] / "examples" / "sim-tiny.yaml"


def _snap(running: tuple[str, ...], waiting: int, steps: int) -> EngineSnapshot:
    return EngineSnapshot(
        instance_id="i", seq=0, time_s=0.0, version=0, waiting=waiting, decode_steps=steps,
        running=tuple(RunningTrajectory(trajectory_id=t, prompt_tokens=3, generated_tokens=0)
                      for t in running),
        kv_used_tokens=0, kv_capacity_tokens=100, throughput_tokens_per_s=0.0,
    )  # fmt: skip


def _engine(snaps: list[EngineSnapshot]) -> tuple[list[int], object]:
    """A snapshot call that walks through ``snaps`` (the last one repeats) and counts calls."""
    calls = [0]

    async def snapshot() -> EngineSnapshot:
        calls[0] += 1
        return snaps[min(calls[0], len(snaps)) - 1]

    return calls, snapshot


async def test_it_waits_until_the_routed_work_runs() -> None:
    calls, snapshot = _engine([_snap((), 0, 5), _snap((), 2, 5), _snap(("a", "b"), 0, 6)])
    assert await admitted(snapshot, ["a", "b"], lambda t: True)  # type: ignore[arg-type]
    assert calls[0] == 3


async def test_work_left_waiting_after_a_step_waits_for_room_and_the_route_answers() -> None:
    # "b" is still queued once the engine stepped after both were queued: no room for it
    snaps = [_snap((), 2, 5), _snap(("a",), 1, 5), _snap(("a",), 1, 6), _snap(("a", "b"), 0, 9)]
    calls, snapshot = _engine(snaps)
    assert not await admitted(snapshot, ["a", "b"], lambda t: True)  # type: ignore[arg-type]
    assert calls[0] == 3


async def test_work_that_already_ended_does_not_hold_the_route() -> None:
    calls, snapshot = _engine([_snap(("a",), 0, 5)])
    assert await admitted(snapshot, ["a", "b"], lambda t: t == "a")  # type: ignore[arg-type]
    assert calls[0] == 1


async def test_an_engine_without_a_step_counter_is_waited_for_until_the_work_is_queued() -> None:
    calls, snapshot = _engine([_snap((), 0, 0), _snap((), 2, 0)])  # SGLang's: no counter
    assert not await admitted(snapshot, ["a", "b"], lambda t: True)  # type: ignore[arg-type]
    assert calls[0] == 2


async def test_work_the_engine_never_takes_holds_the_poll_for_the_limit_only() -> None:
    calls, snapshot = _engine([_snap(("x",), 0, 3)])  # never queued, never running
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert not await admitted(snapshot, ["a", "b"], lambda t: True, wait_s=0.1)  # type: ignore[arg-type]
    assert 0.1 <= loop.time() - t0 < 2.0 and calls[0] > 2


async def test_the_poll_after_a_route_sees_its_work_running(tmp_path: Path) -> None:
    """A real rollout actor with a sim engine and a trajectory-server service on loopback:
    the full snapshot a poll answers right after ``submit`` lists every routed trajectory as
    running (without the wait it listed one of four), and no further poll is asked for while
    they generate."""
    over = ["sim.workload.response_len_median=5000", "sim.workload.response_len_sigma=0"]
    cfg = load_config(SIM_TINY, [f"run.run_dir={tmp_path}", *over])
    store, members = TrajectoryStore(), 4
    sampling = SamplingParams(max_new_tokens=6000)
    first = list(store.submit_group("g6", [5, 6, 7], 1, sampling=sampling))
    ids = list(store.submit_group("g7", [5, 6, 7], members, sampling=sampling))
    svc = TrajectoryService(store, token="tok")
    address = await svc.start()
    sim = SimConfig()  # the 30B preset's pace: 5 000 tokens take over a minute
    actor = RolloutActor(instance_id="sim-0", backend="sim", engine_kwargs={"config": sim},
                         ts_address=address, ts_token="tok",
                         lengths=engine_lengths(cfg))  # fmt: skip
    try:
        await actor.start()
        # a first trajectory, until the engine has stepped (a step counter that reads 0 may
        # be none at all, as SGLang's: then the poll waits only until the work is queued)
        assert await actor.submit(0, first) == 1
        async with asyncio.timeout(30):
            while not (await actor._snapshot(actor._require())).decode_steps:
                await asyncio.sleep(0.01)
            await actor.poll(None, True)
        assert await actor.submit(0, ids) == members
        async with asyncio.timeout(30):
            answer = await actor.poll(None, True)
        decoder = SnapshotDecoder("sim-0")
        snap = decoder.decode(answer[0] if answer else None, time_s=0.0)
        assert snap is not None
        assert sorted(r.trajectory_id for r in snap.running) == sorted(first + ids)
        assert snap.waiting == 0
        # their start is known: the instance does not ask for a poll because of it
        assert not await actor.wait_results(0.5)
    finally:
        async with asyncio.timeout(30):
            await actor.close()
            await svc.stop()
