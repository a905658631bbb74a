"""Backend registry: names → modules, imported only when asked for."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from engine_adapters._contract import EngineAdapter
from engine_adapters.errors import BackendNotInstalled, InvalidRequest

# name → (module, extra that installs its engine dependencies; "" = none needed)
BACKENDS: dict[str, tuple[str, str]] = {
    "sim": ("engine_adapters.sim", ""),  # base dependencies only
    "vllm": ("engine_adapters.vllm", "vllm"),
    "sglang": ("engine_adapters.sglang", "sglang"),
}


def load_backend(name: str) -> ModuleType:
    """Import and return the backend module ``name`` (``"sim"``, ``"vllm"``, ``"sglang"``).

    Each backend module exposes its adapter class and ``from_config(**kwargs)``. A missing
    third-party dependency raises :class:`BackendNotInstalled` naming the extra to install.
    """
    try:
        module_name, extra = BACKENDS[name]
    except (KeyError, TypeError):
        raise InvalidRequest(
            f"unknown engine backend {name!r}; allowed: {sorted(BACKENDS)}", field="backend"
        ) from None
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing.startswith("engine_adapters") and missing != module_name:
            raise  # a bug inside our own package, not a missing engine
        raise BackendNotInstalled(name, extra, exc) from exc


def create_engine(backend: str, **kwargs: Any) -> EngineAdapter:
    """Build an adapter: ``load_backend(backend).from_config(**kwargs)`` (not yet started)."""
    adapter = load_backend(backend).from_config(**kwargs)
    if not isinstance(adapter, EngineAdapter):
        raise TypeError(f"backend {backend!r} from_config returned {type(adapter).__name__}")
    return adapter
