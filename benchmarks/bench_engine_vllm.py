"""vLLM adapter overhead → merges ``adapter_overhead_pct`` (and friends) into bench-results/engine.json.

Same engine, same run: one ``AsyncLLM`` (tiny local Qwen2, vLLM-CPU here) serves batches of
requests either through :class:`engine_adapters.vllm.VllmAdapter` (``generate`` with per-token
logprobs and versions) or straight through ``AsyncLLM.generate`` with equivalent sampling
parameters (DELTA outputs, ``logprobs=1``, ``ignore_eos``). Batches alternate (A-D, D-A, …)
so drift in machine load hits both paths alike; each batch uses fresh random prompts so no path
gets prefix-cache hits the other did not. ``adapter_overhead_pct`` is the median over pairs of
``(direct_tps - adapter_tps) / direct_tps × 100`` (target ≤ 3 %).

Wall-clock throughput on a shared 2-core machine swings by ±100 % between runs, so two steadier
companions are reported: the best-of-N comparison (``vllm_overhead_pct_best_of``) and the
client-process CPU time the adapter adds per token (``vllm_adapter_extra_client_cpu_us_per_token``;
the EngineCore runs in another process, so this is the adapter's own cost plus noise), also as a
share of the direct path's wall time per token (``vllm_adapter_client_cpu_overhead_pct``).

Kept separate from ``bench_engine.py`` (the sim part) so each part can run alone; both merge
their own keys into the same JSON file.

Usage: ``python benchmarks/bench_engine_vllm.py [--pairs 15] [--requests 32] [--tokens 96]``;
``--smoke`` runs the same path on 2 pairs of 4 requests of 8 tokens (its figures mean nothing:
it keeps the benchmark from rotting, and the test suite runs it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROMPT_LEN = 16


def _prompts(rng: random.Random, n: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in range(n)]


async def _through_adapter(
    adapter: Any, prompts: list[list[int]], tokens: int, tag: str
) -> tuple[float, float]:
    from engine_adapters import GenerateRequest, SamplingParams

    sampling = SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=None)
    c0, t0 = time.process_time(), time.perf_counter()
    results = await asyncio.gather(
        *(
            adapter.generate(
                GenerateRequest(trajectory_id=f"{tag}-{i}", prompt_token_ids=p, sampling=sampling)
            )
            for i, p in enumerate(prompts)
        )
    )
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    produced = sum(len(r.token_ids) for r in results)
    assert produced == len(prompts) * tokens, produced
    return produced / wall, cpu / produced


async def _direct(
    engine: Any, prompts: list[list[int]], tokens: int, tag: str
) -> tuple[float, float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        temperature=1.0,
        max_tokens=tokens,
        ignore_eos=True,
        logprobs=1,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )

    async def one(i: int, prompt: list[int]) -> int:
        ids: list[int] = []
        lps: list[float] = []
        async for out in engine.generate(
            TokensPrompt(prompt_token_ids=prompt), params, f"{tag}-{i}"
        ):
            comp = out.outputs[0]
            ids.extend(comp.token_ids)
            lps.extend(comp.logprobs[j][t].logprob for j, t in enumerate(comp.token_ids))
        return len(ids)

    c0, t0 = time.process_time(), time.perf_counter()
    produced = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert produced == len(prompts) * tokens, produced
    return produced / wall, cpu / produced


def _iqr(values: list[float]) -> float:
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


async def measure(pairs: int, requests: int, tokens: int) -> dict[str, Any]:
    from engine_adapters.testing.tiny_model import make_tiny_qwen2
    from engine_adapters.vllm import VllmAdapter

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_qwen2(Path(tmp) / "tiny-qwen2")
        adapter = VllmAdapter.from_config(
            model_path=model, instance_id="bench", max_model_len=512, max_num_seqs=requests
        )
        await adapter.start()
        try:
            engine = adapter.engine
            vocab = 512
            rng = random.Random(0)
            # Warm both paths once.
            await _through_adapter(adapter, _prompts(rng, requests, vocab), tokens, "warm-a")
            await _direct(engine, _prompts(rng, requests, vocab), tokens, "warm-d")
            adapter_runs: list[tuple[float, float]] = []
            direct_runs: list[tuple[float, float]] = []
            for k in range(pairs):
                order = ("a", "d") if k % 2 == 0 else ("d", "a")
                for path in order:
                    prompts = _prompts(rng, requests, vocab)
                    if path == "a":
                        adapter_runs.append(
                            await _through_adapter(adapter, prompts, tokens, f"a{k}")
                        )
                    else:
                        direct_runs.append(await _direct(engine, prompts, tokens, f"d{k}"))
        finally:
            await adapter.close()
    pairs_ = list(zip(adapter_runs, direct_runs, strict=True))
    overheads = [(d[0] - a[0]) / d[0] * 100.0 for a, d in pairs_]
    # Client-side CPU (this process: output processing + adapter) per token, which machine
    # load disturbs far less than wall time. Extra adapter CPU per token, as a share of the
    # direct path's wall time per token, bounds the throughput the adapter can cost.
    extra_cpu = [a[1] - d[1] for a, d in pairs_]
    direct_wall_per_token = statistics.median(1.0 / d[0] for d in direct_runs)
    return {
        "adapter_overhead_pct": statistics.median(overheads),
        "vllm_adapter_tokens_per_s": statistics.median(a[0] for a in adapter_runs),
        "vllm_direct_tokens_per_s": statistics.median(d[0] for d in direct_runs),
        "vllm_overhead_pct_per_pair": [round(o, 3) for o in overheads],
        # Spread of the pair overheads: if it dwarfs the median, machine load decided the run.
        "vllm_overhead_pct_iqr": _iqr(overheads),
        # Best-of-N: machine load only ever slows a run down, so the fastest run of each path
        # approximates its undisturbed rate.
        "vllm_overhead_pct_best_of": (
            (max(d[0] for d in direct_runs) - max(a[0] for a in adapter_runs))
            / max(d[0] for d in direct_runs)
            * 100.0
        ),
        "vllm_direct_client_cpu_us_per_token": statistics.median(d[1] for d in direct_runs) * 1e6,
        "vllm_adapter_extra_client_cpu_us_per_token": statistics.median(extra_cpu) * 1e6,
        "vllm_adapter_client_cpu_overhead_pct": (
            statistics.median(extra_cpu) / direct_wall_per_token * 100.0
        ),
        "vllm_overhead_workload": (
            f"{pairs} interleaved pairs x {requests} requests x {PROMPT_LEN} prompt + "
            f"{tokens} new tokens, tiny Qwen2 (hidden 64, 2 layers), logprobs=1"
        ),
    }


def merge_into(path: Path, metrics: dict[str, Any]) -> None:
    data: dict[str, Any] = json.loads(path.read_text() or "{}") if path.exists() else {}
    data.update(metrics)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--out", default=str(ROOT / "bench-results" / "engine.json"))
    parser.add_argument("--smoke", action="store_true", help="2 pairs x 4 requests x 8 tokens")
    args = parser.parse_args(argv)
    if args.smoke:
        args.pairs, args.requests, args.tokens = 2, 4, 8
    metrics = asyncio.run(measure(args.pairs, args.requests, args.tokens))
    merge_into(Path(args.out), metrics)
    for key, value in metrics.items():
        print(f"{key:32s} {value:,.3f}" if isinstance(value, float) else f"{key:32s} {value}")


if __name__ == "__main__":
    main()
