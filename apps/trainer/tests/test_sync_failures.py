"""A sync that keeps failing (e.g. weights the engine refuses) is retried with backoff, then
fails the run loudly instead of being retried every cycle forever."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from rollout_coordinator import Coordinator
from staleflow_trainer.actors.coordinator_loop import (
    CoordinatorActor,
    coordinator_config,
    protocol_config,
    sync_retry_delay,
)
from staleflow_trainer.config import load_config, to_dict
from staleflow_trainer.errors import ComponentLost, ConfigError
from staleness_protocol import StalenessProtocol

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml"


class _Refuses:
    """A rollout handle whose every sync fails like an engine refusing the weights."""

    def __init__(self) -> None:
        self.calls = 0
        self.sync = self

    async def remote(self, version: int) -> Any:
        self.calls += 1
        raise ValueError(f"InvalidWeights: lm_head.weight shape mismatch (version {version})")


def _actor(*overrides: str) -> tuple[CoordinatorActor, _Refuses]:
    cfg = load_config(EXAMPLE, list(overrides))
    handle = _Refuses()
    actor = CoordinatorActor(
        cfg=to_dict(cfg), model_path="unused", ts_address=("127.0.0.1", 1), ts_token="t",
        rollouts={"vllm-0": handle}, instances={}, trainer=None, rewards=[],
    )  # fmt: skip
    protocol = StalenessProtocol(protocol_config(cfg))
    actor.protocol = protocol  # type: ignore[assignment]
    actor.coordinator = Coordinator(coordinator_config(cfg), protocol, time.monotonic)
    actor.coordinator.add_instance("vllm-0", kv_capacity_tokens=1000, version=0)
    return actor, handle


async def _fail_once(actor: CoordinatorActor) -> None:
    actor._start_sync("vllm-0", 0)
    await actor._syncing["vllm-0"]
    await actor._apply_events()


async def test_the_run_fails_after_the_configured_number_of_failed_syncs_in_a_row() -> None:
    actor, handle = _actor("coordinator.sync_retries=2", "coordinator.sync_retry_backoff_s=0")
    await _fail_once(actor)
    await _fail_once(actor)  # two failures tolerated: retried
    assert actor._counters["sync_failures"] == 2
    with pytest.raises(ComponentLost, match="vllm-0 failed to sync 3 times") as info:
        await _fail_once(actor)
    assert info.value.component == "rollout:vllm-0"
    assert "InvalidWeights" in str(info.value) and "coordinator.sync_retries=2" in str(info.value)
    assert handle.calls == 3


async def test_a_successful_sync_resets_the_count() -> None:
    actor, _ = _actor("coordinator.sync_retries=1", "coordinator.sync_retry_backoff_s=0")
    await _fail_once(actor)
    actor._events.append(("synced", ("vllm-0", 0, {})))
    await actor._apply_events()
    assert "vllm-0" not in actor._sync_failures_in_row
    await _fail_once(actor)  # one failure after the success: still tolerated
    assert actor._counters["sync_failures"] == 2


async def test_retries_back_off() -> None:
    actor, _ = _actor("coordinator.sync_retries=3", "coordinator.sync_retry_backoff_s=0.2")
    await _fail_once(actor)  # the first try is not delayed
    t0 = time.monotonic()
    await _fail_once(actor)  # the retry waits backoff_s
    assert time.monotonic() - t0 >= 0.2


def test_retry_delay_doubles_and_is_capped() -> None:
    assert [sync_retry_delay(n, 0.5) for n in range(5)] == [0.0, 0.5, 1.0, 2.0, 4.0]
    assert sync_retry_delay(20, 0.5) == 30.0
    assert sync_retry_delay(3, 0.0) == 0.0


@pytest.mark.parametrize(
    "override", ["coordinator.sync_retries=-1", "coordinator.sync_retry_backoff_s=-0.5"]
)
def test_bad_retry_settings_are_refused_naming_the_key(override: str) -> None:
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(EXAMPLE, [override])
