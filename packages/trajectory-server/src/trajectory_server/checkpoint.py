"""Checkpoint files for the trajectory store: atomic writes, checksummed reads.

Layout (all integers big-endian)::

    magic  b"SFTRAJCK"  (8 bytes)
    format u32          (1)
    length u64          payload bytes
    sha256 32 bytes     of the payload
    payload             msgpack of TrajectoryStore.to_dict(binary=True)

A checkpoint is written to a temporary file in the target directory, flushed, fsync'ed and then
renamed over the target (and the directory fsync'ed), so a crash leaves either the old file or
the new one, never a torn one. Loading checks magic, format, length and checksum before it
unpacks anything; any mismatch raises :class:`~trajectory_server.errors.CheckpointCorrupt`.
Nothing here unpickles.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from pathlib import Path

import msgpack

from trajectory_server._core import TrajectoryStore
from trajectory_server.errors import CheckpointCorrupt, CheckpointError

MAGIC = b"SFTRAJCK"
FORMAT = 1
_HEADER = struct.Struct(">8sIQ32s")


def encode_checkpoint(store: TrajectoryStore) -> bytes:
    payload: bytes = msgpack.packb(store.to_dict(binary=True), use_bin_type=True)
    return _HEADER.pack(MAGIC, FORMAT, len(payload), hashlib.sha256(payload).digest()) + payload


def decode_checkpoint(data: bytes, *, path: str | None = None) -> TrajectoryStore:
    if len(data) < _HEADER.size:
        raise CheckpointCorrupt(
            f"checkpoint {path} is {len(data)} bytes, shorter than its header", path=path
        )
    magic, fmt, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CheckpointCorrupt(
            f"{path} is not a trajectory-store checkpoint (bad magic)", path=path
        )
    if fmt != FORMAT:
        raise CheckpointCorrupt(
            f"checkpoint {path} has format {fmt}; this version reads format {FORMAT}", path=path
        )
    payload = data[_HEADER.size :]
    if len(payload) != length:
        raise CheckpointCorrupt(
            f"checkpoint {path} is truncated or padded: header says {length} payload bytes, "
            f"found {len(payload)}",
            path=path,
        )
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointCorrupt(f"checkpoint {path} fails its sha256 checksum", path=path)
    try:
        state = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise CheckpointCorrupt(
            f"checkpoint {path} payload is not msgpack: {exc}", path=path
        ) from exc
    try:
        return TrajectoryStore.from_dict(state)
    except CheckpointCorrupt as exc:
        raise CheckpointCorrupt(f"checkpoint {path}: {exc.message}", path=path) from exc


def save_checkpoint(store: TrajectoryStore, path: str | os.PathLike[str]) -> Path:
    """Write ``store`` to ``path`` atomically; returns the path written."""
    target = Path(path)
    data = encode_checkpoint(store)
    directory = target.parent if str(target.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {target}: {exc}", path=str(target)) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise CheckpointError(
                f"cannot write checkpoint {target}: {exc}", path=str(target)
            ) from exc
        raise
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return target
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target


def load_checkpoint(path: str | os.PathLike[str]) -> TrajectoryStore:
    """Read and verify a checkpoint written by :func:`save_checkpoint`."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}", path=str(path)) from exc
    return decode_checkpoint(data, path=str(path))
