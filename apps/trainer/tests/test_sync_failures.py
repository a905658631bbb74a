"""A sync that keeps failing (e.g. weights the engine refuses) is retried with backoff, then
fails the run loudly instead of being retried every cycle forever."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from staleflow_trainer.actors.control import ControlActor
from staleflow_trainer.actors.liveness import sync_retry_delay
from staleflow_trainer.config import load_config, to_dict
from staleflow_trainer.control import effects as fx
from staleflow_trainer.control.config import core_config
from staleflow_trainer.control.core import ControlCore
from staleflow_trainer.control.events import InstanceJoined, SyncDone
from staleflow_trainer.data import PromptLengths
from staleflow_trainer.errors import ComponentLost, ConfigError

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml"


class _Refuses:
    """A rollout handle whose every sync fails like an engine refusing the weights."""

    def __init__(self) -> None:
        self.calls = 0
        self.sync = self

    async def remote(self, version: int) -> Any:
        self.calls += 1
        raise ValueError(f"InvalidWeights: lm_head.weight shape mismatch (version {version})")


def _actor(tmp_path: Path, *overrides: str) -> tuple[ControlActor, _Refuses]:
    """The control shell over a real control core, with one instance whose syncs fail (no
    Ray, no servers: the shell's sync path and the core's retry rule only)."""
    cfg = load_config(EXAMPLE, [f"run.run_dir={tmp_path}", *overrides])
    handle = _Refuses()
    actor = ControlActor(
        cfg=to_dict(cfg), prompts=PromptLengths(()), ts_address=("127.0.0.1", 1), ts_token="t",
        rollouts={"vllm-0": handle}, trainer=None, rewards=[],
    )  # fmt: skip
    actor.core = ControlCore(core_config(cfg, rows=8), prompt_len=lambda r: 4)
    actor._wal.reset(actor.core.to_dict())
    actor.core.handle(
        InstanceJoined(at=0.0, instance_id="vllm-0", kv_capacity_tokens=1000, version=0)
    )
    return actor, handle


async def _fail_once(actor: ControlActor) -> None:
    await actor._sync(fx.Sync(instance_id="vllm-0", version=0))
    events, actor._events = actor._events, []
    await actor._feed_batch(events)


async def test_the_run_fails_after_the_configured_number_of_failed_syncs_in_a_row(
    tmp_path: Path,
) -> None:
    actor, handle = _actor(
        tmp_path, "coordinator.sync_retries=2", "coordinator.sync_retry_backoff_s=0"
    )
    await _fail_once(actor)
    await _fail_once(actor)  # two failures tolerated: retried
    assert actor.core.counters["sync_failures"] == 2
    with pytest.raises(ComponentLost, match="vllm-0 failed to sync 3 times") as info:
        await _fail_once(actor)
    assert info.value.component == "rollout:vllm-0"
    assert "InvalidWeights" in str(info.value) and "sync_retries=2" in str(info.value)
    assert handle.calls == 3


async def test_a_successful_sync_resets_the_count(tmp_path: Path) -> None:
    actor, _ = _actor(tmp_path, "coordinator.sync_retries=1", "coordinator.sync_retry_backoff_s=0")
    await _fail_once(actor)
    await actor._feed_batch([SyncDone(at=1.0, instance_id="vllm-0", version=0)])
    assert "vllm-0" not in actor.core.sync_fail_streak
    await _fail_once(actor)  # one failure after the success: still tolerated
    assert actor.core.counters["sync_failures"] == 2


async def test_retries_back_off(tmp_path: Path) -> None:
    actor, _ = _actor(
        tmp_path, "coordinator.sync_retries=3", "coordinator.sync_retry_backoff_s=0.2"
    )
    await _fail_once(actor)  # the first try is not delayed
    t0 = time.monotonic()
    await _fail_once(actor)  # the retry waits backoff_s
    assert time.monotonic() - t0 >= 0.2


def test_retry_delay_doubles_and_is_capped() -> None:
    assert [sync_retry_delay(n, 0.5) for n in range(5)] == [0.0, 0.5, 1.0, 2.0, 4.0]
    assert sync_retry_delay(20, 0.5) == 30.0
    assert sync_retry_delay(3, 0.0) == 0.0


@pytest.mark.parametrize(
    "override",
    [
        "coordinator.sync_retries=-1",
        "coordinator.sync_retry_backoff_s=-0.5",
        "coordinator.sync_timeout_s=0",
        "coordinator.instance_error_limit=0",
        "coordinator.call_timeout_s=0",
    ],
)
def test_bad_retry_settings_are_refused_naming_the_key(override: str) -> None:
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(EXAMPLE, [override])
