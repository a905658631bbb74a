"""Trajectory server throughput between processes: Route and Interrupt at 2K prompt + 8K generated.

The server runs in a child process (``python -m trajectory_server``, token auth on, loopback
TCP); this process is the client. 10,000 trajectories (groups of 8) with 2,048-token prompts:

1. ``route_fresh``: route every fresh prompt (batches of ``--batch`` trajectories per call,
   round-robin over 16 instances) — what the coordinator does for new work;
2. ``interrupt``: return 8,192 generated tokens (+ logprobs + per-token versions) for each —
   the Interrupt/Return path, ~128 KiB of payload per trajectory;
3. ``route``: route all 10,000 partials again, each now 2K prompt + 8K generated tokens — the
   migration/resume path, where the whole payload travels back out.

Each call is timed end to end (encode, TCP, server decode + store op + encode, client decode).
Writes bench-results/trajectory_server.json with ``route_per_s`` (step 3), ``interrupt_per_s``
(step 2), ``route_fresh_per_s`` (step 1), per-call p50/p99 latency and payload MB/s.
``--smoke`` runs 256 trajectories of 128 + 512 tokens (the test suite runs it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trajectory_server import FloatArray, IntArray, SamplingParams, Segment
from trajectory_server.client import TrajectoryClient

ROOT = Path(__file__).resolve().parent.parent
INSTANCES = 16
GROUP = 8


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _summary(
    name: str, latencies: list[float], items: int, wall: float, mb: float
) -> dict[str, Any]:
    return {
        f"{name}_per_s": items / wall,
        f"{name}_calls": len(latencies),
        f"{name}_p50_ms": 1e3 * statistics.median(latencies),
        f"{name}_p99_ms": 1e3 * _pct(latencies, 0.99),
        f"{name}_wall_s": wall,
        f"{name}_payload_mb_per_s": mb / wall,
    }


async def _bench(
    port: int, token: str, n: int, prompt: int, generated: int, batch: int
) -> dict[str, Any]:
    client = await TrajectoryClient.connect("127.0.0.1", port, token=token, timeout_s=600)
    try:
        sampling = SamplingParams(max_new_tokens=generated + 1024)
        prompt_ids = IntArray(i % 32000 for i in range(prompt))
        t0 = time.perf_counter()
        for g in range(n // GROUP):
            await client.submit_group(
                f"g{g}",
                prompt_ids,
                GROUP,
                sampling=sampling,
                metadata={"ground_truth": str(g), "data_source": "bench"},
            )
        submit_wall = time.perf_counter() - t0
        ids = [f"g{g}/{i}" for g in range(n // GROUP) for i in range(GROUP)]
        batches = [ids[k : k + batch] for k in range(0, len(ids), batch)]

        async def route_all(version: int) -> tuple[list[float], float, dict[str, str]]:
            lat, owner = [], {}
            start = time.perf_counter()
            for k, chunk in enumerate(batches):
                inst = f"inst{k % INSTANCES}"
                t = time.perf_counter()
                out = await client.route(inst, chunk, version)
                lat.append(time.perf_counter() - t)
                assert len(out) == len(chunk)
                for tid in chunk:
                    owner[tid] = inst
            return lat, time.perf_counter() - start, owner

        fresh_lat, fresh_wall, owner = await route_all(0)

        tokens = IntArray(i % 32000 for i in range(generated))
        logprobs = FloatArray(-0.001 * (i % 100) for i in range(generated))
        versions = IntArray([0] * (generated // 2) + [1] * (generated - generated // 2))
        int_lat = []
        start = time.perf_counter()
        for chunk in batches:
            segs = [
                Segment(
                    trajectory_id=tid,
                    start=0,
                    token_ids=tokens,
                    logprobs=logprobs,
                    versions=versions,
                )
                for tid in chunk
            ]
            t = time.perf_counter()
            back = await client.return_partial(owner[chunk[0]], segs)
            int_lat.append(time.perf_counter() - t)
            assert back[0].generated_len == generated
        int_wall = time.perf_counter() - start

        route_lat, route_wall, _ = await route_all(1)
        stats = await client.stats()
        assert stats.running == n and stats.queued == 0
    finally:
        await client.close()
    gen_mb = n * generated * 16 / 1e6
    full_mb = n * (prompt * 4 + generated * 16) / 1e6
    return {
        "submit_per_s": n / submit_wall,
        **_summary("route_fresh", fresh_lat, n, fresh_wall, n * prompt * 4 / 1e6),
        **_summary("interrupt", int_lat, n, int_wall, gen_mb),
        **_summary("route", route_lat, n, route_wall, full_mb),
        "server_tokens_held": stats.tokens_held,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trajectories", type=int, default=10_000)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--generated-tokens", type=int, default=8192)
    p.add_argument("--batch", type=int, default=16, help="trajectories per route/return call")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "trajectory_server.json")
    p.add_argument(
        "--smoke", action="store_true", help="256 trajectories of 128 + 512 tokens (seconds)"
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.trajectories, args.prompt_tokens, args.generated_tokens = 256, 128, 512
    if args.trajectories % GROUP:
        p.error(f"--trajectories must be a multiple of {GROUP}")

    token = secrets.token_hex(16)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trajectory_server", "--token-env", "TS_BENCH_TOKEN"],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, TS_BENCH_TOKEN=token),
    )
    try:
        assert proc.stdout is not None
        port = json.loads(proc.stdout.readline())["port"]
        result = asyncio.run(
            _bench(
                port,
                token,
                args.trajectories,
                args.prompt_tokens,
                args.generated_tokens,
                args.batch,
            )
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    report = {
        "benchmark": "trajectory_server",
        "trajectories": args.trajectories,
        "prompt_tokens": args.prompt_tokens,
        "generated_tokens": args.generated_tokens,
        "batch": args.batch,
        "smoke": args.smoke,
        "transport": "loopback TCP, msgpack frames, server in a child process, token auth on",
        **result,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for key in ("route_per_s", "interrupt_per_s", "route_fresh_per_s"):
        name = key.removesuffix("_per_s")
        sys.stdout.write(
            f"{key:>18}: {report[key]:10.0f}/s  p50 {report[name + '_p50_ms']:7.2f} ms  "
            f"p99 {report[name + '_p99_ms']:7.2f} ms  ({report[name + '_payload_mb_per_s']:.0f} MB/s)\n"
        )
    sys.stdout.write(f"wrote {args.out}\n")
    return report


if __name__ == "__main__":
    main()
