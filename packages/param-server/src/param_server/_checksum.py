"""Per-slice checksums (XXH3-64), computed on a small thread pool.

XXH3-64 hashes at ~28 GB/s per core here against ~4 GB/s for zlib's CRC-32 (both measured by
benchmarks/bench_param_server.py), so verifying a pull costs a small fraction of the transfer.
Slices hash on a pool so hashing overlaps the NIXL progress loop of the calling thread.
Checksums are 64-bit unsigned ints.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import xxhash

ALGORITHM = "xxh3_64"

_pool: ThreadPoolExecutor | None = None


def pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(
            max_workers=max(2, min(4, os.cpu_count() or 2)), thread_name_prefix="ps-crc"
        )
    return _pool


def crc(buf: memoryview, start: int, end: int) -> int:
    return xxhash.xxh3_64_intdigest(buf[start:end]) if end > start else 0


def submit(buf: memoryview, start: int, end: int) -> Future[int]:
    return pool().submit(crc, buf, start, end)


def many(buf: memoryview, spans: Sequence[tuple[int, int]]) -> list[int]:
    futures = [submit(buf, s, e) for s, e in spans]
    return [f.result() for f in futures]
