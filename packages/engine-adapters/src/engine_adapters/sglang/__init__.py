"""The SGLang backend: the engine contract over SGLang's native HTTP server API (0.5.x).

Needs the ``sglang`` extra (httpx). CI runs it against
:mod:`engine_adapters.testing.sglang_standin`, a stand-in server — not SGLang itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine_adapters.sglang._adapter import SglangAdapter, parse_metrics
from engine_adapters.sglang._launcher import SglangLaunchConfig, SglangProcess
from engine_adapters.sglang._safetensors import read_header

__all__ = [
    "SglangAdapter",
    "SglangLaunchConfig",
    "SglangProcess",
    "from_config",
    "model_weight_shapes",
    "parse_metrics",
]


def model_weight_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Names → shapes of a model directory's ``*.safetensors`` (for ``weight_shapes=``)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        shapes.update({name: shape for name, (_, shape) in read_header(f).items()})
    return shapes


def from_config(**kwargs: Any) -> SglangAdapter:
    """``SglangAdapter(**kwargs)``: ``base_url=`` to attach, or ``launch={...}`` to start one."""
    return SglangAdapter(**kwargs)
