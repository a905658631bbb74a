"""Version registry: per-rule examples plus a Hypothesis state machine."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from param_server._core import ParamServerCore
from param_server._records import CoreConfig, TensorSpec
from param_server.errors import (
    ConfigError,
    PushConflict,
    PushFailed,
    SliceUnavailable,
    UnknownTensor,
    UsageError,
    VersionUnavailable,
)


def spec(name: str, n: int = 16, dtype: str = "float32") -> TensorSpec:
    return TensorSpec(name=name, dtype=dtype, shape=(n,), nbytes=n * 4 if dtype == "float32" else n)


def sums(ticket) -> dict[tuple[str, int], int]:  # type: ignore[no-untyped-def]
    return {(s.name, s.index): (hash((s.name, s.index)) & 0xFFFFFFFF) for s in ticket.slices}


def push(core: ParamServerCore, version: int, names=("a", "b"), world: int = 1) -> None:  # type: ignore[no-untyped-def]
    tickets = [
        core.begin_push(
            version=version, rank=r, world_size=world, tensors=[spec(f"{n}{r}") for n in names]
        )
        for r in range(world)
    ]
    for t in tickets:
        core.commit_push(t.push_id, sums(t))


def test_config_validation_names_field() -> None:
    with pytest.raises(ConfigError) as e:
        CoreConfig(workers=("a", "b"), replication=3)
    assert e.value.field == "replication"
    with pytest.raises(ConfigError, match="unique"):
        CoreConfig(workers=("a", "a"))
    with pytest.raises(ConfigError, match="keep_versions"):
        CoreConfig(workers=("a",), keep_versions=0)


def test_tensor_spec_validation() -> None:
    with pytest.raises(UsageError, match="dtype"):
        TensorSpec(name="x", dtype="complex64", shape=(1,), nbytes=8)
    with pytest.raises(UsageError, match="nbytes"):
        TensorSpec(name="x", dtype="float32", shape=(2, 3), nbytes=8)


def test_slicing_and_replication_layout() -> None:
    core = ParamServerCore(
        CoreConfig(workers=("w0", "w1", "w2"), replication=2, max_slice_bytes=40)
    )
    t = core.begin_push(version=1, rank=0, world_size=1, tensors=[spec("a", 25)])  # 100 bytes
    assert [(s.byte_start, s.byte_end) for s in t.slices] == [(0, 40), (40, 80), (80, 100)]
    for s in t.slices:
        assert len({loc.worker for loc in s.locations}) == 2
    # offsets within a region never overlap
    per_region: dict[int, list[tuple[int, int]]] = {}
    for s in t.slices:
        for loc in s.locations:
            per_region.setdefault(loc.region, []).append((loc.offset, loc.offset + s.nbytes))
    for region, spans in per_region.items():
        spans.sort()
        size = next(r.nbytes for r in t.regions if r.region == region)
        for (_a0, a1), (b0, _) in itertools.pairwise(spans):
            assert a1 <= b0
        assert spans[-1][1] <= size


def test_version_visible_only_when_all_ranks_commit() -> None:
    core = ParamServerCore(CoreConfig(workers=("w0", "w1")))
    t0 = core.begin_push(version=1, rank=0, world_size=2, tensors=[spec("a")])
    t1 = core.begin_push(version=1, rank=1, world_size=2, tensors=[spec("b")])
    r = core.commit_push(t0.push_id, sums(t0))
    assert not r.complete
    with pytest.raises(VersionUnavailable):
        core.begin_pull(receiver="r")
    r = core.commit_push(t1.push_id, sums(t1))
    assert r.complete and core.latest == 1
    p = core.begin_pull(receiver="r")
    assert p.version == 1 and {x.name for x in p.reads} == {"a", "b"}


def test_push_rules() -> None:
    core = ParamServerCore(CoreConfig(workers=("w0",)))
    push(core, 3)
    with pytest.raises(PushConflict, match="not newer"):
        core.begin_push(version=3, rank=0, world_size=1, tensors=[spec("a")])
    t = core.begin_push(version=5, rank=0, world_size=2, tensors=[spec("a")])
    with pytest.raises(PushConflict, match="older"):
        core.begin_push(version=4, rank=0, world_size=1, tensors=[spec("a")])
    with pytest.raises(PushConflict, match="world_size"):
        core.begin_push(version=5, rank=1, world_size=3, tensors=[spec("b")])
    with pytest.raises(PushConflict, match="already began"):
        core.begin_push(version=5, rank=0, world_size=2, tensors=[spec("b")])
    with pytest.raises(UsageError, match="already pushed"):
        core.begin_push(version=5, rank=1, world_size=2, tensors=[spec("a")])
    with pytest.raises(UsageError, match="rank"):
        core.begin_push(version=5, rank=2, world_size=2, tensors=[spec("b")])
    with pytest.raises(UsageError, match="checksums"):
        core.commit_push(t.push_id, {})
    # a newer version supersedes the unfinished one; its commit then fails
    t6 = core.begin_push(version=6, rank=0, world_size=1, tensors=[spec("a")])
    with pytest.raises(PushFailed, match="not staged"):
        core.commit_push(t.push_id, sums(t))
    core.commit_push(t6.push_id, sums(t6))
    assert core.latest == 6


def test_retention_keeps_k_newest_and_pinned() -> None:
    core = ParamServerCore(CoreConfig(workers=("w0",), keep_versions=2))
    push(core, 1)
    pin = core.begin_pull(receiver="slow")
    push(core, 2)
    push(core, 3)
    assert core.versions() == (1, 2, 3)  # 1 is pinned
    freed = core.end_pull(pin.pull_id)
    assert core.versions() == (2, 3)
    assert {r.region for r in freed} == {x.region for x in pin.reads}
    with pytest.raises(VersionUnavailable):
        core.begin_pull(receiver="r", version=1)


def test_unknown_names() -> None:
    core = ParamServerCore(CoreConfig(workers=("w0",)))
    push(core, 1)
    with pytest.raises(UnknownTensor) as e:
        core.begin_pull(receiver="r", names=["a0", "zz"])
    assert e.value.names == ("zz",)
    assert core.active_pulls() == ()


def test_worker_death_replicated_pull_ok_push_fails_then_recovers() -> None:
    core = ParamServerCore(CoreConfig(workers=("w0", "w1"), replication=2))
    push(core, 1)
    staged = core.begin_push(version=2, rank=0, world_size=1, tensors=[spec("a0")])
    rep = core.worker_lost("w1")
    assert rep.aborted_version == 2
    assert rep.unavailable == ()
    with pytest.raises(PushFailed) as e:
        core.commit_push(staged.push_id, sums(staged))
    with pytest.raises(PushFailed) as e:
        core.begin_push(version=2, rank=0, world_size=1, tensors=[spec("a0")])
    assert e.value.workers == ("w1",)
    p = core.begin_pull(receiver="r")
    assert {x.worker for x in p.reads} == {"w0"}
    core.end_pull(p.pull_id)
    core.worker_joined("w1")
    push(core, 2)
    assert core.latest == 2


def test_worker_death_without_replica_reports_unavailable() -> None:
    core = ParamServerCore(CoreConfig(workers=("w0", "w1"), replication=1))
    push(core, 1, names=("a", "b", "c", "d"))
    rep = core.worker_lost("w0")
    assert rep.unavailable and all(v == 1 for v, _, _ in rep.unavailable)
    with pytest.raises(SliceUnavailable) as e:
        core.begin_pull(receiver="r")
    assert e.value.dead_workers == ("w0",)
    # the slices on the live worker can still be pulled by name
    ok = [n for n, sl in core.slice_map(1).items() if sl[0].locations[0].worker == "w1"]
    p = core.begin_pull(receiver="r", names=ok)
    assert {x.worker for x in p.reads} == {"w1"}


def test_concurrent_pulls_spread_over_replicas() -> None:
    core = ParamServerCore(CoreConfig(workers=("w0", "w1"), replication=2))
    push(core, 1, names=tuple("abcdefgh"))
    p1 = core.begin_pull(receiver="r1")
    p2 = core.begin_pull(receiver="r2")
    for p in (p1, p2):
        workers = [x.worker for x in p.reads]
        assert workers.count("w0") == workers.count("w1") == 4


# --------------------------------------------------------------------------- state machine
class CoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.core = ParamServerCore(
            CoreConfig(
                workers=("w0", "w1", "w2"), replication=2, keep_versions=2, max_slice_bytes=24
            )
        )
        self.next_version = 1
        self.staged: dict[int, object] = {}  # rank -> uncommitted ticket
        self.began: set[int] = set()  # ranks in the staged version
        self.stage_regions: dict[int, set[int]] = {}
        self.world = 2
        self.pulls: dict[int, object] = {}
        self.complete: dict[int, set[int]] = {}  # version -> region ids
        self.freed: set[int] = set()
        self.lost_regions: set[int] = set()  # memory gone with a dead worker

    def _free(self, regions) -> None:  # type: ignore[no-untyped-def]
        for r in regions:
            assert r.region not in self.freed, "region freed twice"
            self.freed.add(r.region)

    @rule(rank=st.integers(0, 1), n=st.integers(1, 3), newer=st.booleans())
    def begin_push(self, rank: int, n: int, newer: bool) -> None:
        staged = self.core.staged_version
        version = self.next_version + (1 if newer or staged is None else 0)
        try:
            t = self.core.begin_push(
                version=version,
                rank=rank,
                world_size=self.world,
                tensors=[spec(f"r{rank}t{i}", 5 + i) for i in range(n)],
            )
        except PushFailed:
            assert self.core.dead_workers() or rank in self.began
            return
        if staged is None or version > staged:
            self.staged.clear()
            self.began.clear()
        self.next_version = version
        self.staged[rank] = t
        self.began.add(rank)
        self.stage_regions[version] = self.stage_regions.get(version, set()) | {
            r.region for r in t.regions
        }

    @precondition(lambda self: self.staged)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        rank = data.draw(st.sampled_from(sorted(self.staged)))
        t = self.staged.pop(rank)
        try:
            res = self.core.commit_push(t.push_id, sums(t))  # type: ignore[attr-defined]
        except PushFailed:
            return
        if res.complete:
            self.complete[res.version] = self.stage_regions.pop(res.version)
            self.staged.clear()
            self.began.clear()
            self.next_version = res.version + 1
        self._free(res.free_regions)

    @rule(names=st.none() | st.just(["r0t0"]))
    def begin_pull(self, names) -> None:  # type: ignore[no-untyped-def]
        try:
            p = self.core.begin_pull(receiver="x", names=names)
        except (VersionUnavailable, SliceUnavailable, UnknownTensor):
            return
        self.pulls[p.pull_id] = p
        # never mixed: one version, which was complete when pinned; every byte exactly once
        assert p.version == self.core.latest
        covered: dict[str, list[tuple[int, int]]] = {}
        for r in p.reads:
            covered.setdefault(r.name, []).append((r.byte_start, r.byte_end))
        for t in p.tensors:
            spans = sorted(covered[t.name])
            assert spans[0][0] == 0 and spans[-1][1] == t.nbytes
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        assert self.core.staged_version is None or self.core.staged_version > p.version
        assert {r.region for r in p.reads} <= self.complete[p.version]

    @precondition(lambda self: self.pulls)
    @rule(data=st.data())
    def end_pull(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(self.pulls)))
        del self.pulls[pid]
        self._free(self.core.end_pull(pid))

    @rule(worker=st.sampled_from(["w0", "w1", "w2"]))
    def lose(self, worker: str) -> None:
        before = set(self.core.live_regions())
        rep = self.core.worker_lost(worker)
        self.lost_regions |= before - set(self.core.live_regions())
        self._free(rep.free_regions)
        if rep.aborted_version is not None:
            self.staged.clear()
            self.began.clear()

    @rule(worker=st.sampled_from(["w0", "w1", "w2"]))
    def join(self, worker: str) -> None:
        before = set(self.core.live_regions())
        staged = self.core.staged_version
        self._free(self.core.worker_joined(worker))  # an unnoticed restart is a loss first
        self.lost_regions |= before - set(self.core.live_regions())
        if staged is not None and self.core.staged_version is None:
            self.staged.clear()
            self.began.clear()

    @invariant()
    def pinned_regions_never_freed(self) -> None:
        live = self.core.live_regions()
        for p in self.pulls.values():
            assert p.version in self.core.versions()  # type: ignore[attr-defined]
            for r in p.reads:  # type: ignore[attr-defined]
                assert r.region not in self.freed
                # live unless its worker died (memory gone, not reused)
                assert r.region in live or r.region in self.lost_regions

    @invariant()
    def retention(self) -> None:
        vs = self.core.versions()
        unpinned_old = [v for v in vs[:-2] if self.core.pins(v) == 0]
        assert not unpinned_old
        assert self.core.latest is None or self.core.latest == max(vs)


CoreMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCoreMachine = CoreMachine.TestCase
