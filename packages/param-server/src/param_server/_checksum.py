"""Per-slice CRC-32 checksums, computed on a small thread pool.

``zlib.crc32`` releases the GIL on large buffers, so slices hash in parallel with each other
and with the NIXL progress loop of the calling thread. CRC-32 runs at ~4 GB/s per core here
(measured in benchmarks/bench_param_server.py as ``crc32_gbps``); a faster hash (xxh3) would
need a new dependency.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

ALGORITHM = "crc32"

_pool: ThreadPoolExecutor | None = None


def pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(
            max_workers=max(2, min(4, os.cpu_count() or 2)), thread_name_prefix="ps-crc"
        )
    return _pool


def crc(buf: memoryview, start: int, end: int) -> int:
    return zlib.crc32(buf[start:end]) if end > start else 0


def submit(buf: memoryview, start: int, end: int) -> Future[int]:
    return pool().submit(crc, buf, start, end)


def many(buf: memoryview, spans: Sequence[tuple[int, int]]) -> list[int]:
    futures = [submit(buf, s, e) for s, e in spans]
    return [f.result() for f in futures]
