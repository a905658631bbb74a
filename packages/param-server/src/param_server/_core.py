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

Nothing here does I/O, reads clocks, or logs; errors leave the state unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

from ._plan import LinkFn, PlanRequest, SliceRef, plan_transfers, str_tuple, uniform_link
from .errors import (
    ConfigError,
    PushConflict,
    PushFailed,
    SliceUnavailable,
    UnknownTensor,
    UsageError,
    VersionUnavailable,
)

#: dtype name -> element size in bytes (torch names without the ``torch.`` prefix)
DTYPE_SIZES: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

REGION_ALIGN = 64


def _align(n: int) -> int:
    return (n + REGION_ALIGN - 1) // REGION_ALIGN * REGION_ALIGN


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


@attrs.frozen(kw_only=True)
class CoreConfig:
    workers: tuple[str, ...] = attrs.field(converter=str_tuple)
    replication: int = 1
    keep_versions: int = 2
    max_slice_bytes: int = 64 << 20

    def __attrs_post_init__(self) -> None:
        if not self.workers:
            raise ConfigError("workers", self.workers, "at least one worker name")
        if len(set(self.workers)) != len(self.workers):
            raise ConfigError("workers", self.workers, "unique worker names")
        if not isinstance(self.replication, int) or not 1 <= self.replication <= len(self.workers):
            raise ConfigError(
                "replication", self.replication, f"an int in [1, {len(self.workers)}] (workers)"
            )
        if not isinstance(self.keep_versions, int) or self.keep_versions < 1:
            raise ConfigError("keep_versions", self.keep_versions, "an int >= 1")
        if not isinstance(self.max_slice_bytes, int) or self.max_slice_bytes < 8:
            raise ConfigError("max_slice_bytes", self.max_slice_bytes, "an int >= 8")


@attrs.frozen(kw_only=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=_int_tuple)
    nbytes: int

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise UsageError(
                f"tensor name must be a non-empty str, got {self.name!r}", field="name"
            )
        if self.dtype not in DTYPE_SIZES:
            raise UsageError(
                f"tensor {self.name!r}: dtype {self.dtype!r} not supported; allowed: "
                f"{sorted(DTYPE_SIZES)}",
                field="dtype",
            )
        if any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise UsageError(
                f"tensor {self.name!r}: shape {self.shape!r} must hold ints >= 0", field="shape"
            )
        expected = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if self.nbytes != expected:
            raise UsageError(
                f"tensor {self.name!r}: nbytes {self.nbytes} != prod(shape)*itemsize = {expected}",
                field="nbytes",
            )


@attrs.frozen(kw_only=True)
class Location:
    worker: str
    region: int
    offset: int


@attrs.frozen(kw_only=True)
class SliceRecord:
    name: str
    index: int
    byte_start: int
    byte_end: int
    locations: tuple[Location, ...]
    checksum: int | None = None

    @property
    def nbytes(self) -> int:
        return self.byte_end - self.byte_start


@attrs.frozen(kw_only=True)
class RegionAlloc:
    region: int
    worker: str
    nbytes: int


@attrs.frozen(kw_only=True)
class PushTicket:
    push_id: int
    version: int
    rank: int
    world_size: int
    regions: tuple[RegionAlloc, ...]
    slices: tuple[SliceRecord, ...]


@attrs.frozen(kw_only=True)
class CommitResult:
    version: int
    complete: bool
    free_regions: tuple[RegionAlloc, ...]


@attrs.frozen(kw_only=True)
class SliceRead:
    name: str
    index: int
    byte_start: int
    byte_end: int
    worker: str
    region: int
    offset: int
    checksum: int


@attrs.frozen(kw_only=True)
class PullTicket:
    pull_id: int
    version: int
    tensors: tuple[TensorSpec, ...]
    reads: tuple[SliceRead, ...]


@attrs.frozen(kw_only=True)
class LossReport:
    worker: str
    aborted_version: int | None
    free_regions: tuple[RegionAlloc, ...]
    unavailable: tuple[tuple[int, str, int], ...]  # (version, name, slice index)


