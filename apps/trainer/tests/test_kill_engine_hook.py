"""The rollout fault hook that kills an engine: it finds the engine's processes through vLLM's
process manager or their title, and refuses to report success when it found none (the real
path runs in ``integration_tests/cpu/test_faults_vllm.py``, fault 1b)."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from types import SimpleNamespace

import pytest

from staleflow_trainer.actors.fault_hooks import RolloutFaultHooks, engine_processes


def _sleep() -> None:
    time.sleep(60)


def _hooks(engine: object) -> RolloutFaultHooks:
    hooks = RolloutFaultHooks()
    hooks._engine = engine
    hooks._init_rollout_hooks()
    return hooks


def test_an_engine_process_held_by_the_manager_is_found_and_killed() -> None:
    proc = multiprocessing.get_context("spawn").Process(target=_sleep, name="not-titled")
    proc.start()
    try:
        manager = SimpleNamespace(processes=[proc])
        adapter = SimpleNamespace(
            engine=SimpleNamespace(
                engine_core=SimpleNamespace(resources=SimpleNamespace(engine_manager=manager))
            )
        )
        assert engine_processes(adapter) == [proc.pid]
        assert asyncio.run(_hooks(adapter).kill_engine()) == [proc.pid]
        proc.join(10)
        assert proc.exitcode == -9  # SIGKILL
        assert engine_processes(adapter) == []  # a dead process is not listed again
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


def test_no_engine_process_is_an_error_not_an_empty_success() -> None:
    with pytest.raises(RuntimeError, match="no engine process under pid"):
        asyncio.run(_hooks(SimpleNamespace()).kill_engine())


def test_a_sim_engine_dies_in_place() -> None:
    killed: list[bool] = []
    assert (
        asyncio.run(_hooks(SimpleNamespace(kill=lambda: killed.append(True))).kill_engine()) == []
    )
    assert killed == [True]
