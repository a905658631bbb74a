"""``staleflow profile``: the decode-step latency of the config's rollout engines, measured as
they run in training; its output is the input of ``staleflow fit-cost-model``.

Each measured engine gets what a rollout instance of ``staleflow train`` gets: the same engine
arguments, the config's sampling settings (temperature and top-p, one log-probability a
token) and, on a CPU engine, ``rollout.cpus_per_instance`` threads (Ray gives a rollout actor
``OMP_NUM_THREADS`` = that count, at least 1, unless the environment sets it). ``instances``
engines run side by side, one process each as the rollout actors are, and decode every point
at the same time: where instances share a machine (vLLM-CPU on one host), what they take from
each other is in the measurement. Each engine's latency at a point is one record.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from staleflow_trainer.config import AppConfig
from staleflow_trainer.errors import ComponentLost, ConfigError

BARRIER_WAIT_S = 900.0  # the slowest engine's start and one point; a dead peer breaks it
RESULT_WAIT_S = 5.0  # between checks that every engine process is alive


def context_tokens(cfg: AppConfig) -> int:
    """The engine's context limit: ``rollout.max_model_len``; a sim engine's is the longest
    prompt plus the longest response (:func:`staleflow_trainer.config_sim.engine_config`)."""
    if cfg.rollout.backend == "sim":
        from staleflow_trainer.config_sim import engine_config

        return int(engine_config(cfg).max_model_len)
    return cfg.rollout.max_model_len


def max_steps(cfg: AppConfig) -> int:
    """The most decode steps a point can time: its longest trajectories' prompts of
    ``context - steps - steps/2`` tokens need at least one."""
    ctx = context_tokens(cfg)
    return max(s for s in range(1, ctx + 1) if ctx - s - s // 2 >= 1)


def grid(cfg: AppConfig, steps: int) -> list[tuple[int, int]]:
    """The (running, KV tokens) points: running in 1, 2, 4, ... up to ``rollout.max_running``
    (64 at most) at two trajectory lengths within the engine's context that leave room for
    ``steps`` decode steps."""
    r, ctx = cfg.rollout, context_tokens(cfg)
    per_traj = sorted({max(steps, (ctx - steps) // 2), ctx - steps})
    running = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= r.max_running]
    return [(n, n * length) for n in running for length in per_traj]


def engine_environment(cfg: AppConfig) -> dict[str, str]:
    """What a rollout instance's process sees beyond this one's environment."""
    from staleflow_trainer.runtime.prepare import WORKER_ENV

    env = dict(WORKER_ENV)
    threads = os.environ.get("OMP_NUM_THREADS")
    env["OMP_NUM_THREADS"] = threads or str(cfg.rollout.engine_threads)
    return env


def _measure_one(
    index: int,
    backend: str,
    kwargs: Mapping[str, Any],
    env: Mapping[str, str],
    points: Sequence[tuple[int, int]],
    steps: int,
    sampling: Any,
    barrier: Any,
    results: Any,
) -> None:
    """One engine process: start, warm up, then measure each point once every engine is
    ready for it. Puts ``(index, "ok", records)`` or ``(index, "error", message)``."""
    os.environ.update(env)
    from engine_adapters import create_engine

    async def run() -> list[dict[str, Any]]:
        engine = create_engine(backend, instance_id=f"profile-{index}", **kwargs)
        await engine.start()
        try:
            # warm-up, discarded: an engine's first decode steps pay one-off costs (on
            # vLLM-CPU the first point once read 14x slower than its neighbour)
            await engine.profile(points[:1], steps=steps, sampling=sampling)
            out: list[dict[str, Any]] = []
            for point in points:
                await asyncio.to_thread(barrier.wait, BARRIER_WAIT_S)
                measured = await engine.profile([point], steps=steps, sampling=sampling)
                out += [p.to_json() for p in measured]
            return out
        except BaseException:
            barrier.abort()  # the peers stop waiting before this engine closes
            raise
        finally:
            await engine.close()

    try:
        results.put((index, "ok", asyncio.run(run())))
    except BaseException as e:  # the parent reports it; the peers must not wait for us
        barrier.abort()
        results.put((index, "error", f"{type(e).__name__}: {e}"))


def measure(
    cfg: AppConfig, points: Sequence[tuple[int, int]], *, steps: int, instances: int
) -> list[dict[str, Any]]:
    """Every engine's records, engine by engine; raises ComponentLost naming the engine that
    failed or exited."""
    from engine_adapters import SamplingParams
    from staleflow_trainer.runtime.prepare import engine_kwargs, model_dir

    path = model_dir(cfg)
    s = cfg.rollout.sampling
    sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p, seed=cfg.run.seed)
    env = engine_environment(cfg)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(instances), ctx.Queue()
    procs = [
        ctx.Process(
            target=_measure_one,
            args=(
                i,
                cfg.rollout.backend,
                engine_kwargs(cfg, i, path),
                env,
                points,
                steps,
                sampling,
                barrier,
                results,
            ),
            name=f"staleflow-profile-{i}",
        )
        for i in range(instances)
    ]
    for p in procs:
        p.start()
    got: dict[int, list[dict[str, Any]]] = {}
    try:
        while len(got) < instances:
            try:
                i, status, payload = results.get(timeout=RESULT_WAIT_S)
            except queue.Empty:
                # read after the exit codes: a child puts its answer before it exits
                dead = [(n, p.exitcode) for n, p in enumerate(procs)
                        if n not in got and p.exitcode is not None]  # fmt: skip
                try:
                    i, status, payload = results.get_nowait()
                except queue.Empty:
                    if dead:
                        n, code = dead[0]
                        raise ComponentLost(
                            f"profile engine {n} exited with code {code} without an answer",
                            component=f"profile-{n}",
                        ) from None
                    continue
            if status != "ok":
                raise ComponentLost(f"profile engine {i} failed: {payload}",
                                    component=f"profile-{i}")  # fmt: skip
            got[i] = payload
    finally:
        for p in procs:
            p.join(timeout=60 if len(got) == instances else 0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=30)
    return [record for i in range(instances) for record in got[i]]


def profile(cfg: AppConfig, *, steps: int = 8, instances: int = 1) -> int:
    """Measure ``instances`` engines of the config at every point of :func:`grid`; writes
    ``RUN_DIR/profile.jsonl``. No Ray: the engines run in processes of this command."""
    from engine_adapters import ProfilePoint, write_profile_jsonl
    from staleflow_trainer.atomic_files import make_run_dir

    if instances < 1:
        raise ConfigError(
            f"--instances must be at least 1, got {instances}", key="instances", allowed=">= 1"
        )
    most = max_steps(cfg)
    if not 2 <= steps <= most:
        raise ConfigError(
            f"--steps must be in [2, {most}] (the engine's context holds "
            f"{context_tokens(cfg)} tokens), got {steps}",
            key="steps",
            allowed=f"2 to {most}",
        )
    make_run_dir(cfg.run_dir)
    records = measure(cfg, grid(cfg, steps), steps=steps, instances=instances)
    out = Path(cfg.run_dir) / "profile.jsonl"
    out.unlink(missing_ok=True)
    write_profile_jsonl([ProfilePoint(**r) for r in records], out)
    from rich.console import Console

    side = f"{instances} engines side by side, " if instances > 1 else ""
    Console(soft_wrap=True).print(
        f"{len(records)} profile points ({side}{steps} decode steps each) -> {out}\n"
        f"fit them with: staleflow fit-cost-model {out} -o {Path(cfg.run_dir) / 'cost_model.json'}"
    )
    return 0


__all__ = ["context_tokens", "engine_environment", "grid", "max_steps", "measure", "profile"]
