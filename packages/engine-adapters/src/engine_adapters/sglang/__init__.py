"""The SGLang backend: the engine contract over SGLang's native HTTP server API (0.5.x).

Needs the ``sglang`` extra (httpx). CI runs it against
:mod:`engine_adapters.testing.sglang_standin`, a stand-in server — not SGLang itself.
"""

from __future__ import annotations

from typing import Any

from engine_adapters.sglang._adapter import SglangAdapter, parse_metrics
from engine_adapters.sglang._launcher import SglangLaunchConfig, SglangProcess

__all__ = ["SglangAdapter", "SglangLaunchConfig", "SglangProcess", "from_config", "parse_metrics"]


def from_config(**kwargs: Any) -> SglangAdapter:
    """``SglangAdapter(**kwargs)``: ``base_url=`` to attach, or ``launch={...}`` to start one."""
    return SglangAdapter(**kwargs)
