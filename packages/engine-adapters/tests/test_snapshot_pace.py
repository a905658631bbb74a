"""Snapshot deltas against a moving engine: a sim engine polled at a fine and a coarse period
(the entries sent do not grow with the polls), the view between polls (``due``, the
tolerance), and the pace the running count sets."""

from __future__ import annotations

import math
import random

import attrs
from snapshot_link import F, Link, snap, view

from engine_adapters import (
    EngineSnapshot,
    GenerateRequest,
    SamplingParams,
    SnapshotDecoder,
    SnapshotEncoder,
)
from engine_adapters.sim import CostModel, SimConfig, SimEngineCore

COST = CostModel(name="t", k1=1e-6, k2=0.01, b=0.004, k3=1e-3, k4=0.002)


# --- the sim engine, polled at a fine and a coarse period ------------------------------------


def run_sim(period: float, seed: int = 0) -> tuple[int, int, int, int]:
    """Drive a sim engine under KV pressure (preemptions) with a weight load and interrupts;
    poll every ``period`` s through the codec. Returns (adds, running entries polled, starts,
    preemptions)."""
    rng = random.Random(seed)
    core = SimEngineCore(
        SimConfig(
            cost=COST,
            kv_capacity_tokens=3_000,
            max_model_len=1_024,
            prefill_s_per_token=1e-5,
            max_running=32,
        ),
        instance_id="i0",
    )
    for k in range(48):
        core.add(
            GenerateRequest(
                trajectory_id=f"t{k}",
                prompt_token_ids=[20] * rng.randint(4, 40),
                sampling=SamplingParams(max_new_tokens=400, stop_token_ids=(2,)),
                target_length=rng.randint(50, 400),
            ),
            now=0.0,
        )
    link = Link()
    polled = 0
    t = 0.0
    loaded = interrupted = False
    while core.next_event_time() < math.inf or not loaded:
        t += period
        ended = {c.trajectory_id for c in core.advance_to(t)}
        if not interrupted and t > 0.5:
            ended |= {c.trajectory_id for c in core.interrupt(["t3", "t7"], now=t)}
            interrupted = True
        if not loaded and t > 1.0:
            core.load_weights(1, 10_000, now=t)
            loaded = True
        s = core.snapshot(t)
        polled += len(s.running)
        got = link.poll(s, ended)
        assert got is not None and view(got) == view(s)
        assert t < 120, "the engine did not drain"
    return link.added, polled, 48, core.preemptions


def test_sim_engine_round_trip_and_entries_do_not_grow_with_polls() -> None:
    coarse, polled_coarse, starts, pre_coarse = run_sim(0.05)
    fine, polled_fine, _, pre_fine = run_sim(0.005)
    assert pre_coarse > 0 and pre_fine > 0
    assert polled_fine > 5 * polled_coarse  # ten times the polls ...
    # ... but about the same entries: one per start, preemption, resume or load, plus a
    # resend when a prefill head starts decoding; never one per running trajectory per poll
    assert fine <= 1.2 * coarse + 10, (fine, coarse)
    assert fine < polled_fine / 20
    for added, pre in ((coarse, pre_coarse), (fine, pre_fine)):
        # each entry of the running set: a start or resume (after a preemption or the weight
        # load) and at most one resend when its prefill ends
        assert added <= 2 * (starts + pre + starts), (added, pre)


def test_an_engine_without_a_step_counter_is_still_exact() -> None:
    link = Link()
    for k in range(10):
        s = snap({"a": (10, k)}, steps=0, seq=k + 1)
        got = link.poll(s)
        assert got is not None and view(got) == view(s)
    assert link.added == 10  # every change is resent


def test_due_tells_when_the_view_is_off_and_the_view_moves_on_without_polls() -> None:
    link = Link()
    link.enc = SnapshotEncoder(tolerance=0.05)
    for k in range(3):  # the full snapshot, then the rate (10 steps a second) is learned
        link.poll(snap({"a": (10, 10 * k)}, steps=10 * k, seq=k + 1))
    for k in range(3, 10):  # steady: never due, and the view between polls keeps up
        s = snap({"a": (10, 10 * k)}, steps=10 * k, seq=k + 1)
        assert not link.enc.due(s)
        got = link.dec.view(s.time_s)
        assert got is not None and view(got) == view(s)
    stalled = snap({"a": (10, 90)}, steps=90, seq=11)  # no step for a second
    assert link.enc.due(stalled)
    assert link.poll(stalled) is not None
    assert not link.enc.due(stalled)  # corrected by the poll
    assert link.enc.due(snap({"a": (10, 90), "b": (4, 0)}, steps=90, seq=11))  # one starts
    assert link.enc.due(snap({}, steps=90, seq=11))  # one leaves
    assert link.enc.due(attrs.evolve(stalled, version=1))  # a header field changes
    assert SnapshotEncoder().due(stalled)  # nothing sent yet
    assert SnapshotDecoder("i0").view(1.0) is None


def test_with_a_tolerance_a_small_shift_of_one_trajectory_is_not_resent() -> None:
    link = Link()
    link.enc = SnapshotEncoder(tolerance=0.1)
    for k in range(6):  # 10 steps a second, learned; b has 100 tokens more than a
        link.poll(snap({"a": (10, 10 * k), "b": (4, 100 + 10 * k)}, steps=10 * k, seq=k + 1))
    added = link.added
    s = snap({"a": (10, 60), "b": (4, 157)}, steps=60, seq=7)  # b paused 3 steps
    assert not link.enc.due(s)  # 3 of its 157 tokens: within 10 %
    got = link.poll(s)
    assert got is not None and link.added == added  # not resent ...
    counts = {r.trajectory_id: r.generated_tokens for r in got.running}
    assert counts == {"a": 60, "b": 160}  # ... and off by those 3
    s = snap({"a": (10, 90), "b": (4, 167)}, steps=90, seq=10)  # b waited 20 steps more
    assert link.enc.due(s)
    got = link.poll(s)
    assert got is not None and link.added == added + 1
    assert {r.trajectory_id: r.generated_tokens for r in got.running} == {"a": 90, "b": 167}


