"""Version registry of the parameter server: pure, synchronous, sans-IO.

Theory of operation
-------------------
*Layout.* A pushed tensor is cut into byte slices of at most ``max_slice_bytes`` (element
aligned). Each slice is placed on ``replication`` distinct storage workers, least-loaded first.
A push of one trainer rank gets one *region* (a contiguous buffer) per worker it touches; the
core hands out region ids and offsets, the shell turns them into worker memory.

*Push.* Version ``v`` is pushed by ``world_size`` trainer ranks; each rank calls
``begin_push`` (gets where to write), writes its slices, then ``commit_push`` with one checksum
per slice. ``v`` becomes the latest complete version atomically when the last rank commits.
Only one version is *staged* at a time: a rank joining with the same version joins it; a newer
version supersedes (aborts) an unfinished staged one — a restarted trainer is never blocked by
its own dead attempt; an older or equal version than the latest complete one is refused.

*The push/pull exclusivity rule.* Pushes and pulls never touch the same bytes, so neither waits
for the other: a push writes only into regions of the staged version, which no pull can see; a
pull reads only regions of a complete version it *pinned* in ``begin_pull`` and unpins in
``end_pull``. A pull therefore never observes a mixed or incomplete version.

*Retention.* The newest ``keep_versions`` complete versions are kept; an older one is retired
(its regions are returned for freeing) as soon as no pull pins it. A pinned old version
outlives the window until its last pull ends.

*Workers.* The set of worker names is fixed by the config. ``worker_lost`` marks one dead: its
regions are gone, the staged version (if any slice went there) is aborted so its commits fail
with ``PushFailed`` naming the worker, new pushes fail until it rejoins, and pulls of complete
versions still succeed for every slice that has a live replica elsewhere
(``unavailable_slices`` reports the rest). ``worker_joined`` brings it back empty.

*Corrupt copies.* A pull whose bytes from one holder fail their checksum asks for the slice
again (``reread``): another live copy is planned when one exists. A copy confirmed bad at rest
is dropped (``drop_copy``): no later plan picks it, ``dropped_copies`` reports it, and a slice
left with no good copy is unavailable like one whose holders died.

Nothing here does I/O, reads clocks, or logs; errors leave the state unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs

from ._plan import LinkFn, PlanRequest, SliceRef, plan_transfers, uniform_link
from ._records import (
    REGION_ALIGN,
    ActivePull,
    CommitResult,
    CoreConfig,
    HeldVersion,
    Location,
    LossReport,
    PullTicket,
    PushTicket,
    RankPush,
    RegionAlloc,
    SliceRead,
    SliceRecord,
    Staging,
    TensorSpec,
    layout,
)
from .errors import (
    PushConflict,
    PushFailed,
    SliceUnavailable,
    UnknownTensor,
    UsageError,
    VersionUnavailable,
)


class ParamServerCore:
    """The version registry (see the module docstring for the rules)."""

    def __init__(self, config: CoreConfig, link: LinkFn | None = None) -> None:
        self.config = config
        self._link = link or uniform_link()
        self._alive: dict[str, bool] = dict.fromkeys(config.workers, True)
        self._staging: Staging | None = None
        self._versions: dict[int, HeldVersion] = {}
        self._latest: int | None = None
        self._pulls: dict[int, ActivePull] = {}
        self._next_push = 1
        self._next_pull = 1
        self._next_region = 1
        self._live_regions: dict[int, RegionAlloc] = {}
        self._dropped: list[tuple[int, str, int, str]] = []  # version, name, index, worker

    # ------------------------------------------------------------------ queries
    @property
    def latest(self) -> int | None:
        return self._latest

    @property
    def staged_version(self) -> int | None:
        return self._staging.version if self._staging else None

    def versions(self) -> tuple[int, ...]:
        return tuple(sorted(self._versions))

    def alive_workers(self) -> tuple[str, ...]:
        return tuple(w for w, ok in self._alive.items() if ok)

    def dead_workers(self) -> tuple[str, ...]:
        return tuple(w for w, ok in self._alive.items() if not ok)

    def pins(self, version: int) -> int:
        v = self._versions.get(version)
        return v.pins if v else 0

    def live_regions(self) -> Mapping[int, RegionAlloc]:
        return dict(self._live_regions)

    def active_pulls(self) -> tuple[int, ...]:
        return tuple(self._pulls)

    def tensors(self, version: int) -> tuple[TensorSpec, ...]:
        return tuple(self._get_version(version).tensors.values())

    def unavailable_slices(self, version: int | None = None) -> tuple[tuple[int, str, int], ...]:
        """(version, name, slice index) of every slice with no live holder."""
        out = []
        for ver in [version] if version is not None else sorted(self._versions):
            rec = self._get_version(ver)
            for name, slices in rec.slices.items():
                for s in slices:
                    if not self._live_locations(s):
                        out.append((ver, name, s.index))
        return tuple(out)

    def dropped_copies(self) -> tuple[tuple[int, str, int, str], ...]:
        """(version, name, slice index, worker) of copies dropped as corrupt, of held versions."""
        return tuple(self._dropped)

    def slice_map(self, version: int) -> dict[str, tuple[SliceRecord, ...]]:
        """Which slices of ``version`` live on which workers."""
        return {n: tuple(s) for n, s in self._get_version(version).slices.items()}

    # ------------------------------------------------------------------ push
    def begin_push(
        self, *, version: int, rank: int, world_size: int, tensors: Sequence[TensorSpec]
    ) -> PushTicket:
        if not isinstance(version, int) or version < 0:
            raise UsageError(f"version must be an int >= 0, got {version!r}", field="version")
        if not isinstance(world_size, int) or world_size < 1:
            raise UsageError(
                f"world_size must be an int >= 1, got {world_size!r}", field="world_size"
            )
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise UsageError(
                f"rank must be an int in [0, {world_size}), got {rank!r}", field="rank"
            )
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise UsageError(f"duplicate tensor names {dup}", field="tensors")
        if self._latest is not None and version <= self._latest:
            raise PushConflict(
                f"version {version} is not newer than the latest complete version {self._latest}",
                version=version,
                rank=rank,
            )
        dead = self.dead_workers()
        if dead:
            raise PushFailed(
                "storage workers are down; retry when they rejoin",
                version=version,
                rank=rank,
                workers=dead,
            )
        st = self._staging
        superseded: Staging | None = None
        if st is not None:
            if version < st.version:
                raise PushConflict(
                    f"version {st.version} is being pushed; {version} is older",
                    version=version,
                    rank=rank,
                )
            if version > st.version:
                superseded = st
            else:
                if world_size != st.world_size:
                    raise PushConflict(
                        f"world_size {world_size} differs from {st.world_size} of the other ranks",
                        version=version,
                        rank=rank,
                    )
                if rank in st.ranks:
                    raise PushConflict(
                        f"rank {rank} already began pushing this version",
                        version=version,
                        rank=rank,
                    )
                taken = {t.name for rp in st.ranks.values() for t in rp.tensors}
                clash = sorted(taken.intersection(names))
                if clash:
                    raise UsageError(
                        f"tensors {clash} already pushed by another rank of version {version}",
                        field="tensors",
                    )
        if superseded is not None:
            self._drop_staging()
        if self._staging is None:
            self._staging = Staging(version=version, world_size=world_size)
        st = self._staging
        ticket = self._place(st, rank, tensors)
        return ticket

    def _place(self, st: Staging, rank: int, tensors: Sequence[TensorSpec]) -> PushTicket:
        cfg = self.config
        pieces, owners, used, placed = layout(
            tensors, cfg.workers, cfg.replication, cfg.max_slice_bytes, st.placed_bytes
        )
        regions = {}
        for w in cfg.workers:
            if w in used:
                regions[w] = RegionAlloc(
                    region=self._next_region, worker=w, nbytes=max(used[w], REGION_ALIGN)
                )
                self._next_region += 1
        slices = tuple(
            SliceRecord(
                name=pieces[i][0],
                index=pieces[i][1],
                byte_start=pieces[i][2],
                byte_end=pieces[i][3],
                locations=tuple(
                    Location(worker=w, region=regions[w].region, offset=off) for w, off in owners[i]
                ),
            )
            for i in range(len(pieces))
        )
        push_id = self._next_push
        self._next_push += 1
        rp = RankPush(
            push_id=push_id,
            rank=rank,
            tensors=tuple(tensors),
            slices=slices,
            regions=tuple(regions.values()),
        )
        st.ranks[rank] = rp
        st.placed_bytes = placed
        for r in rp.regions:
            self._live_regions[r.region] = r
        return PushTicket(
            push_id=push_id,
            version=st.version,
            rank=rank,
            world_size=st.world_size,
            regions=rp.regions,
            slices=slices,
        )

    def _find_push(self, push_id: int) -> RankPush:
        st = self._staging
        if st is not None:
            for rp in st.ranks.values():
                if rp.push_id == push_id:
                    return rp
        raise PushFailed(
            f"push {push_id} is not staged (aborted by a worker loss, superseded by a newer "
            "version, or unknown)"
        )

    def push_ticket(self, push_id: int) -> PushTicket:
        rp = self._find_push(push_id)
        assert self._staging is not None
        return PushTicket(
            push_id=rp.push_id,
            version=self._staging.version,
            rank=rp.rank,
            world_size=self._staging.world_size,
            regions=rp.regions,
            slices=rp.slices,
        )

    def commit_push(self, push_id: int, checksums: Mapping[tuple[str, int], int]) -> CommitResult:
        rp = self._find_push(push_id)
        st = self._staging
        assert st is not None
        if rp.checksums is not None:
            raise PushConflict("push already committed", version=st.version, rank=rp.rank)
        want = {(s.name, s.index) for s in rp.slices}
        got = set(checksums)
        if want != got:
            missing = sorted(want - got)[:5]
            extra = sorted(got - want)[:5]
            raise UsageError(
                f"checksums must cover exactly the pushed slices; missing {missing}, extra {extra}",
                field="checksums",
            )
        for key, crc in checksums.items():
            if not isinstance(crc, int) or not 0 <= crc < 2**64:
                raise UsageError(
                    f"checksum of {key} must be a uint64, got {crc!r}", field="checksums"
                )
        rp.checksums = dict(checksums)
        version = st.version
        if len(st.ranks) < st.world_size or any(r.checksums is None for r in st.ranks.values()):
            return CommitResult(version=version, complete=False, free_regions=())
        # Last rank: publish atomically.
        tensors: dict[str, TensorSpec] = {}
        slices: dict[str, list[SliceRecord]] = {}
        regions: list[RegionAlloc] = []
        for r in sorted(st.ranks):
            p = st.ranks[r]
            assert p.checksums is not None
            for t in p.tensors:
                tensors[t.name] = t
            for s in p.slices:
                slices.setdefault(s.name, []).append(
                    attrs.evolve(s, checksum=p.checksums[(s.name, s.index)])
                )
            regions.extend(p.regions)
        for lst in slices.values():
            lst.sort(key=lambda s: s.index)
        self._versions[version] = HeldVersion(
            version=version, tensors=tensors, slices=slices, regions=regions
        )
        self._latest = version
        self._staging = None
        return CommitResult(version=version, complete=True, free_regions=self._retire())

    def abort_push(self, version: int) -> tuple[RegionAlloc, ...]:
        """Drop the staged version ``version`` (e.g. a rank failed); returns regions to free."""
        st = self._staging
        if st is None or st.version != version:
            raise PushFailed(f"version {version} is not being pushed", version=version)
        return self._drop_staging()

    def _drop_staging(self) -> tuple[RegionAlloc, ...]:
        st = self._staging
        assert st is not None
        freed = []
        for rp in st.ranks.values():
            for r in rp.regions:
                self._live_regions.pop(r.region, None)
                if self._alive[r.worker]:
                    freed.append(r)
        self._staging = None
        return tuple(freed)

    # ------------------------------------------------------------------ pull
    def begin_pull(
        self,
        *,
        receiver: str,
        names: Iterable[str] | None = None,
        version: int | None = None,
    ) -> PullTicket:
        if version is None:
            if self._latest is None:
                raise VersionUnavailable("no complete version has been pushed yet")
            version = self._latest
        rec = self._versions.get(version)
        if rec is None:
            raise VersionUnavailable(
                f"version {version} is not held; held: {sorted(self._versions)}", version=version
            )
        if names is None:
            wanted = list(rec.tensors)
        else:
            wanted = list(dict.fromkeys(names))
            unknown = [n for n in wanted if n not in rec.tensors]
            if unknown:
                raise UnknownTensor(unknown, version)
        requests: list[PlanRequest] = []
        missing: list[tuple[str, int]] = []
        by_ref: dict[tuple[str, int], SliceRecord] = {}
        for n in wanted:
            for s in rec.slices[n]:
                live = self._live_locations(s)
                if not live:
                    missing.append((n, s.index))
                    continue
                by_ref[(n, s.index)] = s
                requests.append(
                    PlanRequest(
                        receiver=receiver,
                        slice=SliceRef(name=n, index=s.index, nbytes=s.nbytes),
                        holders=tuple(loc.worker for loc in live),
                    )
                )
        if missing:
            dropped = [(n, i, w) for v, n, i, w in self._dropped if v == version]
            raise SliceUnavailable(version, missing, self.dead_workers(), dropped)
        pull = ActivePull(
            pull_id=self._next_pull,
            version=version,
            receiver=receiver,
            load_s={},
            regions=frozenset(),
        )
        reads = self._plan_reads(pull, requests, by_ref)
        pull_id = self._next_pull
        self._next_pull += 1
        rec.pins += 1
        self._pulls[pull_id] = pull
        return PullTicket(
            pull_id=pull_id,
            version=version,
            tensors=tuple(rec.tensors[n] for n in wanted),
            reads=tuple(reads),
        )

    def _plan_reads(
        self,
        pull: ActivePull,
        requests: list[PlanRequest],
        by_ref: Mapping[tuple[str, int], SliceRecord],
    ) -> tuple[SliceRead, ...]:
        """Plan ``requests`` against the load of every pull in flight; add it to ``pull``."""
        inflight: dict[str, float] = {}
        for p in self._pulls.values():
            for w, sec in p.load_s.items():
                inflight[w] = inflight.get(w, 0.0) + sec
        plan = plan_transfers(requests, self._link, inflight)
        reads = []
        regions = set(pull.regions)
        for a in plan.assignments:
            s = by_ref[(a.slice.name, a.slice.index)]
            loc = next(loc for loc in s.locations if loc.worker == a.holder)
            assert s.checksum is not None
            reads.append(
                SliceRead(
                    name=s.name,
                    index=s.index,
                    byte_start=s.byte_start,
                    byte_end=s.byte_end,
                    worker=loc.worker,
                    region=loc.region,
                    offset=loc.offset,
                    checksum=s.checksum,
                )
            )
            pull.load_s[a.holder] = pull.load_s.get(a.holder, 0.0) + a.estimate_s
            regions.add(loc.region)
        pull.regions = frozenset(regions)
        return tuple(sorted(reads, key=lambda r: (r.worker, r.region, r.offset)))

    def _slice(self, version: int, name: str, index: int) -> SliceRecord:
        rec = self._get_version(version)
        for s in rec.slices.get(name, ()):
            if s.index == index:
                return s
        raise UsageError(f"version {version} has no slice {name!r}[{index}]", field="slices")

    def _active_pull(self, pull_id: int) -> ActivePull:
        p = self._pulls.get(pull_id)
        if p is None:
            raise UsageError(f"pull {pull_id} is not active", field="pull_id")
        return p

    def pull_version(self, pull_id: int) -> int:
        return self._active_pull(pull_id).version

    def live_copy(self, version: int, name: str, index: int, worker: str) -> SliceRecord | None:
        """The slice with only ``worker``'s live copy among its locations, or None."""
        s = self._slice(version, name, index)
        locs = tuple(loc for loc in self._live_locations(s) if loc.worker == worker)
        return attrs.evolve(s, locations=locs) if locs else None

    def drop_copy(self, version: int, name: str, index: int, worker: str) -> bool:
        """Forget ``worker``'s copy of one slice (its bytes failed their checksum at rest).
        True if there was such a copy; later plans never pick it."""
        s = self._slice(version, name, index)
        keep = tuple(loc for loc in s.locations if loc.worker != worker)
        if len(keep) == len(s.locations):
            return False
        slices = self._versions[version].slices[name]
        slices[slices.index(s)] = attrs.evolve(s, locations=keep)
        self._dropped.append((version, name, index, worker))
        return True

    def reread(
        self,
        pull_id: int,
        slices: Sequence[tuple[str, int]],
        avoid: Mapping[tuple[str, int], str] | None = None,
    ) -> tuple[SliceRead, ...]:
        """Where pull ``pull_id`` reads these slices of its version again: a live copy other
        than ``avoid[(name, index)]`` when there is one, else that copy (still live, so it
        verified good). Slices without a live copy are left out."""
        pull = self._active_pull(pull_id)
        requests = []
        by_ref = {}
        for name, index in dict.fromkeys(slices):
            s = self._slice(pull.version, name, index)
            live = self._live_locations(s)
            others = [loc for loc in live if loc.worker != (avoid or {}).get((name, index))]
            holders = others or live
            if not holders:
                continue
            by_ref[(name, index)] = s
            requests.append(
                PlanRequest(
                    receiver=pull.receiver,
                    slice=SliceRef(name=name, index=index, nbytes=s.nbytes),
                    holders=tuple(loc.worker for loc in holders),
                )
            )
        return self._plan_reads(pull, requests, by_ref)

    def end_pull(self, pull_id: int) -> tuple[RegionAlloc, ...]:
        """Unpin the pull's version; returns regions of versions that retire now."""
        p = self._pulls.pop(pull_id, None)
        if p is None:
            raise UsageError(f"pull {pull_id} is not active", field="pull_id")
        self._versions[p.version].pins -= 1
        return self._retire()

    def _retire(self) -> tuple[RegionAlloc, ...]:
        keep = set(sorted(self._versions)[-self.config.keep_versions :])
        freed: list[RegionAlloc] = []
        for ver in sorted(self._versions):
            rec = self._versions[ver]
            if ver in keep or rec.pins > 0:
                continue
            del self._versions[ver]
            self._dropped = [d for d in self._dropped if d[0] != ver]
            for r in rec.regions:
                if self._live_regions.pop(r.region, None) is not None and self._alive[r.worker]:
                    freed.append(r)
        return tuple(freed)

    # ------------------------------------------------------------------ workers
    def _live_locations(self, s: SliceRecord) -> tuple[Location, ...]:
        return tuple(
            loc
            for loc in s.locations
            if self._alive[loc.worker] and loc.region in self._live_regions
        )

    def _check_worker(self, worker: str) -> None:
        if worker not in self._alive:
            raise UsageError(
                f"unknown worker {worker!r}; configured: {list(self.config.workers)}",
                field="worker",
            )

    def worker_lost(self, worker: str) -> LossReport:
        self._check_worker(worker)
        aborted: int | None = None
        freed: tuple[RegionAlloc, ...] = ()
        if not self._alive[worker]:
            return LossReport(worker=worker, aborted_version=None, free_regions=(), unavailable=())
        st = self._staging
        if st is not None and any(
            r.worker == worker for rp in st.ranks.values() for r in rp.regions
        ):
            aborted = st.version
            self._alive[worker] = False
            freed = self._drop_staging()
        self._alive[worker] = False
        for rid, r in list(self._live_regions.items()):
            if r.worker == worker:
                del self._live_regions[rid]
        return LossReport(
            worker=worker,
            aborted_version=aborted,
            free_regions=freed,
            unavailable=self.unavailable_slices(),
        )

    def worker_joined(self, worker: str) -> tuple[RegionAlloc, ...]:
        """The worker is back with empty memory; pushes may proceed again. Returns regions to
        free on other workers when this is a restart nobody reported (treated as a loss)."""
        self._check_worker(worker)
        freed: tuple[RegionAlloc, ...] = ()
        if self._alive[worker]:
            freed = self.worker_lost(worker).free_regions
        self._alive[worker] = True
        return freed

    def _get_version(self, version: int) -> HeldVersion:
        rec = self._versions.get(version)
        if rec is None:
            raise VersionUnavailable(
                f"version {version} is not held; held: {sorted(self._versions)}", version=version
            )
        return rec
