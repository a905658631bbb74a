"""The two worked embeddings in ``examples/`` keep the true staleness of every trained sample
within η, whatever the training time: a verl-style single controller (a Ray driver, rollout
worker actors, a trainer actor that takes real time) and an AReaL/slime-style streaming loop
(rollout workers and a trainer around an asyncio queue).

True staleness is measured outside the protocol: each sample carries the weights version its
worker really held when it started generating it, and the trainer side computes
``consumed buffer − that version`` for every sample it trains.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def check(report: dict[str, Any], eta: int, steps: int, batch: int = 4, group: int = 4) -> None:
    true = report["true_staleness_histogram"]
    assert report["steps"] == steps
    assert sum(true.values()) == steps * batch * group  # every trained sample measured
    assert max(true) <= eta and min(true) >= 0, true
    assert true == report["protocol_staleness_histogram"]  # the bound is the true one


@pytest.fixture(scope="module")
def single_controller() -> Iterator[ModuleType]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    import ray.cloudpickle

    module = load_example("protocol_single_controller")
    # the example is a script, not an installed module: ship its actor classes by value
    ray.cloudpickle.register_pickle_by_value(module)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield module
    if started:
        ray.shutdown()


@pytest.mark.ray
@pytest.mark.parametrize(("eta", "delay"), [(0, 0.0), (0, 0.3), (1, 0.3), (3, 0.0), (3, 0.3)])
def test_single_controller_on_ray_trains_nothing_staler_than_eta(
    single_controller: ModuleType, eta: int, delay: float
) -> None:
    report = single_controller.run(eta=eta, train_delay_s=delay, steps=5)
    check(report, eta, steps=5)
    if eta > 0:
        assert max(report["true_staleness_histogram"]) >= 1  # rollout ran ahead of training


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
@pytest.mark.parametrize("delay", [0.0, 0.03, 0.15])
async def test_streaming_loop_over_an_asyncio_queue_trains_nothing_staler_than_eta(
    eta: int, delay: float
) -> None:
    streaming = load_example("protocol_streaming")
    report = await streaming.run(eta=eta, train_delay_s=delay, steps=8, seed=eta)
    check(report, eta, steps=8)
    if eta > 0 and delay > 0:
        assert max(report["true_staleness_histogram"]) >= 1  # rollout ran ahead of training
