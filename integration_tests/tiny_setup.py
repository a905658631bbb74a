"""The tiny example's config shortened for tests, and the engine check: importable by name
from any test module (``integration_tests`` is on the test path; a conftest is not importable
under ``--import-mode=importlib``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from staleflow_trainer.config import AppConfig

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
_ENGINE_MODULES = {"vllm": "vllm", "sim": "engine_adapters.sim"}


def require_engine(backend: str) -> None:
    """Fail (not skip) when the engine a test needs is not importable."""
    module = _ENGINE_MODULES.get(backend)
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.fail(f"backend {backend!r} needs {module!r}, which is not installed")


def tiny_config(run_dir: Path, *overrides: str, backend: str = "vllm") -> AppConfig:
    """``examples/tiny.yaml`` shortened for tests (no TensorBoard, no progress bar)."""
    from staleflow_trainer.config import load_config

    base = [
        f"run_dir={run_dir}",
        "metrics.tensorboard=false",
        "metrics.progress_bar=false",
        "coordinator.snapshot_interval_s=0.1",
    ]
    if backend == "sim":
        base += [
            "rollout.backend=sim",
            "sim.total_gpus=3",
            "sim.workload.response_len_median=2",
        ]
    return load_config(EXAMPLES / "tiny.yaml", [*base, *overrides])
