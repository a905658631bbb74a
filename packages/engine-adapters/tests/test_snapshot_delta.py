"""Snapshot deltas (``SnapshotEncoder`` / ``SnapshotDecoder``): the decoded snapshot equals the
engine's at every poll — across preemption and resume, weight loads, interrupts, an instance
restart, a lost answer — and the entries sent per trajectory do not grow with how many polls
it runs for."""

from __future__ import annotations

import math
import random
import re
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_adapters import (
    EngineSnapshot,
    GenerateRequest,
    RunningTrajectory,
    SamplingParams,
    SnapshotDecoder,
    SnapshotEncoder,
    pack_ids,
    unpack_ids,
)
from engine_adapters._delta import _CODE
from engine_adapters.sim import CostModel, SimConfig, SimEngineCore


def attrs_evolve(s: EngineSnapshot, *, kv: int) -> EngineSnapshot:
    return attrs.evolve(s, kv_used_tokens=kv, kv_capacity_tokens=100_000)


COST = CostModel(name="t", k1=1e-6, k2=0.01, b=0.004, k3=1e-3, k4=0.002)


def view(s: EngineSnapshot) -> tuple[Any, ...]:
    """Everything a consumer reads; ``running`` as a mapping (its order carries no meaning).
    Not ``seq``: the receiver numbers the snapshots it rebuilds itself."""
    running = {r.trajectory_id: (r.prompt_tokens, r.generated_tokens) for r in s.running}
    return (s.instance_id, s.version, running, s.waiting, s.kv_used_tokens,
            s.kv_capacity_tokens, s.throughput_tokens_per_s, s.decode_steps)  # fmt: skip


def snap(running: dict[str, tuple[int, int]], *, steps: int, seq: int = 1) -> EngineSnapshot:
    """Taken at ``time_s = seq``: one poll a second."""
    return EngineSnapshot(
        instance_id="i0",
        seq=seq,
        time_s=float(seq),
        version=0,
        running=tuple(
            RunningTrajectory(trajectory_id=t, prompt_tokens=p, generated_tokens=g)
            for t, (p, g) in running.items()
        ),
        waiting=0,
        kv_used_tokens=0,
        kv_capacity_tokens=1000,
        throughput_tokens_per_s=0.0,
        decode_steps=steps,
    )


def F(d: Any) -> dict[str, Any]:
    """A delta's fields by name (they travel as numbers)."""
    return SnapshotDecoder.fields(d)


class Link:
    """One instance's encoder and the control side's decoder; each request carries what the
    decoder's ``request()`` says (an acknowledgement or a call for a full snapshot)."""

    def __init__(self) -> None:
        self.enc = SnapshotEncoder()
        self.dec = SnapshotDecoder("i0")
        self.added = 0

    def send(self, s: EngineSnapshot, ended: set[str] | None = None) -> dict[str, Any] | None:
        d = self.enc.encode(s, **self.dec.request(), ended=ended or set())
        self.added += sum(len(g) - 3 for g in F(d).get("add", ())) if d else 0
        return d

    def poll(self, s: EngineSnapshot, ended: set[str] | None = None) -> EngineSnapshot | None:
        return self.dec.decode(self.send(s, ended), time_s=s.time_s, ended=ended or set())


def test_steady_decoding_sends_each_trajectory_once_and_then_nothing() -> None:
    link = Link()
    sent = []
    for k in range(50):
        s = snap({"a": (10, 3 * k), "b": (7, 3 * k + 3)}, steps=100 + 3 * k, seq=k + 1)
        d = link.send(s)
        sent.append(set(F(d) if d else ()))
        got = link.dec.decode(d, time_s=s.time_s)
        assert got is not None and view(got) == view(s)
    assert link.added == 2
    # the first poll after the full snapshot teaches the pace (3 steps a poll); from then on
    # the receiver extrapolates the step counter, and a steady engine sends nothing
    assert sent[1] == {"k", "steps", "ds"}
    assert all(not d for d in sent[2:]), sent


def test_a_change_of_pace_is_followed_within_a_few_polls() -> None:
    link = Link()
    steps, corrections = 0, []
    for k in range(60):
        steps += 2 if k < 20 else 5  # the engine speeds up (fewer running)
        s = snap({"a": (10, steps)}, steps=steps, seq=k + 1)
        d = link.send(s)
        if d is not None and "steps" in F(d):
            corrections.append(k)
        got = link.dec.decode(d, time_s=s.time_s)
        assert got is not None and view(got) == view(s)  # exact at every poll meanwhile
    assert corrections[:2] == [0, 1] and all(k >= 20 for k in corrections[2:])  # full, pace
    assert 20 in corrections and corrections[-1] < 40, corrections  # the smoothed pace caught up


