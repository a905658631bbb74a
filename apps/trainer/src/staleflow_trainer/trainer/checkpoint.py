"""Atomic, checksummed checkpoint files (temp file + rename; SHA-256 verified on load)."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

import torch

from staleflow_trainer.errors import CheckpointError


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically plus ``path.sha256``; returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    for target, payload in ((p, data), (p.with_name(p.name + ".sha256"), _sha256(data).encode())):
        tmp = target.with_name(f".{target.name}.tmp.{os.getpid()}")
        with tmp.open("wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(target)
    return p


def read_verified_bytes(path: str | Path) -> bytes:
    """Read a file written by :func:`atomic_write_bytes`, checking its SHA-256."""
    p = Path(path)
    digest_file = p.with_name(p.name + ".sha256")
    if not p.is_file() or not digest_file.is_file():
        raise CheckpointError(f"checkpoint file {p} (or its .sha256) is missing", path=str(p))
    data = p.read_bytes()
    want = digest_file.read_text().strip()
    if _sha256(data) != want:
        raise CheckpointError(f"checkpoint file {p} fails its SHA-256 check", path=str(p))
    return data


def save_torch(obj: Any, path: str | Path) -> Path:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return atomic_write_bytes(path, buf.getvalue())


def load_torch(path: str | Path) -> Any:
    data = read_verified_bytes(path)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for unreadable pickles
        raise CheckpointError(
            f"checkpoint file {path} cannot be loaded: {e}", path=str(path)
        ) from e
