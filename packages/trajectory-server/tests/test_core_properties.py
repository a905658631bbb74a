"""Ownership invariants under random operation sequences (Hypothesis state machine).

A reference model tracks where every trajectory should be, its V_traj and how many tokens it
holds; after every step the store must agree with the model and pass its own invariant check
(each id in exactly one place, nothing vanished, queue order respects levels, and among the
never-routed prompts the members of groups with a routed member come first). Operations the
model expects to fail must raise and leave the store unchanged.
"""

from __future__ import annotations

import json
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from trajectory_server import Completion, SamplingParams, Segment, TrajectoryStore
from trajectory_server.checkpoint import decode_checkpoint, encode_checkpoint
from trajectory_server.errors import StateError

INSTANCES = ("i0", "i1", "i2")
MAX_NEW = 12


class StoreMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.store = TrajectoryStore()
        self.where: dict[str, Any] = {}  # id -> "queued" | ("running", inst) | "finished" | ...
        self.v_traj: dict[str, int | None] = {}
        self.held: dict[str, int] = {}  # generated tokens the store holds
        self.groups = 0
        self.routed_groups: set[str] = set()

    # -- helpers -------------------------------------------------------------------------------

    def ids_in(self, state: Any) -> list[str]:
        return sorted(t for t, w in self.where.items() if w == state)

    def running_on(self, inst: str) -> list[str]:
        return self.ids_in(("running", inst))

    def expect_failure(self, fn: Any, *args: Any) -> None:
        before = self.store.to_dict()
        try:
            fn(*args)
        except StateError:
            pass
        else:
            raise AssertionError(f"{fn.__name__}{args} should have failed")
        assert self.store.to_dict() == before

    def segment(self, tid: str, new: int, start_back: int, version: int) -> dict[str, Any]:
        # the engine may resend part of what the store holds; it must match exactly
        held = self.store.get(tid)
        start = max(0, held.generated_len - start_back)
        old = held.generated_len - start
        return {
            "trajectory_id": tid,
            "start": start,
            "token_ids": held.generated_token_ids[start:].tolist() + [7] * new,
            "logprobs": held.generated_logprobs[start:].tolist() + [-0.5] * new,
            "versions": held.generated_versions[start:].tolist() + [version] * new,
            "_old": old,
        }

    # -- rules ---------------------------------------------------------------------------------

    @rule(n=st.integers(1, 3), prompt_len=st.integers(1, 4))
    def submit_group(self, n: int, prompt_len: int) -> None:
        gid = f"g{self.groups}"
        self.groups += 1
        ids = self.store.submit_group(
            gid, list(range(prompt_len)), n, sampling=SamplingParams(max_new_tokens=MAX_NEW)
        )
        for tid in ids:
            self.where[tid] = "queued"
            self.v_traj[tid] = None
            self.held[tid] = 0

    @precondition(lambda self: self.ids_in("queued"))
    @rule(data=st.data(), inst=st.sampled_from(INSTANCES), version=st.integers(0, 4))
    def route(self, data: st.DataObject, inst: str, version: int) -> None:
        queued = self.ids_in("queued")
        pick = data.draw(st.lists(st.sampled_from(queued), min_size=1, max_size=3, unique=True))
        stale = [t for t in pick if (self.v_traj[t] or 0) > version]
        if stale:
            self.expect_failure(self.store.route, inst, pick, version)
            return
        out = self.store.route(inst, pick, version)
        assert [t.trajectory_id for t in out] == pick
        for t in out:
            if self.v_traj[t.trajectory_id] is None:
                self.v_traj[t.trajectory_id] = version
                self.routed_groups.add(t.trajectory_id.split("/")[0])
            assert t.v_traj == self.v_traj[t.trajectory_id]
            self.where[t.trajectory_id] = ("running", inst)

    @precondition(lambda self: any(self.running_on(i) for i in INSTANCES))
    @rule(data=st.data(), new=st.integers(0, 3), back=st.integers(0, 2), bump=st.integers(0, 2))
    def return_partial(self, data: st.DataObject, new: int, back: int, bump: int) -> None:
        inst = data.draw(st.sampled_from([i for i in INSTANCES if self.running_on(i)]))
        tid = data.draw(st.sampled_from(self.running_on(inst)))
        v = self.v_traj[tid]
        assert v is not None
        seg = self.segment(tid, new, back, v + bump)
        seg.pop("_old")
        if self.held[tid] + new >= MAX_NEW:
            return
        out = self.store.return_partial(inst, [Segment(**seg)])
        self.held[tid] += new
        assert out[0].generated_len == self.held[tid]
        self.where[tid] = "queued"

    @precondition(lambda self: any(self.running_on(i) for i in INSTANCES))
    @rule(data=st.data(), new=st.integers(0, 3), reason=st.sampled_from(["stop", "length"]))
    def finish(self, data: st.DataObject, new: int, reason: str) -> None:
        inst = data.draw(st.sampled_from([i for i in INSTANCES if self.running_on(i)]))
        tid = data.draw(st.sampled_from(self.running_on(inst)))
        if self.held[tid] + new > MAX_NEW:
            return
        seg = self.segment(tid, new, 0, self.v_traj[tid] or 0)
        seg.pop("_old")
        out = self.store.finish(inst, [Completion(**seg, finish_reason=reason)])
        self.held[tid] += new
        assert out[0].trajectory.generated_len == self.held[tid]
        self.where[tid] = "finished"

    @precondition(lambda self: any(self.running_on(i) for i in INSTANCES))
    @rule(data=st.data(), other=st.sampled_from(INSTANCES))
    def output_from_wrong_instance(self, data: st.DataObject, other: str) -> None:
        inst = data.draw(st.sampled_from([i for i in INSTANCES if self.running_on(i)]))
        if other == inst:
            return
        tid = data.draw(st.sampled_from(self.running_on(inst)))
        seg = self.segment(tid, 1, 0, self.v_traj[tid] or 0)
        seg.pop("_old")
        self.expect_failure(self.store.return_partial, other, [Segment(**seg)])

    @precondition(lambda self: any(w != "queued" for w in self.where.values()))
    @rule(data=st.data(), inst=st.sampled_from(INSTANCES))
    def route_not_queued(self, data: st.DataObject, inst: str) -> None:
        tid = data.draw(st.sampled_from(sorted(t for t, w in self.where.items() if w != "queued")))
        self.expect_failure(self.store.route, inst, [tid], 10)

    @precondition(lambda self: any(w != "dropped" for w in self.where.values()))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        live = sorted(t for t, w in self.where.items() if w != "dropped")
        pick = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=2, unique=True))
        self.store.drop(pick, "test")
        for tid in pick:
            self.where[tid] = "dropped"

    @rule(inst=st.sampled_from(INSTANCES))
    def instance_lost(self, inst: str) -> None:
        expected = self.running_on(inst)
        assert sorted(self.store.instance_lost(inst)) == expected
        for tid in expected:
            self.where[tid] = "queued"

    @precondition(lambda self: self.ids_in("finished"))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(self.ids_in("finished")))
        out = self.store.release([tid])
        assert out[0].trajectory.generated_len == self.held[tid]
        self.where[tid] = "released"

    @precondition(lambda self: self.ids_in("finished"))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        done = self.ids_in("finished")
        pick = data.draw(st.lists(st.sampled_from(done), min_size=1, max_size=3, unique=True))
        assert sorted(self.store.finished_ids()) == sorted(done)
        if data.draw(st.booleans()):  # one id that is not finished: all or nothing
            other = [t for t in self.where if t not in done]
            if other:
                before = self.store.to_dict()
                with pytest.raises(StateError):
                    self.store.free([*pick, data.draw(st.sampled_from(other))])
                assert self.store.to_dict() == before
        assert self.store.free(pick) == len(pick)
        for tid in pick:
            self.where[tid] = "released"

    @rule(binary=st.booleans())
    def checkpoint_restore(self, binary: bool) -> None:
        before = self.store.to_dict()
        if binary:
            self.store = decode_checkpoint(encode_checkpoint(self.store))
        else:
            self.store = TrajectoryStore.from_dict(json.loads(json.dumps(before)))
        assert self.store.to_dict() == before

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def store_is_consistent(self) -> None:
        self.store.check_invariants()

    @invariant()
    def every_id_where_the_model_says(self) -> None:
        ledger = self.store.ledger()
        assert set(ledger) == set(self.where), "a trajectory vanished or appeared"
        for tid, w in self.where.items():
            loc = ledger[tid]
            if isinstance(w, tuple):
                assert (loc.state.value, loc.instance_id) == w
            elif w == "released":
                assert loc.state.value == "finished"
            else:
                assert loc.state.value == w
            if w in ("queued", "finished") or isinstance(w, tuple):
                t = self.store.get(tid)
                assert t.generated_len == self.held[tid]
                assert t.v_traj == self.v_traj[tid]

    @invariant()
    def queue_order_respects_levels(self) -> None:
        view = self.store.queue_view()
        assert sorted(e.trajectory_id for e in view) == self.ids_in("queued")
        keys = [(e.v_traj is None, e.v_traj or 0, -e.generated_len) for e in view]
        assert keys == sorted(keys)
        fresh = [e.group_id not in self.routed_groups for e in view if e.v_traj is None]
        assert fresh == sorted(fresh), "a fresh group's member before a routed group's"


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
