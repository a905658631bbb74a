"""Torch checkpoint files, atomic and checksummed (:mod:`staleflow_trainer.atomic_files`)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from staleflow_trainer.atomic_files import atomic_write_bytes, read_verified_bytes
from staleflow_trainer.errors import CheckpointError

__all__ = ["atomic_write_bytes", "load_torch", "read_verified_bytes", "save_torch"]


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
