"""The sim backend: a cost-model rollout engine that advances in closed form between events.

* :class:`SimEngineCore` — sans-IO synchronous core driven in (virtual) time.
* :class:`SimAdapter` — the async :class:`~engine_adapters.EngineAdapter` over the core.
* :class:`SimConfig` — one instance: model and GPU (KV capacity, prefill), batching limits,
  speed factor; :func:`draw_speed_factors` for a heterogeneous fleet.
* :class:`CostModel` / :data:`PRESETS` / :func:`preset` — re-exported from
  :mod:`engine_adapters.cost_model` (the one step-latency model, shared with the coordinator).
"""

from __future__ import annotations

from typing import Any

from engine_adapters.cost_model import PRESETS, CostModel, preset
from engine_adapters.sim._adapter import SimAdapter, weights_nbytes
from engine_adapters.sim._clock import Clock, RealClock, VirtualClock
from engine_adapters.sim._completion import SimCompletion
from engine_adapters.sim._config import SimConfig, draw_speed_factors
from engine_adapters.sim._core import SimEngineCore, make_core

__all__ = [
    "PRESETS",
    "Clock",
    "CostModel",
    "RealClock",
    "SimAdapter",
    "SimCompletion",
    "SimConfig",
    "SimEngineCore",
    "VirtualClock",
    "draw_speed_factors",
    "from_config",
    "make_core",
    "preset",
    "weights_nbytes",
]

_ADAPTER_KEYS = ("instance_id", "clock", "speed", "version", "profile_noise")


def from_config(**kwargs: Any) -> SimAdapter:
    """Build a :class:`SimAdapter` from flat keyword arguments.

    Adapter arguments (``instance_id``, ``clock``, ``speed``, ``version``, ``profile_noise``)
    are taken out; ``config=`` may pass a :class:`SimConfig` or mapping, otherwise the rest are
    :class:`SimConfig` fields (``cost`` may be a preset name).
    """
    adapter_kwargs = {k: kwargs.pop(k) for k in _ADAPTER_KEYS if k in kwargs}
    config = kwargs.pop("config", None)
    if config is None:
        config = SimConfig.from_mapping(kwargs)
    elif kwargs:
        raise TypeError(
            f"pass SimConfig fields either in config= or flat, not both: {sorted(kwargs)}"
        )
    elif not isinstance(config, SimConfig):
        config = SimConfig.from_mapping(config)
    return SimAdapter(config, **adapter_kwargs)
