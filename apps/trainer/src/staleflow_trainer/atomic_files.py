"""Durable file writes, shared by the checkpoints and the coordinator's write-ahead journal.

No torch here: the coordinator loop and the journal use it without the trainer's stack.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from staleflow_trainer.errors import CheckpointError


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` or its old content, never a mix: temp file, fsync, rename,
    fsync of the directory."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with tmp.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically plus ``path.sha256``; returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(p, data)
    replace_atomically(p.with_name(p.name + ".sha256"), sha256_hex(data).encode())
    return p


def read_verified_bytes(path: str | Path) -> bytes:
    """Read a file written by :func:`atomic_write_bytes`, checking its SHA-256."""
    p = Path(path)
    digest_file = p.with_name(p.name + ".sha256")
    if not p.is_file() or not digest_file.is_file():
        raise CheckpointError(f"checkpoint file {p} (or its .sha256) is missing", path=str(p))
    data = p.read_bytes()
    want = digest_file.read_text().strip()
    if sha256_hex(data) != want:
        raise CheckpointError(f"checkpoint file {p} fails its SHA-256 check", path=str(p))
    return data


def make_run_dir(path: str | Path) -> Path:
    """Create the run directory (and its parents) and check it can be written: a ConfigError
    naming ``run.run_dir`` when it is a file, lies under a file, or is read-only."""
    from staleflow_trainer.errors import ConfigError

    p = Path(path)
    probe = p / f".write_test.{os.getpid()}"
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise ConfigError(
            f"run.run_dir {str(p)!r} cannot be used as a directory to write in: {why}",
            key="run.run_dir",
            allowed="a writable directory (or a path where one can be created)",
        ) from None
    return p