def test_with_a_tolerance_the_extrapolation_stays_within_it() -> None:
    link = Link()
    link.enc = SnapshotEncoder(tolerance=0.1)
    rng = random.Random(0)
    steps, answers, base, last = 0, 0, 0, 0
    for k in range(400):
        last, steps = steps, steps + rng.randint(8, 12)  # a jittery pace
        s = attrs_evolve(snap({"a": (10, steps)}, steps=steps, seq=k + 1), kv=10 + steps)
        d = link.send(s)
        answers += d is not None and "steps" in F(d)
        if d is not None and "steps" in F(d):
            base = steps
        got = link.dec.decode(d, time_s=s.time_s)
        assert got is not None
        # off by at most the tolerance's share of the progress since the last correction, or
        # by one poll's progress
        assert abs(got.decode_steps - steps) <= max(0.1 * (steps - base), steps - last)
        assert abs(got.kv_used_tokens - s.kv_used_tokens) <= max(
            0.1 * s.kv_capacity_tokens, steps - last
        )
        assert got.running[0].generated_tokens - steps == got.decode_steps - steps
    assert answers < 100, answers  # far fewer than one a poll
    with pytest.raises(ValueError, match="tolerance"):
        SnapshotEncoder(tolerance=1.0)


def test_a_count_behind_the_extrapolation_is_never_negative() -> None:
    link = Link()
    link.enc = SnapshotEncoder(tolerance=0.5)
    steps = 0
    for k in range(4):
        steps += 10
        link.poll(snap({"a": (5, steps), "c": (5, steps)}, steps=steps, seq=k + 1))
    steps += 14  # faster, within the allowance: the receiver's step counter runs 4 behind
    # b starts as c leaves (the running count stays: the step counter is not resent)
    s = snap({"a": (5, steps), "b": (5, 0)}, steps=steps, seq=5)
    got = link.poll(s)
    assert got is not None and got.decode_steps == steps - 4
    assert {r.trajectory_id: r.generated_tokens for r in got.running} == {"a": steps - 4, "b": 0}


def test_the_samples_of_a_group_share_one_entry() -> None:
    link = Link()
    running = {f"g7/{i}": (12, 0) for i in range(8)} | {"x/01": (12, 0), "plain": (12, 0)}
    link.poll(snap({}, steps=5, seq=1))
    s = snap(running, steps=5, seq=2)
    d = link.send(s)
    assert d is not None
    assert sorted(F(d)["add"], key=str) == sorted(
        [[12, -5, "g7", *range(8)], [12, -5, None, "x/01", "plain"]], key=str
    )  # "x/01" would not come back the same from a number: it goes whole
    got = link.dec.decode(d, time_s=s.time_s)
    assert got is not None and view(got) == view(s)


def test_nothing_changed_is_none_and_decodes_to_the_same_snapshot() -> None:
    link = Link()
    link.poll(snap({"a": (10, 0)}, steps=0, seq=1))
    s = snap({"a": (10, 0)}, steps=0, seq=2)
    assert link.send(s) is None
    assert view(link.dec.decode(None, time_s=s.time_s) or s) == view(s)
    s = snap({"a": (10, 0)}, steps=0, seq=9)  # the engine took snapshots for others meanwhile
    assert link.send(s) is None  # its numbering does not travel
    got = link.dec.decode(None, time_s=s.time_s)
    assert got is not None and view(got) == view(s) and got.seq == 3  # the receiver's third
    assert SnapshotDecoder("i0").decode(None, time_s=9.0) is None  # nothing to repeat yet


def test_preemption_and_resume_resend_once_each() -> None:
    link = Link()
    link.poll(snap({"a": (10, 0), "b": (10, 0)}, steps=0, seq=1))
    link.poll(snap({"a": (10, 5), "b": (10, 5)}, steps=5, seq=2))
    s = snap({"a": (10, 8)}, steps=8, seq=3)  # b preempted: leaves running, no outcome
    d = link.send(s)
    assert d is not None and F(d)["left"] == ["b"] and "add" not in F(d)
    assert view(link.dec.decode(d, time_s=s.time_s) or s) == view(s)
    s = snap({"a": (10, 12), "b": (10, 5)}, steps=12, seq=4)  # b resumed with what it had
    d = link.send(s)
    assert d is not None and F(d)["add"] == [[10, 5 - 12, None, "b"]]
    assert view(link.dec.decode(d, time_s=s.time_s) or s) == view(s)
    # a stall inside the engine (count stops following the steps) is resent, not guessed
    s = snap({"a": (10, 12), "b": (10, 6)}, steps=13, seq=5)
    assert view(link.poll(s) or s) == view(s)


