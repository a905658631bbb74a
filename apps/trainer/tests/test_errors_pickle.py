"""The app's errors cross process boundaries as themselves: a simulation worker of ``compare``
(a process pool) and a Ray actor pickle what they raise, and an error whose fields are
keyword-only failed to rebuild there (the pool reported a broken pool instead of the error)."""

from __future__ import annotations

import pickle
from concurrent.futures import ProcessPoolExecutor

import pytest

from staleflow_trainer import errors

CASES = [
    errors.ConfigError("trainer.lr must be > 0", key="trainer.lr", allowed="> 0"),
    errors.DataError("row 3 has no prompt", path="/d.jsonl", row=3, field="prompt"),
    errors.RewardError("not a score", fn="m:f"),
    errors.TrainerError("empty batch", field="batch"),
    errors.CheckpointError("bad checksum", path="/c"),
    errors.ComponentLost("every instance is lost", component="rollout"),
    errors.StartupFailed("ray did not start", component="ray"),
    errors.CommandUnavailable("not installed", module="m"),
    errors.StaleflowError("plain"),
]


@pytest.mark.parametrize("err", CASES, ids=lambda e: type(e).__name__)
def test_an_error_pickles_with_its_fields(err: errors.StaleflowError) -> None:
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert str(back) == str(err) and back.args == err.args
    assert vars(back) == vars(err)


def _raise_config_error() -> None:
    raise errors.ConfigError("coordinator.x must be off", key="coordinator.x", allowed="off")


def test_a_config_error_in_a_worker_process_reaches_the_caller_as_itself() -> None:
    with ProcessPoolExecutor(1) as pool, pytest.raises(errors.ConfigError) as info:
        pool.submit(_raise_config_error).result(timeout=60)
    assert info.value.key == "coordinator.x" and info.value.allowed == "off"
