"""Shared fixtures: one tiny model per test session (created locally, no hub)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from staleflow_trainer.tiny_model import TinyModelSpec, make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", TinyModelSpec(seed=0))
