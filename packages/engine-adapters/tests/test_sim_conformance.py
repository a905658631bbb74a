"""The conformance suite against the sim backend (real-time clock, ~1 ms steps)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from engine_adapters import EngineAdapter, create_engine
from engine_adapters.testing.conformance import EngineConformance, EngineFactory

WEIGHTS = {"embed.weight": (64, 16), "layers.0.mlp.weight": (16, 16), "lm_head.weight": (64, 16)}


class TestSimConformance(EngineConformance):
    max_model_len = 512
    max_running = 2
    long_tokens = 400
    wait_timeout_s = 10.0

    @pytest.fixture
    def engine_factory(self) -> EngineFactory:
        async def make() -> EngineAdapter:
            engine = create_engine(
                "sim",
                instance_id="sim-conf",
                cost={"k1": 0.0, "k2": 0.002, "k3": 0.0, "k4": 0.0},
                max_running=self.max_running,
                max_model_len=self.max_model_len,
                kv_capacity_tokens=4096,
                prefill_s_per_token=1e-6,
                weight_load_constant_s=0.01,
                weight_shapes=WEIGHTS,
                vocab_size=256,
            )
            await engine.start()
            return engine

        return make

    def valid_weights(self, engine: EngineAdapter, version: int) -> Mapping[str, Any]:
        return {name: np.full(shape, version, dtype=np.float16) for name, shape in WEIGHTS.items()}