def test_a_field_due_found_off_is_sent_even_if_its_floor_grew_meanwhile() -> None:
    link = Link()
    link.enc = SnapshotEncoder(tolerance=0.05)
    for k in range(4):  # 100 steps a second, learned
        link.poll(snap({"a": (10, 100 * k)}, steps=100 * k, seq=k + 1))

    def at(t: float, steps: int) -> EngineSnapshot:
        return attrs.evolve(snap({"a": (10, steps)}, steps=steps), time_s=t)

    assert not link.enc.due(at(4.1, 330))  # three times faster: within one check's change
    assert link.enc.due(at(4.2, 360))  # still: 40 ahead of the view, over the 30 allowed
    # the poll it asks for comes 0.5 s later: the change since that check (150 steps) now
    # exceeds the view's error (140), but the field due() found off is sent anyway
    late = at(4.7, 510)
    d = link.send(late)
    assert d is not None and F(d)["steps"] == 510
    got = link.dec.decode(d, time_s=late.time_s)
    assert got is not None and got.decode_steps == 510


def test_with_a_tolerance_a_few_starts_among_many_running_wait_for_the_next_answer() -> None:
    link = Link()
    link.enc = SnapshotEncoder(tolerance=0.05)
    many = {f"g0/{i}": (8, 0) for i in range(64)}
    link.poll(snap(many, steps=0, seq=1))
    few = many | {f"g1/{i}": (8, 0) for i in range(3)}
    assert not link.enc.due(snap(few, steps=0, seq=2))  # 3 of 67: under 5 %
    more = few | {f"g2/{i}": (8, 0) for i in range(2)}
    assert link.enc.due(snap(more, steps=0, seq=2))  # 5 of 69: over
    got = link.poll(snap(few, steps=0, seq=2))  # whatever is asked, the answer is exact
    assert got is not None and view(got) == view(snap(few, steps=0, seq=2))


def test_the_running_count_sets_the_pace_a_start_or_an_end_needs_no_correction() -> None:
    """An engine whose decode step takes the same time whatever it runs (below its knee),
    checked every 0.1 s as an instance does, polled when a check finds the view off or a
    trajectory starts or ends: the delta that reports a start or an end also sends the pace
    from then on (the step rate last seen while busy, none while idle; the KV growing by the
    running count a step), so once the pace is learnt no check finds the view off. Sending
    the mean rate since the last values instead (the old pace) asked for a correcting poll
    after every start and end."""
    link = Link()
    link.enc = SnapshotEncoder(tolerance=0.05)
    # (from tick, running ids): 100 decode steps a second, a tick is 0.1 s
    plan = [(0, "ab"), (10, "abc"), (20, ""), (30, "d"), (40, "de"), (50, "")]
    started: dict[str, int] = {}
    steps = kv = 0
    polls: list[tuple[int, str]] = []
    for tick in range(60):
        ids = [ids for at, ids in plan if at <= tick][-1]
        now = {t: started.setdefault(t, steps) for t in ids}
        for t in [t for t in started if t not in ids]:
            del started[t]
        kv = sum(5 + steps - s0 for s0 in now.values())
        running = {t: (5, steps - s0) for t, s0 in now.items()}
        s = attrs.evolve(snap(running, steps=steps, seq=1), time_s=tick / 10,
                         kv_used_tokens=kv, kv_capacity_tokens=100_000)  # fmt: skip
        event = any(at == tick for at, _ in plan)
        if link.enc.due(s) or event:
            got = link.poll(s)
            assert got is not None and view(got) == view(s)  # tolerance: exact when resent
            polls.append((tick, "event" if event else "drift"))
        elif tick >= 10:  # the extrapolated view, within one check's progress
            got = link.dec.view(s.time_s)
            assert got is not None and abs(got.decode_steps - steps) <= 10
            assert abs(got.kv_used_tokens - kv) <= 10 * len(ids)
        if ids:
            steps += 10
    drift = [t for t, why in polls if why == "drift"]
    assert drift and max(drift) < 10  # learning the pace, then never again


def test_an_engine_without_a_step_counter_keeps_its_counts_when_the_running_count_changes() -> None:
    """SGLang's adapter keeps no step counter (``decode_steps`` stays 0): a start sends no step
    rate, so the receiver's counts do not run ahead of the engine's and come back down."""
    link = Link()
    link.enc = SnapshotEncoder(tolerance=0.05)

    def at(t: float, running: dict[str, tuple[int, int]], kv: int) -> EngineSnapshot:
        s = snap(running, steps=0, seq=1)
        return attrs.evolve(s, time_s=t, kv_used_tokens=kv, kv_capacity_tokens=100_000,
                            throughput_tokens_per_s=200.0)  # fmt: skip

    link.poll(at(0.0, {"a": (5, 0)}, 5))
    got = link.poll(at(0.1, {"a": (5, 0), "b": (5, 0)}, 10))
    assert got is not None and got.decode_steps == 0
    d = link.enc.encode(at(0.2, {"a": (5, 0), "b": (5, 0)}, 10), **link.dec.request())
    later = link.dec.view(0.5)
    assert later is not None and later.decode_steps == 0
    assert all(r.generated_tokens == 0 for r in later.running)
    assert d is None or "ds" not in F(d)
