"""Records of the version registry: configuration, tensor specs, slices, tickets, reports,
the registry's own mutable bookkeeping, and the (pure) layout of a push into slices.

The frozen records are validated at construction; :mod:`param_server._core` hands them out
and takes them in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

from ._plan import str_tuple
from .errors import ConfigError, UsageError

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


def align_up(n: int) -> int:
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
class RankPush:
    push_id: int
    rank: int
    tensors: tuple[TensorSpec, ...]
    slices: tuple[SliceRecord, ...]
    regions: tuple[RegionAlloc, ...]
    checksums: dict[tuple[str, int], int] | None = None


@attrs.define
class Staging:
    version: int
    world_size: int
    ranks: dict[int, RankPush] = attrs.Factory(dict)
    placed_bytes: dict[str, int] = attrs.Factory(dict)


@attrs.define
class HeldVersion:
    version: int
    tensors: dict[str, TensorSpec]
    slices: dict[str, list[SliceRecord]]
    regions: list[RegionAlloc]
    pins: int = 0


@attrs.define
class ActivePull:
    pull_id: int
    version: int
    receiver: str
    load_s: dict[str, float]
    regions: frozenset[int]


Piece = tuple[str, int, int, int]
"""(tensor name, slice index, byte start, byte end)"""


def layout(
    tensors: Sequence[TensorSpec],
    workers: Sequence[str],
    replication: int,
    max_slice_bytes: int,
    placed_bytes: Mapping[str, int],
) -> tuple[list[Piece], dict[int, list[tuple[str, int]]], dict[str, int], dict[str, int]]:
    """Cut tensors into element-aligned slices of at most ``max_slice_bytes`` and place each on
    ``replication`` workers, largest first onto the least loaded (``placed_bytes`` so far).

    Returns the pieces, each piece's (worker, offset in that worker's region), the bytes used
    per worker region, and the new per-worker placed bytes."""
    pieces: list[Piece] = []
    for t in tensors:
        item = DTYPE_SIZES[t.dtype]
        step = max(item, max_slice_bytes // item * item)
        if t.nbytes == 0:
            pieces.append((t.name, 0, 0, 0))
            continue
        for i, start in enumerate(range(0, t.nbytes, step)):
            pieces.append((t.name, i, start, min(start + step, t.nbytes)))
    order = sorted(range(len(pieces)), key=lambda i: (-(pieces[i][3] - pieces[i][2]), i))
    placed = dict(placed_bytes)
    used: dict[str, int] = {}
    owners: dict[int, list[tuple[str, int]]] = {}
    for i in order:
        nbytes = pieces[i][3] - pieces[i][2]
        chosen = sorted(workers, key=lambda w: (placed.get(w, 0), w))[:replication]
        owners[i] = []
        for w in chosen:
            placed[w] = placed.get(w, 0) + nbytes
            off = used.get(w, 0)
            used[w] = off + align_up(nbytes)
            owners[i].append((w, off))
    return pieces, owners, used, placed
