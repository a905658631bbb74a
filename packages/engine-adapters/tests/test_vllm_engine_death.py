"""A real vLLM-CPU engine whose EngineCore process is killed (SIGKILL, as the kernel's OOM
killer or a crash would end it): the adapter reports it dead — ``check_health`` and every call
raise ``EngineDead`` — and closes without hanging; and one left paused for good by a weight
load that failed after validation is reported dead too. Each test has its own engine."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from engine_adapters import (
    EngineDead,
    EngineUnavailable,
    GenerateRequest,
    SamplingParams,
    create_engine,
)
from engine_adapters.testing.tiny_model import make_tiny_qwen2
from engine_adapters.vllm import VllmAdapter

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


def engine_core_children() -> list[int]:
    """This process's children whose command line names vLLM's EngineCore (Linux /proc)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me and b"EngineCore" in cmd:
            found.append(int(entry.name))
    return found


async def test_a_killed_engine_core_is_reported_dead(tmp_path: Path) -> None:
    adapter = create_engine(
        "vllm",
        model_path=make_tiny_qwen2(tmp_path / "model"),
        instance_id="vllm-dies",
        max_model_len=512,
        max_num_seqs=2,
        num_gpu_blocks_override=64,
    )
    assert isinstance(adapter, VllmAdapter)
    await adapter.start()
    try:
        await adapter.check_health()  # nothing to report
        request = GenerateRequest(
            trajectory_id="dying",
            prompt_token_ids=(5, 6, 7, 8),
            sampling=SamplingParams(temperature=0.0, max_new_tokens=400),
        )
        task = asyncio.create_task(adapter.generate(request))
        for _ in range(600):  # until it decodes
            if (await adapter.snapshot()).running:
                break
            await asyncio.sleep(0.05)
        assert not task.done(), "it finished before the kill: give it more tokens"
        (pid,) = engine_core_children()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDead, match="vllm-dies"):
            await asyncio.wait_for(task, 60)
        for _ in range(600):  # vLLM notices the exit on its own thread
            try:
                await adapter.check_health()
            except EngineDead:
                break
            await asyncio.sleep(0.05)
        with pytest.raises(EngineDead):
            await adapter.check_health()
        with pytest.raises(EngineDead):
            await adapter.snapshot()
        with pytest.raises(EngineDead):
            await adapter.generate(GenerateRequest(trajectory_id="after", prompt_token_ids=(5,)))
    finally:
        await asyncio.wait_for(adapter.close(), 60)  # a dead engine closes without hanging
    await adapter.check_health()  # nothing to report


async def test_an_engine_left_paused_by_a_failed_load_is_reported_dead(tmp_path: Path) -> None:
    """A weight load that fails after validation leaves the engine paused for good (half-loaded
    weights never serve): ``check_health`` says it can never serve again, so a rollout host
    ends the instance instead of failing every poll."""
    from safetensors.torch import load_file

    model = make_tiny_qwen2(tmp_path / "model")
    adapter = create_engine(
        "vllm", model_path=model, instance_id="vllm-paused", max_model_len=512, max_num_seqs=2,
        num_gpu_blocks_override=64,
    )  # fmt: skip
    assert isinstance(adapter, VllmAdapter)
    await adapter.start()
    try:

        async def fails(*args: object) -> None:
            raise RuntimeError("out of device memory while copying the weights")

        adapter._send_weights = fails  # type: ignore[method-assign]
        weights = load_file(str(model / "model.safetensors"))
        with pytest.raises(EngineUnavailable, match="stays paused"):
            await adapter.load_weights(1, weights)
        with pytest.raises(EngineDead, match="can never serve again"):
            await adapter.check_health()
        with pytest.raises(EngineUnavailable):
            await adapter.snapshot()
    finally:
        await asyncio.wait_for(adapter.close(), 60)
    await adapter.check_health()  # closed: nothing to report