def test_outcomes_replace_left_and_a_resubmitted_id_is_sent_again() -> None:
    link = Link()
    link.poll(snap({"a": (10, 0), "b": (10, 0)}, steps=0, seq=1))
    s = snap({"b": (10, 4)}, steps=4, seq=2)
    d = link.send(s, ended={"a"})
    assert d is not None and "left" not in F(d) and "add" not in F(d)  # a's end is in the outcomes
    assert view(link.dec.decode(d, time_s=s.time_s, ended={"a"}) or s) == view(s)
    # b's outcome and b again (routed back here) in one answer: the decoder drops it, then
    # re-adds it from the entry
    s = snap({"b": (10, 6)}, steps=9, seq=3)
    assert view(link.poll(s, ended={"b"}) or s) == view(s)


def test_a_lost_answer_gets_a_full_snapshot_next() -> None:
    link = Link()
    link.poll(snap({"a": (10, 0)}, steps=0, seq=1))
    lost = link.send(snap({"a": (10, 3), "b": (5, 0)}, steps=3, seq=2))
    assert lost is not None and "full" not in F(lost)
    # the next request acknowledges nothing new: the encoder cannot build on `lost`, even if
    # nothing changed since (a None would repeat the snapshot before it)
    s = snap({"a": (10, 3), "b": (5, 0)}, steps=3, seq=3)
    d = link.send(s)
    assert d is not None and F(d)["full"] == 1
    assert view(link.dec.decode(d, time_s=s.time_s) or s) == view(s)


def test_an_answer_never_decoded_gets_a_full_snapshot_next() -> None:
    link = Link()
    link.poll(snap({"a": (10, 0)}, steps=0, seq=1))
    link.poll(snap({"a": (10, 1)}, steps=1, seq=2))
    # someone else polled (a recovering shell's quiesce) and dropped the answer
    assert link.enc.encode(snap({"a": (10, 2)}, steps=2, seq=3)) is not None
    s = snap({"a": (10, 2)}, steps=2, seq=4)
    d = link.send(s)  # acknowledges the delta before the dropped one
    assert d is not None and F(d)["full"] == 1
    assert view(link.dec.decode(d, time_s=s.time_s) or s) == view(s)


def test_a_delta_out_of_order_is_refused() -> None:
    link = Link()
    link.poll(snap({"a": (10, 0)}, steps=0, seq=1))
    enc = link.enc
    enc.encode(snap({"a": (10, 1)}, steps=1, seq=2), ack=link.dec.k)  # lost in transit
    stray = enc.encode(snap({"a": (10, 2), "b": (5, 0)}, steps=2, seq=3), ack=link.dec.k + 1)
    assert stray is not None and "full" not in F(stray)
    assert link.dec.decode(stray, time_s=3.0) is None  # k skips one: refused, not guessed
    assert link.dec.request() == {"full": True}
    s = snap({"a": (10, 3), "c": (1, 0)}, steps=3, seq=4)
    assert view(link.poll(s) or s) == view(s)


def test_an_instance_restart_sends_a_full_snapshot() -> None:
    link = Link()
    link.poll(snap({"a": (10, 0), "b": (10, 0)}, steps=0, seq=1))
    link.poll(snap({"a": (10, 1), "b": (10, 1)}, steps=1, seq=2))
    link.enc = SnapshotEncoder()  # a new process under the same instance id
    s = snap({"c": (4, 0)}, steps=0, seq=1)
    d = link.send(s)
    assert d is not None and F(d)["full"] == 1
    got = link.dec.decode(d, time_s=s.time_s)
    assert got is not None and view(got) == view(s)  # nothing of the old process survives
    # its delta counter starts anywhere: a follower of the old process's is refused
    link.enc = SnapshotEncoder()
    first = link.enc.encode(snap({"d": (4, 0)}, steps=0, seq=1))
    assert first is not None
    follower = link.enc.encode(snap({"d": (4, 1)}, steps=1, seq=2), ack=F(first)["k"])
    assert follower is not None and F(follower)["k"] != link.dec.k + 1  # (1 in 2**30 it is)
    assert link.dec.decode(follower, time_s=2.0) is None


