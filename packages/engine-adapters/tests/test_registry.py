"""Registry and lazy-import behaviour."""

from __future__ import annotations

import subprocess
import sys

import pytest

import engine_adapters
from engine_adapters import BackendNotInstalled, EngineAdapter, InvalidRequest, create_engine
from engine_adapters._registry import BACKENDS, load_backend


def test_import_pulls_no_engine() -> None:
    code = (
        "import sys, engine_adapters\n"
        "heavy = [m for m in ('torch', 'vllm', 'httpx', 'sglang', 'fastapi', 'uvicorn') "
        "if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_unknown_backend_lists_allowed_names() -> None:
    with pytest.raises(InvalidRequest) as info:
        load_backend("tensorrt")
    for name in ("sim", "vllm", "sglang"):
        assert name in str(info.value)
    assert info.value.field == "backend"


def test_missing_engine_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(BACKENDS, "fake", ("engine_adapters_no_such_backend_module", "fake-extra"))
    with pytest.raises(BackendNotInstalled) as info:
        load_backend("fake")
    assert isinstance(info.value, ImportError)
    assert info.value.extra == "fake-extra"
    assert "engine-adapters[fake-extra]" in str(info.value)


def test_create_sim_engine() -> None:
    engine = create_engine("sim", instance_id="i7", cost="qwen-7b-h20", max_running=8)
    assert isinstance(engine, EngineAdapter)
    assert engine.backend == "sim"
    assert engine.instance_id == "i7"
    assert engine.config.cost.name == "qwen-7b-h20"


def test_create_sim_engine_rejects_unknown_field() -> None:
    with pytest.raises(InvalidRequest) as info:
        create_engine("sim", max_runing=8)
    assert "max_runing" in str(info.value)


def test_public_names_exported() -> None:
    for name in engine_adapters.__all__:
        assert hasattr(engine_adapters, name), name
