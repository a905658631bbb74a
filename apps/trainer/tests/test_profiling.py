"""``staleflow profile`` (:mod:`staleflow_trainer.profiling`) on sim engines: the grid, the
engines side by side in their own processes, a failing engine named, bad input refused, and
the thread budget a rollout instance gets. The vLLM path is in
``integration_tests/cpu/test_profile_fit_vllm.py``."""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path

import pytest

from staleflow_trainer.cli import main
from staleflow_trainer.config import load_config
from staleflow_trainer.errors import ComponentLost, ConfigError
from staleflow_trainer.profiling import (
    _measure_one,
    context_tokens,
    engine_environment,
    grid,
    max_steps,
    measure,
    profile,
)
from staleflow_trainer.runtime.prepare import engine_kwargs, model_dir

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _cfg(tmp_path: Path, *extra: str):  # type: ignore[no-untyped-def]
    return load_config(
        EXAMPLES / "sim-tiny.yaml",
        [
            f"run_dir={tmp_path}",
            "rollout.max_running=4",
            "rollout.max_model_len=256",
            "rollout.sampling.max_new_tokens=64",
            *extra,
        ],
    )


def test_grid_doubles_running_up_to_max_running_at_two_lengths(tmp_path: Path) -> None:
    # a sim engine's context is the longest prompt plus the longest response (128 + 64), not
    # rollout.max_model_len (256): points past it would not fit the engine
    cfg = _cfg(tmp_path)
    assert context_tokens(cfg) == 192
    assert grid(cfg, 8) == [(1, 92), (1, 184), (2, 184), (2, 368), (4, 368), (4, 736)]
    vllm = _cfg(tmp_path, "rollout.backend=vllm")
    assert context_tokens(vllm) == 256 and grid(vllm, 8)[:2] == [(1, 124), (1, 248)]


def test_two_engines_side_by_side_write_one_record_each_per_point(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    assert profile(cfg, steps=4, instances=2) == 0
    rows = [json.loads(line) for line in (tmp_path / "profile.jsonl").read_text().splitlines()]
    points = grid(cfg, 4)
    assert len(rows) == 2 * len(points)
    # each engine measured every point; the sim engine reports the mean resident KV
    for half in (rows[: len(points)], rows[len(points) :]):
        assert [r["running"] for r in half] == [n for n, _ in points]
        assert all(r["backend"] == "sim" and r["step_latency_s"] > 0 for r in half)


def test_a_failing_engine_is_named(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    with pytest.raises(ComponentLost, match=r"profile engine \d failed: InvalidRequest"):
        measure(cfg, [(10_000, 20_000)], steps=4, instances=2)  # over max_running


def test_a_failing_engine_releases_the_peer_waiting_for_it(tmp_path: Path) -> None:
    """One engine process's work, run here: it fails (a point over max_running) while a peer
    waits at the barrier; the peer is released at once, not after the barrier's limit."""
    cfg = _cfg(tmp_path)
    barrier, results = threading.Barrier(2), queue.Queue()  # type: ignore[var-annotated]
    released: list[float] = []

    def peer() -> None:
        t0 = time.monotonic()
        with pytest.raises(threading.BrokenBarrierError):
            barrier.wait(timeout=60)
        released.append(time.monotonic() - t0)

    waiting = threading.Thread(target=peer)
    waiting.start()
    kwargs = engine_kwargs(cfg, 0, model_dir(cfg))
    _measure_one(0, "sim", kwargs, {}, [(10_000, 20_000)], 4, None, barrier, results)
    waiting.join(timeout=90)
    assert results.get_nowait()[:2] == (0, "error")
    assert released and released[0] < 30, released


def test_steps_outside_what_the_context_holds_are_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)  # a sim engine's context: 192 tokens
    assert max_steps(cfg) == 127  # 192 - 127 - 63 = 2 >= 1; 128 leaves 0
    for steps in (1, 128):
        with pytest.raises(ConfigError) as info:
            profile(cfg, steps=steps)
        assert info.value.key == "steps" and "--steps must be in [2, 127]" in str(info.value)


def test_instances_below_one_is_refused_naming_the_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        profile(_cfg(tmp_path), instances=0)
    assert info.value.key == "instances" and "--instances" in str(info.value)


def test_engines_get_a_rollout_instances_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert engine_environment(_cfg(tmp_path, "rollout.cpus_per_instance=2.5"))[
        "OMP_NUM_THREADS"
    ] == "2"  # fmt: skip
    assert engine_environment(_cfg(tmp_path, "rollout.cpus_per_instance=0.5"))[
        "OMP_NUM_THREADS"
    ] == "1"  # fmt: skip
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the environment's choice wins, as with Ray
    assert engine_environment(_cfg(tmp_path))["OMP_NUM_THREADS"] == "3"


def test_cli_passes_instances_and_steps(tmp_path: Path) -> None:
    args = [
        "profile",
        str(EXAMPLES / "sim-tiny.yaml"),
        f"run_dir={tmp_path}",
        "rollout.max_running=2",
        "rollout.max_model_len=256",
        "rollout.sampling.max_new_tokens=64",
        "--instances",
        "2",
        "--steps",
        "4",
    ]
    assert main(args) == 0
    rows = (tmp_path / "profile.jsonl").read_text().splitlines()
    assert len(rows) == 2 * 4  # two engines x (running 1, 2) x two lengths