def test_a_count_that_does_not_add_up_is_refused() -> None:
    link = Link()
    link.poll(snap({"a": (10, 0)}, steps=0, seq=1))
    d = link.send(snap({"a": (10, 1)}, steps=1, seq=2))
    assert d is not None
    with pytest.raises(ValueError, match="n=2"):
        link.dec.decode({**d, _CODE["n"]: 2}, time_s=2.0)
    assert link.dec.request() == {"full": True}
    with pytest.raises(ValueError, match="not snapshot delta fields"):
        link.dec.decode({**d, "n": 2}, time_s=2.0)


# --- property: random running sets, paces, ends, lost answers and restarts -------------------


@st.composite
def histories(draw: st.DrawFn) -> list[tuple[str, Any]]:
    ops: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(1, 40))):
        ops.append(
            draw(
                st.one_of(
                    st.tuples(st.just("step"), st.integers(0, 5)),
                    st.tuples(st.just("step"), st.just(3)),  # repeats: a steady pace
                    st.tuples(st.just("start"), st.integers(0, 9)),
                    st.tuples(st.just("pause"), st.integers(0, 9)),  # preempted / waiting
                    st.tuples(st.just("end"), st.integers(0, 9)),
                    st.tuples(st.just("lose"), st.none()),
                    st.tuples(st.just("restart"), st.none()),
                    st.tuples(st.just("no_counter"), st.booleans()),
                )
            )
        )
    return ops


def tid_of(n: int) -> str:
    """Ids of both shapes: ``g<k>/<n>`` (grouped by prefix) and others (sent whole)."""
    return f"g{n % 2}/{n}" if n % 3 else f"t{n}"


@given(histories())
@settings(max_examples=300, deadline=None)
def test_decoded_snapshot_equals_the_engines(ops: list[tuple[str, Any]]) -> None:
    link = Link()
    steps = 0
    counter = True  # the engine reports decode_steps
    running: dict[str, list[int]] = {}  # id -> [prompt, generated, decoding?]
    paused: dict[str, list[int]] = {}
    ended: set[str] = set()
    seq = 0
    for op, arg in ops:
        if op == "step":
            steps += arg
            for e in running.values():
                e[1] += arg
        elif op == "start":
            tid = tid_of(arg)
            if tid in paused:
                running[tid] = paused.pop(tid)
            elif tid not in running:
                running[tid] = [arg + 1, 0]
        elif op == "pause":
            tid = tid_of(arg)
            if tid in running:
                paused[tid] = running.pop(tid)
        elif op == "end":
            tid = tid_of(arg)
            running.pop(tid, None)
            paused.pop(tid, None)
            ended.add(tid)
        elif op == "restart":
            link.enc = SnapshotEncoder()
        elif op == "no_counter":
            counter = arg
        seq += 1
        s = snap({t: (p, g) for t, (p, g) in running.items()}, steps=steps if counter else 0,
                 seq=seq)  # fmt: skip
        if op == "lose":
            # the answer (and its outcomes) never arrives; a lost delta goes unnoticed by the
            # receiver (the acknowledgements repair it), a lost None costs nothing
            link.send(s, ended)
            ended = set()
            continue
        got = link.poll(s, ended)
        ended = set()
        assert got is not None and view(got) == view(s)


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


@given(
    st.lists(
        st.one_of(
            st.builds(lambda g, n: f"g{g}/{n}", st.integers(0, 3), st.integers(0, 20)),
            st.sampled_from(["plain", "g1", "g1/01", "x/y/3", "7", "a/"]),
        ),
        max_size=30,
    )
)
def test_packed_ids_unpack_to_the_same_ids_grouped_by_prefix(ids: list[str]) -> None:
    packed = pack_ids(ids)
    got = unpack_ids(packed)
    assert sorted(got) == sorted(ids)  # the same ids, as many times each
    assert unpack_ids(got) == got  # a plain list of ids unpacks to itself
    # grouped: the samples of one prompt send their prefix once, other ids go whole
    numbered = [re.fullmatch(r"(.*)/(0|[1-9][0-9]*)", t) for t in ids]
    prefixes = {m.group(1) for m in numbered if m}
    whole = sum(1 for m in numbered if not m)
    assert sum(isinstance(x, str) for x in packed) == len(prefixes) + whole


def test_packed_ids_are_compact_and_malformed_ones_are_refused() -> None:
    ids = [f"g000123/{i}" for i in range(0, 8, 2)]
    assert pack_ids(ids) == ["g000123", 0, 2, 4, 6]
    assert unpack_ids(["a", "g7", 1, "b"]) == ["a", "g7/1", "b"]
    with pytest.raises(ValueError, match="follows no prefix"):
        unpack_ids([3, "g7"])
    with pytest.raises(ValueError, match="follows no prefix"):
        unpack_ids(["g7", True])


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
