"""Conformance against a REAL SGLang server (GPU machines), configured from the environment.

CI cannot run SGLang; ``integration_tests/gpu/`` subclasses this on machines that can::

    # integration_tests/gpu/test_sglang_real_conformance.py
    from engine_adapters.testing.real_sglang import RealSglangConformance

    class TestRealSglangConformance(RealSglangConformance):
        pass

Environment:

* ``STALEFLOW_SGLANG_MODEL`` (required) — a Hugging Face model directory with ``*.safetensors``;
  its tensors are the "valid weights" reloaded as new versions.
* ``STALEFLOW_SGLANG_URL`` — attach to this server; otherwise one is launched on
  ``STALEFLOW_SGLANG_PORT`` (default 30000) with ``--max-running-requests 2`` and
  ``--context-length`` = ``max_model_len``.

A missing variable or server is an error, never a skip.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from engine_adapters._contract import EngineAdapter
from engine_adapters.sglang import SglangAdapter, SglangLaunchConfig, model_weight_shapes
from engine_adapters.testing.conformance import EngineConformance, EngineFactory


def _model_dir() -> Path:
    value = os.environ.get("STALEFLOW_SGLANG_MODEL")
    if not value:
        raise RuntimeError("set STALEFLOW_SGLANG_MODEL to a model directory with safetensors")
    return Path(value)


class RealSglangConformance(EngineConformance):
    max_model_len = 512
    max_running = 2
    long_tokens = 400
    exact_resume = False  # GPU kernels may break greedy ties differently after re-prefill
    wait_timeout_s = 300.0

    @pytest.fixture
    def engine_factory(self, tmp_path: Path) -> EngineFactory:
        model = _model_dir()
        url = os.environ.get("STALEFLOW_SGLANG_URL")

        async def make() -> EngineAdapter:
            kwargs: dict[str, Any] = {
                "weights_dir": str(tmp_path / "weights"),
                "weight_shapes": model_weight_shapes(model),
                "instance_id": "sglang-real",
            }
            if url:
                engine = SglangAdapter(url, **kwargs)
            else:
                launch = SglangLaunchConfig(
                    model_path=str(model),
                    port=int(os.environ.get("STALEFLOW_SGLANG_PORT", "30000")),
                    context_length=self.max_model_len,
                    max_running_requests=self.max_running,
                )
                engine = SglangAdapter(launch=launch, **kwargs)
            await engine.start()
            return engine

        return make

    def valid_weights(self, engine: EngineAdapter, version: int) -> Mapping[str, Any]:
        import safetensors.torch

        tensors: dict[str, Any] = {}
        for f in sorted(_model_dir().glob("*.safetensors")):
            tensors.update(safetensors.torch.load_file(str(f)))
        return tensors
