"""SGLang adapter pieces: safetensors writer, metrics parsing, launcher, stand-in endpoints."""

from __future__ import annotations

import asyncio
import signal
import socket
import textwrap
from pathlib import Path

import attrs
import httpx
import numpy as np
import pytest
import safetensors.numpy
import torch

from engine_adapters import (
    EngineDead,
    EngineUnavailable,
    GenerateRequest,
    InvalidRequest,
    PromptTooLong,
    SamplingParams,
    create_engine,
)
from engine_adapters.sglang import SglangAdapter, SglangLaunchConfig, parse_metrics
from engine_adapters.sglang._safetensors import read_header, save_file
from engine_adapters.sim import SimConfig
from engine_adapters.testing.sglang_standin import STANDIN_VERSION, SglangStandIn


def test_safetensors_writer_is_readable_by_the_real_library(tmp_path: Path) -> None:
    tensors = {
        "a.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b.bias": np.ones(5, dtype=np.float16),
    }
    path = tmp_path / "m.safetensors"
    nbytes = save_file(tensors, path)
    assert nbytes == 12 * 4 + 5 * 2
    loaded = safetensors.numpy.load_file(str(path))
    for k, v in tensors.items():
        assert np.array_equal(loaded[k], v)
    assert read_header(path) == {"a.weight": ("F32", (3, 4)), "b.bias": ("F16", (5,))}


def test_safetensors_writer_takes_bf16_torch(tmp_path: Path) -> None:
    t = torch.randn(4, 3).to(torch.bfloat16)
    path = tmp_path / "t.safetensors"
    save_file({"w": t}, path)
    import safetensors.torch

    assert torch.equal(safetensors.torch.load_file(str(path))["w"], t)


def test_parse_metrics() -> None:
    text = (
        "# HELP sglang:num_running_reqs x\n"
        'sglang:num_running_reqs{model_name="m",dp="0"} 3.0\n'
        'sglang:num_running_reqs{model_name="m",dp="1"} 2.0\n'
        "sglang:token_usage 0.25\n"
        "other_metric 7\n"
    )
    assert parse_metrics(text) == {"sglang:num_running_reqs": 5.0, "sglang:token_usage": 0.25}


def test_launch_command() -> None:
    cfg = SglangLaunchConfig(model_path="/m", port=31000, tp_size=2, context_length=4096)
    cmd = cfg.command()
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[cmd.index("--port") + 1] == "31000"
    assert "--enable-metrics" in cmd and cmd[cmd.index("--context-length") + 1] == "4096"
    assert cfg.base_url == "http://127.0.0.1:31000"


def test_adapter_needs_exactly_one_target() -> None:
    with pytest.raises(InvalidRequest):
        SglangAdapter()
    with pytest.raises(InvalidRequest):
        SglangAdapter("http://x", launch={"model_path": "/m"})
    assert isinstance(create_engine("sglang", base_url="http://127.0.0.1:1"), SglangAdapter)


def test_standin_endpoints_follow_the_documented_shapes() -> None:
    with SglangStandIn(SimConfig(max_model_len=256, kv_capacity_tokens=2048)) as server:
        info = httpx.get(server.base_url + "/get_server_info").json()
        assert info["version"] == STANDIN_VERSION and info["context_length"] == 256
        assert httpx.get(server.base_url + "/get_weight_version").json() == {"weight_version": "0"}
        out = httpx.post(
            server.base_url + "/generate",
            json={
                "rid": "r1",
                "input_ids": [20, 21, 22],
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
            },
            timeout=30,
        ).json()
        meta = out["meta_info"]
        assert len(out["output_ids"]) == 5 == meta["completion_tokens"]
        assert meta["finish_reason"] == {"type": "length", "length": 5}
        assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
        assert meta["weight_version"] == "0" and meta["prompt_tokens"] == 3
        too_long = httpx.post(
            server.base_url + "/generate",
            json={"rid": "r2", "input_ids": [20] * 300, "sampling_params": {}},
            timeout=30,
        )
        assert too_long.status_code == 400
        assert "context length" in too_long.json()["error"]["message"]
        assert (
            httpx.post(server.base_url + "/abort_request", json={"rid": "nope"}).status_code == 200
        )
        metrics = parse_metrics(httpx.get(server.base_url + "/metrics").text)
        assert metrics["sglang:max_total_num_tokens"] == 2048
        assert metrics["sglang:num_running_reqs"] == 0


def test_model_weight_shapes(tmp_path: Path) -> None:
    from engine_adapters.sglang import model_weight_shapes

    save_file({"x": np.zeros((2, 3), np.float32)}, tmp_path / "model-1.safetensors")
    save_file({"y": np.zeros(4, np.float16)}, tmp_path / "model-2.safetensors")
    assert model_weight_shapes(tmp_path) == {"x": (2, 3), "y": (4,)}


