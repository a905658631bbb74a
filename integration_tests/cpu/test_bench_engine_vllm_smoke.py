"""``benchmarks/bench_engine_vllm.py --smoke``: the adapter-overhead benchmark runs on a real
vLLM-CPU engine (the tiny Qwen2) on a tiny load and writes every figure. Its values are not
asserted (2 pairs on a shared machine mean nothing); a crash, a path that produces fewer tokens
than asked, or a missing figure fails here, so ``nox -s bench`` cannot rot."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import bench_engine_vllm
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_bench_engine_vllm_smoke(tmp_path: Path, engine_required: Callable[[str], None]) -> None:
    engine_required("vllm")
    out = tmp_path / "engine.json"
    out.write_text(json.dumps({"kept": 1}))  # the bench merges its keys into the file
    bench_engine_vllm.main(["--smoke", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["kept"] == 1
    assert len(data["vllm_overhead_pct_per_pair"]) == 2
    for key in ("vllm_adapter_tokens_per_s", "vllm_direct_tokens_per_s"):
        assert data[key] > 0, key
    for key in ("adapter_overhead_pct", "vllm_overhead_pct_best_of",
                "vllm_adapter_client_cpu_overhead_pct"):  # fmt: skip
        assert math.isfinite(data[key]), key
    assert "2 interleaved pairs x 4 requests" in data["vllm_overhead_workload"]
