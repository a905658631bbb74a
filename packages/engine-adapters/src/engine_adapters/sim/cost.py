"""Old import path of the cost model; it lives in :mod:`engine_adapters.cost_model` now."""

from engine_adapters.cost_model import PRESETS, CostModel, preset

__all__ = ["PRESETS", "CostModel", "preset"]
