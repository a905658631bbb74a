"""Dynamic sampling whose reward is the same for every response filters every group: the run
stops with ``ComponentLost`` naming ``trainer.max_filtered_in_row``, on the real deployment
with sim engines (Ray, the trajectory server over TCP, the real rollout, control, reward and
trainer actors, the reward plug-in run by the reward workers). Without the limit it would
generate for ever and never train.

The run must end with the error within ``WATCHDOG_S``; the watchdog stops a run that does not
(and the test fails)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fault_checks import run_watched
from tiny_setup import tiny_config

pytestmark = [pytest.mark.fault, pytest.mark.ray, pytest.mark.sim, pytest.mark.timeout(300)]

WATCHDOG_S = 120.0


def test_a_run_whose_every_group_is_filtered_stops_naming_the_limit(
    ray_session: None, tmp_path: Path, engine_required: Any
) -> None:
    engine_required("sim")
    from staleflow_trainer.errors import ComponentLost
    from staleflow_trainer.runtime.wiring import Deployment

    cfg = tiny_config(
        tmp_path,
        "trainer.steps=5",
        "run.checkpoint_every=0",
        "run.resume=never",
        "protocol.batch_size=4",
        "protocol.group_size=2",
        "rollout.num_instances=2",
        "rollout.sampling.max_new_tokens=48",
        "rollout.max_model_len=80",
        "trainer.dynamic_sampling=true",
        "trainer.max_filtered_in_row=6",
        "reward.fn=staleflow_trainer.reward.testing:zero",
        backend="sim",
    )
    out: dict[str, Any] = {}
    dep = Deployment(cfg).start()
    try:
        with pytest.raises(ComponentLost) as info:
            run_watched(dep, out, WATCHDOG_S)
    finally:
        dep.close()
    assert "stopped_by_watchdog" not in out, "the run did not stop though every group is filtered"
    # the control actor's own error, not Ray's wrapper around it (whose text is the remote
    # traceback: the CLI prints the error's type and text)
    assert type(info.value) is ComponentLost and info.value.component == "data"
    msg = str(info.value)
    assert "filtered 6 groups in a row" in msg and "trainer.max_filtered_in_row, is 6" in msg
