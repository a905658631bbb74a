"""The conformance suite against the SGLang adapter talking to the in-repo SGLang STAND-IN.

The stand-in (``engine_adapters.testing.sglang_standin``) is not SGLang: it implements the
documented 0.5.x HTTP semantics over the sim engine. Real SGLang: integration_tests/gpu/.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest

from engine_adapters import EngineAdapter, create_engine
from engine_adapters.sim import CostModel, SimConfig
from engine_adapters.testing.conformance import EngineConformance, EngineFactory
from engine_adapters.testing.sglang_standin import SglangStandIn

WEIGHTS = {"embed.weight": (64, 16), "layers.0.mlp.weight": (16, 16), "lm_head.weight": (64, 16)}


@pytest.fixture(scope="module")
def standin() -> Iterator[SglangStandIn]:
    config = SimConfig(
        cost=CostModel(k1=0.0, k2=0.002, k3=0.0, k4=0.0),
        max_running=2,
        max_model_len=512,
        kv_capacity_tokens=4096,
        prefill_s_per_token=1e-6,
        weight_load_constant_s=0.01,
        weight_shapes=WEIGHTS,
        vocab_size=256,
    )
    with SglangStandIn(config) as server:
        yield server


class TestSglangConformance(EngineConformance):
    max_model_len = 512
    max_running = 2
    long_tokens = 400
    wait_timeout_s = 15.0
    # The stand-in's synthetic tokens are keyed by the prompt it receives; a resume sends
    # prompt + generated as the prompt (as SGLang requires), so the continuation differs from
    # the uninterrupted run. Prefix preservation and lengths are still checked.
    exact_resume = False

    @pytest.fixture
    def engine_factory(self, standin: SglangStandIn, tmp_path: Any) -> EngineFactory:
        async def make() -> EngineAdapter:
            engine = create_engine(
                "sglang",
                base_url=standin.base_url,
                instance_id="sglang-conf",
                weights_dir=str(tmp_path / "weights"),
                startup_timeout_s=10,
                request_timeout_s=30,
            )
            await engine.start()
            return engine

        return make

    def valid_weights(self, engine: EngineAdapter, version: int) -> Mapping[str, Any]:
        return {name: np.full(shape, version, dtype=np.float16) for name, shape in WEIGHTS.items()}
