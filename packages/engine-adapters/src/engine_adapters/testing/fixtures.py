"""Pytest fixtures shared by engine tests (imports pytest; load it as a plugin).

In a ``conftest.py``::

    pytest_plugins = ["engine_adapters.testing.fixtures"]

or import the fixture by name into a test module.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_adapters.testing.tiny_model import make_tiny_qwen2


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 model directory (default sizes, seed 0), built once per test session."""
    return make_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))