@attrs.define
class _RankPush:
    push_id: int
    rank: int
    tensors: tuple[TensorSpec, ...]
    slices: tuple[SliceRecord, ...]
    regions: tuple[RegionAlloc, ...]
    checksums: dict[tuple[str, int], int] | None = None


@attrs.define
class _Staging:
    version: int
    world_size: int
    ranks: dict[int, _RankPush] = attrs.Factory(dict)
    placed_bytes: dict[str, int] = attrs.Factory(dict)


@attrs.define
class _Version:
    version: int
    tensors: dict[str, TensorSpec]
    slices: dict[str, list[SliceRecord]]
    regions: list[RegionAlloc]
    pins: int = 0


@attrs.define
class _Pull:
    pull_id: int
    version: int
    load_s: dict[str, float]
    regions: frozenset[int]


class ParamServerCore:
    """The version registry (see the module docstring for the rules)."""

    def __init__(self, config: CoreConfig, link: LinkFn | None = None) -> None:
        self.config = config
        self._link = link or uniform_link()
        self._alive: dict[str, bool] = dict.fromkeys(config.workers, True)
        self._staging: _Staging | None = None
        self._versions: dict[int, _Version] = {}
        self._latest: int | None = None
        self._pulls: dict[int, _Pull] = {}
        self._next_push = 1
        self._next_pull = 1
        self._next_region = 1
        self._live_regions: dict[int, RegionAlloc] = {}

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
        superseded: _Staging | None = None
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
            self._staging = _Staging(version=version, world_size=world_size)
        st = self._staging
        ticket = self._place(st, rank, tensors)
        return ticket

    def _place(self, st: _Staging, rank: int, tensors: Sequence[TensorSpec]) -> PushTicket:
        cfg = self.config
        pieces: list[tuple[str, int, int, int]] = []  # name, index, start, end
        for t in tensors:
            item = DTYPE_SIZES[t.dtype]
            step = max(item, cfg.max_slice_bytes // item * item)
            if t.nbytes == 0:
                pieces.append((t.name, 0, 0, 0))
                continue
            for i, start in enumerate(range(0, t.nbytes, step)):
                pieces.append((t.name, i, start, min(start + step, t.nbytes)))
        # Largest first onto the least-loaded workers (bytes of this staged version).
        order = sorted(range(len(pieces)), key=lambda i: (-(pieces[i][3] - pieces[i][2]), i))
        placed = dict(st.placed_bytes)
        used: dict[str, int] = {}
        owners: dict[int, list[tuple[str, int]]] = {}
        for i in order:
            nbytes = pieces[i][3] - pieces[i][2]
            chosen = sorted(cfg.workers, key=lambda w: (placed.get(w, 0), w))[: cfg.replication]
            owners[i] = []
            for w in chosen:
                placed[w] = placed.get(w, 0) + nbytes
                off = used.get(w, 0)
                used[w] = off + _align(nbytes)
                owners[i].append((w, off))
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
        rp = _RankPush(
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

    def _find_push(self, push_id: int) -> _RankPush:
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
        self._versions[version] = _Version(
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
            raise SliceUnavailable(version, missing, self.dead_workers())
        inflight: dict[str, float] = {}
        for p in self._pulls.values():
            for w, sec in p.load_s.items():
                inflight[w] = inflight.get(w, 0.0) + sec
        plan = plan_transfers(requests, self._link, inflight)
        reads = []
        load: dict[str, float] = {}
        regions = set()
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
            load[a.holder] = load.get(a.holder, 0.0) + a.estimate_s
            regions.add(loc.region)
        reads.sort(key=lambda r: (r.worker, r.region, r.offset))
        pull_id = self._next_pull
        self._next_pull += 1
        rec.pins += 1
        self._pulls[pull_id] = _Pull(
            pull_id=pull_id, version=version, load_s=load, regions=frozenset(regions)
        )
        return PullTicket(
            pull_id=pull_id,
            version=version,
            tensors=tuple(rec.tensors[n] for n in wanted),
            reads=tuple(reads),
        )

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

    def _get_version(self, version: int) -> _Version:
        rec = self._versions.get(version)
        if rec is None:
            raise VersionUnavailable(
                f"version {version} is not held; held: {sorted(self._versions)}", version=version
            )
        return rec
