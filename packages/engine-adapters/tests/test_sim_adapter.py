"""SimAdapter on a virtual clock, profiling, pause/resume, add_many, the cost model."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest

from engine_adapters import (
    EngineDead,
    EngineUnavailable,
    FinishReason,
    GenerateRequest,
    InvalidRequest,
    InvalidWeights,
    SamplingParams,
    UnknownTrajectory,
    write_profile_jsonl,
)
from engine_adapters.sim import (
    PRESETS,
    CostModel,
    SimAdapter,
    SimConfig,
    SimEngineCore,
    VirtualClock,
    preset,
    weights_nbytes,
)

COST = CostModel(name="t", k1=1e-6, k2=0.01, b=0.004, k3=1e-3, k4=0.002)


def config(**kw: object) -> SimConfig:
    base: dict[str, object] = dict(
        cost=COST, kv_capacity_tokens=50_000, max_model_len=4096, prefill_s_per_token=0.0
    )
    base.update(kw)
    return SimConfig(**base)  # type: ignore[arg-type]


def req(tid: str, target: int | None = None, max_new: int = 1000) -> GenerateRequest:
    return GenerateRequest(
        trajectory_id=tid,
        prompt_token_ids=(20,) * 10,
        sampling=SamplingParams(max_new_tokens=max_new, stop_token_ids=(2,)),
        target_length=target,
    )


def test_cost_presets_match_design() -> None:
    m = preset("qwen3-30b-a3b-h20")
    assert (m.k1, m.k2, m.b, m.k3, m.k4) == (7.28e-8, 0.01151, 0.00979, 1.249e-4, 8.67e-4)
    assert set(PRESETS) == {"qwen3-30b-a3b-h20", "qwen-7b-h20", "qwen-14b-h20"}
    # τ(64, 100k) = k4 + k1·kv + max(k2, b + k3·n)
    assert m.step_latency(64, 100_000) == pytest.approx(8.67e-4 + 7.28e-3 + 0.00979 + 64 * 1.249e-4)
    assert m.throughput(64, 100_000) == pytest.approx(64 / m.step_latency(64, 100_000))
    assert m.throughput(0, 0) == 0.0
    with pytest.raises(InvalidRequest):
        preset("gpt-5")
    with pytest.raises(InvalidRequest):
        CostModel(k1=-1.0, k2=0.0, k3=0.0, k4=0.0)


async def test_virtual_clock_drives_generation_and_interrupt() -> None:
    clock = VirtualClock()
    engine = SimAdapter(config(), clock=clock)
    await engine.start()
    short = asyncio.create_task(engine.generate(req("short", target=10)))
    long = asyncio.create_task(engine.generate(req("long", target=900)))
    await asyncio.sleep(0)
    t10 = sum(COST.step_latency(2, 20 + 2 * i) for i in range(10))
    await clock.advance_to(t10 + 1e-6)
    done = await asyncio.wait_for(short, 1)
    assert done.finish_reason is FinishReason.STOP and len(done.token_ids) == 10
    assert not long.done()
    snap = await engine.snapshot()
    assert snap.time_s == pytest.approx(t10 + 1e-6)
    assert [r.generated_tokens for r in snap.running] == [10]
    (part,) = await engine.interrupt(["long"])
    assert len(part.token_ids) == 10 and await long == part
    with pytest.raises(UnknownTrajectory):
        await engine.interrupt(["never-seen"])
    assert await engine.interrupt(["short"]) == []  # finished a moment ago: not an error
    await engine.close()
    with pytest.raises(EngineUnavailable):
        await engine.snapshot()


async def test_load_weights_waits_for_the_load_and_validates() -> None:
    clock = VirtualClock(auto_advance=True)
    shapes = {"w": (4, 8), "v": (8,)}
    engine = SimAdapter(
        config(weight_shapes=shapes, weight_bandwidth_bytes_per_s=1e3, weight_load_constant_s=2.0),
        clock=clock,
    )
    await engine.start()
    with pytest.raises(InvalidWeights, match="missing"):
        await engine.load_weights(1, {"w": (4, 8)})
    with pytest.raises(InvalidWeights, match="mis-shaped"):
        await engine.load_weights(1, {"w": (4, 9), "v": (8,)})
    assert engine.version == 0
    t0 = clock.now()
    weights = {"w": np.zeros((4, 8), np.float32), "v": np.zeros(8, np.float32)}
    assert await engine.load_weights(1, weights) == 1
    assert engine.version == 1
    assert clock.now() - t0 == pytest.approx((32 * 4 + 8 * 4) / 1e3 + 2.0)
    await engine.close()


def test_weights_nbytes_counts_shapes_and_arrays() -> None:
    assert weights_nbytes({"a": (2, 3), "b": np.zeros(5, np.float32)}, None, 2) == 12 + 20
    with pytest.raises(InvalidWeights, match="extra"):
        weights_nbytes({"a": (2, 3), "z": (1,)}, {"a": (2, 3)}, 2)
    with pytest.raises(InvalidWeights):
        weights_nbytes({}, None, 2)


async def test_profile_recovers_the_cost_model(tmp_path: Path) -> None:
    engine = SimAdapter(config(max_running=64, kv_capacity_tokens=200_000))
    points = [(1, 100), (8, 4_000), (32, 50_000), (64, 120_000)]
    measured = await engine.profile(points, steps=10)
    assert [(p.running, p.backend) for p in measured] == [(n, "sim") for n, _ in points]
    for p in measured:
        assert p.step_latency_s == pytest.approx(
            COST.step_latency(p.running, p.kv_tokens), rel=1e-3
        )
    path = tmp_path / "profile.jsonl"
    assert write_profile_jsonl(measured, path) == 4
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[2] == measured[2].to_json()
    with pytest.raises(InvalidRequest):
        await engine.profile([(65, 1000)])


def test_pause_freezes_and_resume_continues() -> None:
    core = SimEngineCore(config())
    core.add(req("a", target=100), now=0.0)
    core.pause(now=0.1)
    frozen = core.peek("a", 0.5).num_tokens
    assert core.peek("a", 5.0).num_tokens == frozen > 0
    assert core.next_event_time() == math.inf
    core.resume(now=5.0)
    (a,) = core.advance_to(100.0)
    assert a.num_tokens == 100 and a.time_s > 5.0


def test_add_many_is_all_or_nothing_and_matches_add() -> None:
    one = SimEngineCore(config())
    for i in range(5):
        one.add(req(f"t{i}", target=20 + i), now=0.0)
    many = SimEngineCore(config())
    many.add_many([req(f"t{i}", target=20 + i) for i in range(5)], now=0.0)
    a = {c.trajectory_id: c.time_s for c in one.advance_to(100.0)}
    b = {c.trajectory_id: c.time_s for c in many.advance_to(100.0)}
    assert a == pytest.approx(b)
    bad = SimEngineCore(config(max_model_len=64, kv_capacity_tokens=1000))
    too_long = GenerateRequest(trajectory_id="x", prompt_token_ids=(20,) * 64)
    with pytest.raises(InvalidRequest):
        bad.add_many([req("ok", target=5), too_long], now=0.0)
    assert bad.num_waiting == bad.num_running == 0


async def test_a_killed_engine_is_dead_for_every_waiting_and_later_call() -> None:
    clock = VirtualClock()
    shapes = {"w": (4, 8)}
    engine = SimAdapter(
        config(weight_shapes=shapes, weight_bandwidth_bytes_per_s=1e3, weight_load_constant_s=2.0),
        clock=clock,
    )
    await engine.start()
    await engine.check_health()  # nothing to report
    running = asyncio.create_task(engine.generate(req("running", target=900)))
    loading = asyncio.create_task(engine.load_weights(1, {"w": np.zeros((4, 8), np.float32)}))
    await asyncio.sleep(0)
    await clock.advance_to(0.5)
    engine.kill()
    for task in (running, loading):  # what waited on the engine fails: its output is lost
        with pytest.raises(EngineDead, match="died"):
            await asyncio.wait_for(task, 1)
    with pytest.raises(EngineDead):
        await engine.check_health()
    with pytest.raises(EngineDead):
        await engine.snapshot()
    with pytest.raises(EngineDead):
        await engine.generate(req("after"))
    assert isinstance(EngineDead("x"), EngineUnavailable)  # callers of the older error see it
    engine.kill()  # a second kill changes nothing
    await engine.close()  # closing a dead engine neither hangs nor raises
    await engine.check_health()  # nothing to report


@pytest.mark.parametrize("yields", range(6))
async def test_close_right_after_generate_calls_returns(yields: int) -> None:
    """``close`` on a real clock just after new work woke the driver: the driver's sleep
    ends on the wake-up and on the cancel at once. A sleep that swallowed the cancel (Python
    3.11's ``asyncio.wait_for`` returns the result of a wait that finished as it was
    cancelled) left the driver asleep for good, with nothing left to wake it, and ``close``
    waiting on it (found when a rollout actor closed right after a route)."""
    eng = SimAdapter(config(), speed=1.0)  # a real clock: 9 ms a step and more
    await eng.start()
    tasks = [asyncio.ensure_future(eng.generate(req(f"g/{i}", target=500))) for i in range(4)]
    for _ in range(yields):
        await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with asyncio.timeout(10):  # a close that hangs ends the test instead of hanging it
        await eng.close()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    assert loop.time() - t0 < 5
    assert all(
        isinstance(r, EngineUnavailable) or r.finish_reason is FinishReason.INTERRUPTED  # type: ignore[union-attr]
        for r in results
    ), results


async def test_a_cancelled_close_still_closes_and_a_second_close_waits_for_it() -> None:
    """A ``close`` cancelled while it waits for the driver: the closing runs on, a weight
    load that waited fails, the work is interrupted, and a second ``close`` returns only once
    the driver has stopped."""
    shapes = {"w": (4, 8)}
    eng = SimAdapter(config(weight_shapes=shapes, weight_load_constant_s=30.0), speed=1.0)
    await eng.start()
    running = asyncio.ensure_future(eng.generate(req("g/0", target=500)))
    loading = asyncio.ensure_future(eng.load_weights(1, {"w": np.zeros((4, 8), np.float32)}))
    await asyncio.sleep(0.05)
    first = asyncio.ensure_future(eng.close())
    await asyncio.sleep(0)
    first.cancel()
    async with asyncio.timeout(10):
        await eng.close()
        with pytest.raises(EngineUnavailable, match="closed"):
            await loading
        assert (await running).finish_reason is FinishReason.INTERRUPTED
    assert eng._driver is not None and eng._driver.done()
    with pytest.raises(asyncio.CancelledError):
        await first
