"""VllmConfig: device-dependent defaults and validation (no engine started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_adapters import InvalidRequest, create_engine
from engine_adapters.vllm import VllmAdapter, VllmConfig

pytestmark = pytest.mark.vllm


def test_cpu_defaults() -> None:
    cfg = VllmConfig(model_path="/m", cpu_kv_cache_gib=2)
    args = cfg.engine_args(on_gpu=False)
    assert args["dtype"] == "float32" and args["enforce_eager"] is True
    assert args["distributed_executor_backend"] == "uni"
    assert "gpu_memory_utilization" not in args
    assert cfg.environment(on_gpu=False) == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "2",
    }


def test_gpu_defaults_leave_vllm_in_charge() -> None:
    cfg = VllmConfig(model_path="/m", gpu_memory_utilization=0.5)
    args = cfg.engine_args(on_gpu=True)
    assert args["dtype"] == "auto" and args["enforce_eager"] is False
    assert args["gpu_memory_utilization"] == 0.5
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in cfg.environment(on_gpu=True)


def test_engine_kwargs_override_derived_fields() -> None:
    cfg = VllmConfig(
        model_path="/m",
        max_model_len=64,
        engine_kwargs={"dtype": "bfloat16", "max_num_batched_tokens": 64},
    )
    args = cfg.engine_args(on_gpu=False)
    assert args["dtype"] == "bfloat16" and args["max_num_batched_tokens"] == 64


def test_cpu_prefills_prompts_whole() -> None:
    """vLLM-CPU stops its engine when a seeded request is prefilled in chunks (see
    test_vllm_seeded_prefill.py): on CPU chunked prefill is off and a step's token budget
    holds a whole prompt; on a GPU vLLM keeps its own."""
    args = VllmConfig(model_path="/m", max_model_len=512).engine_args(on_gpu=False)
    assert args["enable_chunked_prefill"] is False and args["max_num_batched_tokens"] == 2048
    args = VllmConfig(model_path="/m", max_model_len=8192).engine_args(on_gpu=False)
    assert args["max_num_batched_tokens"] == 8192
    gpu = VllmConfig(model_path="/m").engine_args(on_gpu=True)
    assert "enable_chunked_prefill" not in gpu and "max_num_batched_tokens" not in gpu


@pytest.mark.parametrize(
    ("engine_kwargs", "field"),
    [
        ({"enable_chunked_prefill": True}, "engine_kwargs.enable_chunked_prefill"),
        ({"enable_chunked_prefill": None}, "engine_kwargs.enable_chunked_prefill"),
        ({"max_num_batched_tokens": 511}, "engine_kwargs.max_num_batched_tokens"),
        ({"max_num_batched_tokens": None}, "engine_kwargs.max_num_batched_tokens"),
    ],
)
def test_cpu_refuses_chunked_prefill(engine_kwargs: dict[str, object], field: str) -> None:
    cfg = VllmConfig(model_path="/m", max_model_len=512, engine_kwargs=engine_kwargs)
    with pytest.raises(InvalidRequest) as info:
        cfg.engine_args(on_gpu=False)
    assert info.value.field == field and field in str(info.value)
    cfg.engine_args(on_gpu=True)  # a GPU's generator rewinds: vLLM's choice stands


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"load_mode": "wait"}, "load_mode"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"instance_id": ""}, "instance_id"),
        ({"initial_version": -1}, "initial_version"),
    ],
)
def test_bad_fields_are_named(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        VllmConfig(model_path="/m", **kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_create_engine_routes_config_fields_and_engine_kwargs(tmp_path: Path) -> None:
    adapter = create_engine(
        "vllm",
        model_path=tmp_path,
        instance_id="r3",
        max_num_seqs=4,
        load_mode="abort",
        num_gpu_blocks_override=32,
    )
    assert isinstance(adapter, VllmAdapter) and adapter.backend == "vllm"
    assert adapter.instance_id == "r3" and adapter.version == 0
    assert adapter.config.max_num_seqs == 4 and adapter.config.load_mode == "abort"
    assert adapter.config.engine_kwargs == {"num_gpu_blocks_override": 32}


async def test_unstarted_adapter_is_unavailable(tmp_path: Path) -> None:
    from engine_adapters import EngineUnavailable, GenerateRequest

    adapter = VllmAdapter(VllmConfig(model_path=tmp_path))
    with pytest.raises(EngineUnavailable, match="not started"):
        await adapter.generate(GenerateRequest(trajectory_id="t", prompt_token_ids=(1,)))
    with pytest.raises(EngineUnavailable):
        await adapter.snapshot()
    await adapter.close()
    with pytest.raises(EngineUnavailable, match="closed"):
        await adapter.start()


async def test_model_path_without_weights_is_named(tmp_path: Path) -> None:
    adapter = VllmAdapter(VllmConfig(model_path=tmp_path / "nowhere"))
    with pytest.raises(InvalidRequest) as info:
        await adapter.start()
    assert info.value.field == "model_path" and "nowhere" in str(info.value)
