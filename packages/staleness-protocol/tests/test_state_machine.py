"""Hypothesis drives random interleavings of every operation; invariants after every step.

The protocol runs beside ``testing.ReferenceModel`` (a naive slot-array model of the same rules
that keeps the whole history): placements, admission answers, finish outcomes, the notices
(each exactly once), what stays live and what is tombstoned after retirement must agree.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from staleness_protocol import (
    Abort,
    FinishStatus,
    GroupAborted,
    GroupClosed,
    NotAdmissible,
    Notice,
    NotReady,
    ProtocolConfig,
    StalenessProtocol,
)
from staleness_protocol.testing import ReferenceModel, check_invariants, layout


def as_tuple(n: Notice) -> tuple[Any, ...]:
    if isinstance(n, Abort):
        return ("abort", n.trajectory_id, n.reason, n.was_running)
    if isinstance(n, GroupAborted):
        return ("group_aborted", n.group_id, n.reason)
    return ("replacement", n.replaces_group_id, n.reason)


class ProtocolMachine(RuleBasedStateMachine):
    p: StalenessProtocol
    model: ReferenceModel

    def __init__(self) -> None:
        super().__init__()
        self.started = False

    @initialize(
        batch_size=st.integers(1, 3),
        group_size=st.integers(1, 3),
        eta=st.integers(0, 2),
        batch_redundancy=st.integers(0, 2),
        group_redundancy=st.integers(0, 2),
        filtering=st.booleans(),
        stuck=st.one_of(st.none(), st.integers(1, 2)),
        start_version=st.integers(0, 3),
        tombstone_versions=st.integers(1, 3),
    )
    def start(
        self,
        batch_size: int,
        group_size: int,
        eta: int,
        batch_redundancy: int,
        group_redundancy: int,
        filtering: bool,
        stuck: int | None,
        start_version: int,
        tombstone_versions: int,
    ) -> None:
        if stuck is not None and stuck >= batch_size:
            stuck = None
        self.config = ProtocolConfig(
            batch_size=batch_size,
            group_size=group_size,
            eta=eta,
            batch_redundancy=batch_redundancy,
            group_redundancy=group_redundancy,
            filtering=filtering,
            stuck_threshold=stuck,
            tombstone_versions=tombstone_versions,
        )
        self.p = StalenessProtocol(self.config, start_version=start_version)
        self.model = ReferenceModel(self.config, start_version=start_version)
        self.admitted: set[str] = set()
        self.consumed_staleness: list[int] = []
        self.promised: set[str] = set()  # seen in next_batch_groups() since the last consume
        self.next_id = 0
        self.started = True

    def _new_id(self, prefix: str) -> str:
        self.next_id += 1
        return f"{prefix}{self.next_id}"

    def _in_flight(self) -> list[str]:
        return sorted(str(t) for t, s in self.model.states().items() if s == "in_flight")

    def _version(self, data: st.DataObject) -> int:
        return data.draw(st.integers(0, self.p.published_version), label="version")

    def _try_reserve(self, gid: str, version: int) -> None:
        tid = self._new_id("t")
        answer = self.p.can_reserve(gid, version)
        assert answer.value == self.model.admission(gid, version)
        expected = self.model.reserve(gid, tid, version)
        if answer == "admit":
            assert self.p.reserve(gid, tid, version) == expected
            self.admitted.add(tid)
        else:
            assert expected is None
            before = self.p.to_dict()
            with pytest.raises(NotAdmissible) as e:
                self.p.reserve(gid, tid, version)
            assert e.value.admission is answer
            assert self.p.to_dict() == before

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def reserve_new_group(self, data: st.DataObject) -> None:
        self._try_reserve(self._new_id("g"), self._version(data))

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def reserve_sibling(self, data: st.DataObject) -> None:
        """A sibling of a live group, or a late one of a group closed within the window."""
        _trajs, tombs = self.model.tombstone_ids()
        groups = sorted(
            str(g) for g, e in self.model.groups.items() if e["state"] in ("reserved", "occupied")
        )
        groups += sorted(str(g) for g in tombs)
        if groups:
            gid = data.draw(st.sampled_from(groups), label="group")
            self._try_reserve(gid, self._version(data))

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def reserve_whole_group(self, data: st.DataObject) -> None:
        """Route all n' members of a fresh prompt at once (the common case)."""
        version = self._version(data)
        gid = self._new_id("g")
        for _ in range(self.config.samples_per_group):
            self._try_reserve(gid, version)
            if gid not in self.model.groups:
                break

    def _finish(self, tid: str) -> None:
        expected = self.model.finish(tid)
        out = self.p.finish(tid)
        if expected is None:
            assert out.status is FinishStatus.WAITING and out.buffer is None
        else:
            assert (out.status, out.buffer) == (FinishStatus.OCCUPIED, expected)

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        live = self._in_flight()
        if live:
            self._finish(data.draw(st.sampled_from(live), label="finish"))

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def finish_group(self, data: st.DataObject) -> None:
        """Finish the running members of one group until it occupies (or runs out)."""
        groups = sorted(str(g) for g, e in self.model.groups.items() if e["state"] == "reserved")
        if not groups:
            return
        gid = data.draw(st.sampled_from(groups), label="finish_group")
        for tid in list(self.model.groups[gid]["members"]):
            if self.model.groups[gid]["state"] != "reserved":
                break
            if self.model.trajs[tid]["state"] == "in_flight":
                self._finish(tid)

    @precondition(lambda self: self.started)
    @rule(data=st.data(), by_abort=st.booleans())
    def late_result_of_an_ended_trajectory(self, data: st.DataObject, by_abort: bool) -> None:
        """An engine reports a trajectory the protocol (or the caller) ended while it ran:
        finish answers ALREADY_ENDED, abort False, and nothing changes."""
        tombs, _groups = self.model.tombstone_ids()
        ended = sorted(str(t) for t in tombs if self.model.trajs[t]["was_running"])
        if not ended:
            return
        tid = data.draw(st.sampled_from(ended), label="late")
        before = self.p.to_dict()
        if by_abort:
            assert self.p.abort(tid, "late") is False
            assert self.model.abort(tid) is False
        else:
            out = self.p.finish(tid)
            assert self.model.finish(tid) == "already_ended"
            assert out.status is FinishStatus.ALREADY_ENDED
            assert out.reason == self.model.trajs[tid]["reason"]
        assert self.p.to_dict() == before

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = self._in_flight()
        if live:
            tid = data.draw(st.sampled_from(live), label="abort")
            assert self.p.abort(tid, "interrupted for good") is True
            assert self.model.abort(tid) is True

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def drop_group(self, data: st.DataObject) -> None:
        _trajs, tombs = self.model.tombstone_ids()
        groups = sorted(
            str(g) for g, e in self.model.groups.items() if e["state"] in ("reserved", "occupied")
        )
        groups += sorted(str(g) for g in tombs if self.model.groups[g]["state"] == "aborted")
        if groups:
            gid = data.draw(st.sampled_from(groups), label="drop")
            assert self.p.drop_group(gid, "filtered") == self.model.drop_group(gid, "filtered")
            self.promised.discard(gid)  # the one way a promised group leaves the next batch

    @precondition(lambda self: self.started)
    @rule()
    def consume(self) -> None:
        if self.p.ready():
            promised = self.p.next_batch_groups()
            batch = self.p.consume()
            assert set(batch.group_ids) == set(self.model.consume())
            assert batch.group_ids == promised  # READY: exactly these, in this order
            assert self.promised <= set(batch.group_ids)
            self.promised.clear()
            assert len(batch.group_ids) == self.config.batch_size
            for group_stale in batch.trajectory_staleness:
                assert len(group_stale) == self.config.group_size
                self.consumed_staleness.extend(group_stale)
        else:
            with pytest.raises(NotReady):
                self.p.consume()

    @precondition(lambda self: self.started)
    @rule()
    def publish(self) -> None:
        if self.p.published_version < self.p.next_buffer:
            self.p.publish(self.p.published_version + 1)
            self.model.publish(self.model.published + 1)

    @precondition(lambda self: self.started and self.config.stuck_threshold is not None)
    @rule()
    def resolve_stuck(self) -> None:
        res = self.p.resolve_stuck()
        assert res.resolved == self.model.resolve_stuck()
        if res.resolved:
            assert self.p.ready()

    @precondition(lambda self: self.started)
    @rule()
    def checkpoint_restore(self) -> None:
        self.p = StalenessProtocol.from_dict(json.loads(json.dumps(self.p.to_dict())))

    @precondition(lambda self: self.started)
    @rule()
    def drain_notices(self) -> None:
        """Exactly the notices the model expects since the last drain, each once; a group's
        member aborts come before its GroupAborted."""
        got = self.p.take_notices()
        expected, self.model.notices = self.model.notices, []
        assert Counter(as_tuple(n) for n in got) == Counter(expected)
        assert self.p.take_notices() == ()
        closed: set[Any] = set()
        for n in got:
            if isinstance(n, GroupAborted):
                closed.add(n.group_id)
            elif isinstance(n, Abort):
                assert n.group_id not in closed, "an Abort after its group's GroupAborted"
                assert n.trajectory_id in self.admitted

    # ------------------------------------------------------------------ invariants

    @invariant()
    def protocol_invariants_hold(self) -> None:
        if self.started:
            check_invariants(self.p)

    @invariant()
    def next_batch_groups_are_occupied_in_the_next_buffer(self) -> None:
        if self.started:
            ids = self.p.next_batch_groups()
            assert len(ids) == self.p.buffer_fill(self.p.next_buffer).occupied
            for gid in ids:
                rec = self.p.group(gid)
                assert rec.state == "occupied" and rec.buffer == self.p.next_buffer
            self.promised.update(str(g) for g in ids)

    @invariant()
    def reserved_buffer_is_a_reserved_groups_buffer(self) -> None:
        if self.started:
            for gid, e in self.model.groups.items():
                want = self.p.group(gid).buffer if e["state"] == "reserved" else None
                assert self.p.reserved_buffer(gid) == want
            assert self.p.reserved_buffer("never-seen") is None

    @invariant()
    def consumed_staleness_within_eta(self) -> None:
        if self.started:
            assert all(0 <= s <= self.config.eta for s in self.consumed_staleness)

    @invariant()
    def staleness_histogram_matches_consumed_data(self) -> None:
        if self.started:
            hist: dict[int, int] = {}
            for x in self.consumed_staleness:
                hist[x] = hist.get(x, 0) + 1
            stats = self.p.stats()
            assert stats.staleness_histogram == hist
            assert sum(hist.values()) == stats.trajectories_by_state["consumed"]

    @invariant()
    def capacities_never_exceeded(self) -> None:
        if self.started:
            for fill in self.p.stats().buffers:
                assert fill.occupied <= self.config.batch_size
                assert fill.occupied + fill.reserved <= self.config.slots_per_buffer
                assert fill.free >= 0

    @invariant()
    def every_admitted_trajectory_accounted_for(self) -> None:
        if self.started:
            counts = self.p.stats().trajectories_by_state
            assert sum(counts.values()) == len(self.admitted)
            assert {k: v for k, v in counts.items() if v} == Counter(self.model.states().values())

    @invariant()
    def only_live_and_recent_entries_are_kept(self) -> None:
        """Retirement: the ledger holds exactly what is live plus the tombstones of what ended
        within the last tombstone_versions versions; it answers for exactly those."""
        if self.started:
            d = self.p.to_dict()
            assert {t[0]: t[3] for t in d["trajectories"]} == self.model.live_ids()
            tomb_t, tomb_g = self.model.tombstone_ids()
            assert {r[1] for r in d["tombstones"] if r[0] == "trajectory"} == tomb_t
            assert {r[1] for r in d["tombstones"] if r[0] == "group"} == tomb_g
            live_groups = {
                g for g, e in self.model.groups.items() if e["state"] in ("reserved", "occupied")
            }
            assert {g[0] for g in d["groups"]} == live_groups
            for tid in tomb_t:
                rec = self.p.trajectory(tid)
                assert rec.state == self.model.trajs[tid]["state"]
                assert rec.reason == self.model.trajs[tid]["reason"]
            for gid in tomb_g:
                assert self.p.group(gid).state == self.model.groups[gid]["state"]
                with pytest.raises(GroupClosed):  # a late sibling is never re-admitted
                    self.p.reserve(gid, "never-admitted", 0)

    @invariant()
    def agrees_with_reference_model(self) -> None:
        if self.started:
            got = {b: (set(o), set(r)) for b, (o, r) in layout(self.p).items()}
            assert got == self.model.layout()
            assert self.p.next_buffer == self.model.version
            assert self.p.published_version == self.model.published
            assert self.p.abort_floor == self.model.floor()

    @invariant()
    def round_trip_is_exact(self) -> None:
        if self.started:
            d = self.p.to_dict()
            text = json.dumps(d)
            assert StalenessProtocol.from_dict(json.loads(text)).to_dict() == d


ProtocolMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("SP_EXAMPLES", "300")),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestProtocolMachine = ProtocolMachine.TestCase
