"""Hypothesis drives random interleavings of every operation; invariants after every step.

The protocol runs beside ``testing.ReferenceModel`` (a naive slot-array model of the same
rules): placements, inadmissibility and trajectory states must agree exactly.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from staleness_protocol import NotAdmissible, NotReady, ProtocolConfig, StalenessProtocol
from staleness_protocol.testing import ReferenceModel, check_invariants, layout


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
        )
        self.p = StalenessProtocol(self.config, start_version=start_version)
        self.model = ReferenceModel(self.config, start_version=start_version)
        self.admitted: set[str] = set()
        self.consumed_staleness: list[int] = []
        self.next_id = 0
        self.started = True

    def _new_id(self, prefix: str) -> str:
        self.next_id += 1
        return f"{prefix}{self.next_id}"

    def _in_flight(self) -> list[str]:
        return sorted(str(t) for t, s in self.model.states().items() if s == "in_flight")

    def _try_reserve(self, gid: str, version: int) -> None:
        tid = self._new_id("t")
        ok = self.p.can_reserve(gid, version)
        expected = self.model.reserve(gid, tid, version)
        if ok:
            assert self.p.reserve(gid, tid, version) == expected
            self.admitted.add(tid)
        else:
            assert expected is None
            before = self.p.to_dict()
            with pytest.raises(NotAdmissible):
                self.p.reserve(gid, tid, version)
            assert self.p.to_dict() == before

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def reserve_new_group(self, data: st.DataObject) -> None:
        version = data.draw(st.integers(0, self.p.current_version), label="version")
        self._try_reserve(self._new_id("g"), version)

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def reserve_sibling(self, data: st.DataObject) -> None:
        open_groups = sorted(
            str(g)
            for g, e in self.model.groups.items()
            if e["state"] == "reserved" and len(e["members"]) < self.config.samples_per_group
        )
        if not open_groups:
            return
        gid = data.draw(st.sampled_from(open_groups), label="group")
        version = data.draw(st.integers(0, self.p.current_version), label="version")
        self._try_reserve(gid, version)

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        live = self._in_flight()
        if live:
            tid = data.draw(st.sampled_from(live), label="finish")
            assert self.p.finish(tid) == self.model.finish(tid)

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def reserve_whole_group(self, data: st.DataObject) -> None:
        """Route all n' members of a fresh prompt at once (the common case)."""
        version = data.draw(st.integers(0, self.p.current_version), label="version")
        gid = self._new_id("g")
        for _ in range(self.config.samples_per_group):
            self._try_reserve(gid, version)
            if gid not in self.model.groups:
                break

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
                assert self.p.finish(tid) == self.model.finish(tid)

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = self._in_flight()
        if live:
            tid = data.draw(st.sampled_from(live), label="abort")
            self.p.abort(tid, "interrupted for good")
            self.model.abort(tid)

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def drop_group(self, data: st.DataObject) -> None:
        groups = sorted(
            str(g) for g, e in self.model.groups.items() if e["state"] in ("reserved", "occupied")
        )
        if groups:
            gid = data.draw(st.sampled_from(groups), label="drop")
            aborts = self.p.drop_group(gid, "filtered")
            assert all(a.group_id == gid for a in aborts)
            self.model.drop_group(gid, "filtered")

    @precondition(lambda self: self.started)
    @rule()
    def consume(self) -> None:
        if self.p.ready():
            batch = self.p.consume()
            assert set(batch.group_ids) == set(self.model.consume())
            assert len(batch.group_ids) == self.config.batch_size
            for group_stale in batch.trajectory_staleness:
                assert len(group_stale) == self.config.group_size
                self.consumed_staleness.extend(group_stale)
        else:
            with pytest.raises(NotReady):
                self.p.consume()

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
    def drain_outboxes(self) -> None:
        for a in self.p.take_aborts():
            assert a.trajectory_id in self.admitted
        for r in self.p.take_replacements():
            assert self.config.filtering or r.reason == "stuck"

    # ------------------------------------------------------------------ invariants

    @invariant()
    def protocol_invariants_hold(self) -> None:
        if self.started:
            check_invariants(self.p)

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
            for tid in self.admitted:
                rec = self.p.trajectory(tid)
                if rec.state in ("aborted", "dropped"):
                    assert rec.reason
            counts = self.p.stats().trajectories_by_state
            assert sum(counts.values()) == len(self.admitted)

    @invariant()
    def agrees_with_reference_model(self) -> None:
        if self.started:
            got = {b: (set(o), set(r)) for b, (o, r) in layout(self.p).items()}
            assert got == self.model.layout()
            states = {t[0]: t[3] for t in self.p.to_dict()["trajectories"]}
            assert states == self.model.states()
            assert self.p.current_version == self.model.version
            assert self.p.abort_floor == self.model.floor()

    @invariant()
    def round_trip_is_exact(self) -> None:
        if self.started:
            d = self.p.to_dict()
            text = json.dumps(d)
            assert StalenessProtocol.from_dict(json.loads(text)).to_dict() == d


ProtocolMachine.TestCase.settings = settings(
    max_examples=int(__import__("os").environ.get("SP_EXAMPLES", "300")),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestProtocolMachine = ProtocolMachine.TestCase
