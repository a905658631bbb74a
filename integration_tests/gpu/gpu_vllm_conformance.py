"""The engine conformance suite against real vLLM on a CUDA GPU (same adapter as on CPU)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_adapters import EngineAdapter, create_engine
from engine_adapters.testing.conformance import EngineConformance, EngineFactory
from engine_adapters.testing.tiny_model import make_tiny_qwen2

pytestmark = [pytest.mark.vllm, pytest.mark.gpu]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not torch.cuda.is_available():
        raise RuntimeError("gpu_vllm_conformance needs a CUDA GPU; none is visible")
    return make_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"), seed=0)


class TestGpuVllmConformance(EngineConformance):
    max_model_len = 512
    max_running = 2
    long_tokens = 400
    wait_timeout_s = 120.0

    @pytest.fixture
    def engine_factory(self, model_dir: Path) -> EngineFactory:
        async def make() -> EngineAdapter:
            engine = create_engine(
                "vllm",
                model_path=model_dir,
                instance_id="vllm-gpu",
                max_model_len=self.max_model_len,
                max_num_seqs=self.max_running,
                gpu_memory_utilization=0.2,
            )
            await engine.start()
            return engine

        return make

    def valid_weights(self, engine: EngineAdapter, version: int) -> Mapping[str, Any]:
        from safetensors.torch import load_file

        base = load_file(str(Path(engine.config.model_path) / "model.safetensors"))  # type: ignore[attr-defined]
        gen = torch.Generator().manual_seed(1000 + version)
        return {
            k: t + 0.1 * torch.randn(t.shape, generator=gen, dtype=t.dtype) for k, t in base.items()
        }
