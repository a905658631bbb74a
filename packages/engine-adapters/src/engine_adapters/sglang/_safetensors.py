"""Minimal safetensors writer / header reader (numpy arrays or CPU torch tensors).

Used to hand weights to an SGLang server through ``/update_weights_from_disk``. Kept tiny and
dependency-free: an 8-byte little-endian header length, a JSON header of
``{name: {"dtype", "shape", "data_offsets"}}``, then the raw bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from engine_adapters.errors import InvalidWeights

_NUMPY_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
_TORCH_DTYPES = {"torch.bfloat16": "BF16", **{f"torch.{k}": v for k, v in _NUMPY_DTYPES.items()}}


def _as_bytes(name: str, value: Any) -> tuple[str, tuple[int, ...], bytes]:
    if hasattr(value, "detach"):  # a torch tensor; no torch import needed
        dtype = _TORCH_DTYPES.get(str(value.dtype))
        if dtype is None:
            raise InvalidWeights(f"weight {name!r}: unsupported dtype {value.dtype}", field=name)
        t = value.detach().to("cpu").contiguous()
        raw = t.view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes()
        return dtype, tuple(int(d) for d in t.shape), raw
    arr = np.ascontiguousarray(value)
    dtype = _NUMPY_DTYPES.get(str(arr.dtype))
    if dtype is None:
        raise InvalidWeights(f"weight {name!r}: unsupported dtype {arr.dtype}", field=name)
    return dtype, tuple(int(d) for d in arr.shape), arr.tobytes()


def save_file(tensors: Mapping[str, Any], path: str | Path) -> int:
    """Write ``tensors`` as a safetensors file; returns the number of bytes of tensor data."""
    header: dict[str, Any] = {}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        dtype, shape, raw = _as_bytes(name, tensors[name])
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for raw in blobs:
            f.write(raw)
    return offset


def read_header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Names → (dtype, shape) of a safetensors file, reading only its header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()}
