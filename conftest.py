"""Workspace-wide test settings: no hub, no telemetry, small vLLM KV cache; every test leaves
structlog configured as it found it."""

import os
from collections.abc import Iterator

import pytest

for _k, _v in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",  # workers use this .venv, not a `uv run` env
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_k, _v)

try:  # after the settings above: nothing the app imports may read the environment first
    from staleflow_trainer.cli import logging_restored
except ImportError:  # an environment of one package without the app (the protocol alone)
    logging_restored = None


@pytest.fixture(autouse=True)
def _structlog_configuration_restored() -> Iterator[None]:
    """Every test starts with structlog as the one before it found it: ``staleflow``'s
    ``main`` configures the process's logging (its ``--log-level``), which must not decide
    what a later test's log capture sees."""
    if logging_restored is None:
        yield
        return
    with logging_restored():
        yield
