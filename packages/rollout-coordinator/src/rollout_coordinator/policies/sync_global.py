"""Global synchronization, as the baselines do it.

* :func:`sync_all_on_publish` — greedy: every instance pulls as soon as a newer version is
  published, interrupting its running work (which keeps V_traj and resumes later: partial
  rollout). Models verl fully-async / AReaL / ROLL Flash weight updates, and the vanilla-sync
  ablation.
* :func:`sync_all_when_drained` — every instance pulls once it is idle (no running or waiting
  work): the batch never gets interrupted. Models verl's synchronous trainer and its one-step
  off-policy pipeline, where weights are updated between generation calls.
"""

from __future__ import annotations

from rollout_coordinator._commands import Sync
from rollout_coordinator.policies._base import AdmissionPort, CycleView


def sync_all_on_publish(view: CycleView, port: AdmissionPort, quota: int | None) -> list[Sync]:
    latest = view.latest_version
    return [
        Sync(instance_id=iid, to_version=latest)
        for iid, inst in view.instances.items()
        if not inst.syncing and inst.version < latest
    ]


def sync_all_when_drained(view: CycleView, port: AdmissionPort, quota: int | None) -> list[Sync]:
    latest = view.latest_version
    return [
        Sync(instance_id=iid, to_version=latest)
        for iid, inst in view.instances.items()
        if not inst.syncing and inst.version < latest and inst.n_running == 0 and inst.waiting == 0
    ]
