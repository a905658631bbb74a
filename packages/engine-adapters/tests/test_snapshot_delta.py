"""Snapshot deltas (``SnapshotEncoder`` / ``SnapshotDecoder``): the decoded snapshot equals the
engine's at every poll — across preemption and resume, weight loads, interrupts, an instance
restart, a lost answer — and the entries sent per trajectory do not grow with how many polls
it runs for. A sim engine polled at two periods, the view between polls and the pace are in
``test_snapshot_pace.py``; the codec link these tests share is ``snapshot_link.py``."""

from __future__ import annotations

import random
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from snapshot_link import F, Link, snap, view

from engine_adapters import EngineSnapshot, SnapshotDecoder, SnapshotEncoder
from engine_adapters._delta import _CODE


def attrs_evolve(s: EngineSnapshot, *, kv: int) -> EngineSnapshot:
    return attrs.evolve(s, kv_used_tokens=kv, kv_capacity_tokens=100_000)


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