def test_real_sglang_suite_imports_and_needs_its_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_adapters.testing import real_sglang

    monkeypatch.delenv("STALEFLOW_SGLANG_MODEL", raising=False)
    with pytest.raises(RuntimeError, match="STALEFLOW_SGLANG_MODEL"):
        real_sglang._model_dir()


async def test_a_launched_server_that_exits_is_dead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adapter's launch path starts a real server process (``python -m
    sglang.launch_server``, here a module that serves the stand-in); once that process is
    killed, ``check_health`` reports the engine dead. Real SGLang cannot run on this machine."""
    shim = tmp_path / "shim" / "sglang"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("")
    (shim / "launch_server.py").write_text(
        textwrap.dedent(
            """
            import argparse

            import uvicorn

            from engine_adapters.sim import SimConfig
            from engine_adapters.testing.sglang_standin import build_app

            ap = argparse.ArgumentParser()
            ap.add_argument("--host")
            ap.add_argument("--port", type=int)
            args, _ = ap.parse_known_args()
            uvicorn.run(build_app(SimConfig()), host=args.host, port=args.port, log_level="warning")
            """
        )
    )
    monkeypatch.setenv("PYTHONPATH", str(shim.parent))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    adapter = SglangAdapter(
        launch={"model_path": str(tmp_path), "port": port, "startup_timeout_s": 60},
        instance_id="sglang-dies",
    )
    await adapter.start()
    try:
        await adapter.check_health()  # nothing to report
        proc = adapter._process.proc  # type: ignore[union-attr]
        assert proc is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        with pytest.raises(EngineDead, match="sglang-dies"):
            await adapter.check_health()
    finally:
        await adapter.close()
    await adapter.check_health()  # nothing to report


async def test_a_server_error_is_the_engines_not_the_requests() -> None:
    """HTTP 5xx from ``/generate`` (the server, or a gateway in front of it, failed) raises
    ``EngineUnavailable``, while a refused request (HTTP 4xx) stays an ``InvalidRequest``: a
    host can tell a failing server from a bad request."""
    with SglangStandIn(SimConfig(max_model_len=64)) as server:
        adapter = SglangAdapter(base_url=server.base_url, instance_id="sglang-fails")
        await adapter.start()
        try:
            ok = GenerateRequest(trajectory_id="t0", prompt_token_ids=(20, 21),
                                 sampling=SamplingParams(max_new_tokens=3))  # fmt: skip
            assert len((await adapter.generate(ok)).token_ids) == 3
            for status in (500, 503):
                server.fail_generations("CUDA error: an illegal memory access", status)
                with pytest.raises(EngineUnavailable, match=rf"HTTP {status}.*illegal") as e:
                    await adapter.generate(attrs.evolve(ok, trajectory_id=f"t{status}"))
                assert not isinstance(e.value, InvalidRequest)
                await adapter.snapshot()  # everything else still answers
                await adapter.check_health()
            server.fail_generations("sampling_params.top_p must be in (0, 1]", 400)
            with pytest.raises(InvalidRequest, match="top_p") as e:
                await adapter.generate(attrs.evolve(ok, trajectory_id="t400"))
            assert not isinstance(e.value, EngineUnavailable)
            server.fail_generations(None)
            with pytest.raises(PromptTooLong):
                await adapter.generate(attrs.evolve(ok, trajectory_id="t2",
                                                    prompt_token_ids=(20,) * 80))  # fmt: skip
            assert (
                len((await adapter.generate(attrs.evolve(ok, trajectory_id="t3"))).token_ids) == 3
            )
        finally:
            await adapter.close()


async def test_a_resumed_trajectory_counts_what_it_had_and_what_it_generates() -> None:
    """A snapshot's ``generated_tokens`` of a resumed trajectory is its earlier response plus
    what this server generated since, as with the other backends."""
    with SglangStandIn(SimConfig(max_model_len=4096)) as server:
        adapter = SglangAdapter(base_url=server.base_url, instance_id="sglang-resumes")
        await adapter.start()
        try:
            prior = tuple(range(30, 530))
            req = GenerateRequest(trajectory_id="r/0", prompt_token_ids=(20, 21),
                                  sampling=SamplingParams(max_new_tokens=3000),
                                  generated_token_ids=prior, generated_logprobs=(-0.5,) * 500,
                                  generated_versions=(0,) * 500)  # fmt: skip
            task = asyncio.create_task(adapter.generate(req))
            counts: list[int] = []
            for _ in range(200):
                await asyncio.sleep(0.02)
                running = (await adapter.snapshot()).running
                if running and running[0].generated_tokens > len(prior):
                    counts.append(running[0].generated_tokens)
                    break
            assert counts and counts[0] > len(prior), counts
            await adapter.interrupt(["r/0"])
            result = await task
            assert len(result.token_ids) >= counts[0]
        finally:
            await adapter.close()
