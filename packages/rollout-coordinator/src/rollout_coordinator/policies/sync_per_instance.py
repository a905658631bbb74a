"""StaleFlow synchronization: each instance syncs at its own pace, only when it helps.

An instance (not mid-sync) pulls the latest published version only when all hold:

1. it is stale (version after sync < latest published);
2. it cannot take admissible work at its current version: no queued partial with
   V_traj ≤ its version (above the abort floor), and new prompts are either absent, over the
   admission quota, or not admitted by the protocol at its version;
3. the update unlocks routing: its KV usage is below ``sync_kv_threshold`` and its engine
   waiting queue is empty (a busy instance keeps serving its version; syncing would interrupt
   useful work), and there is work routable at the latest version — or it is idle, so syncing
   costs nothing.

An instance at or below the protocol's abort floor can place nothing and always syncs.
Running work of a syncing instance is interrupted by the engine and returns to the trajectory
server with V_traj kept (partial rollout).
"""

from __future__ import annotations

from rollout_coordinator._commands import Sync
from rollout_coordinator.policies._base import AdmissionPort, CycleView

#: A group id the protocol has never seen: asking about it asks "would a *fresh* group be
#: admitted at this version?" without touching state.
PROBE_GROUP = "\x00rollout-coordinator-probe"


def sync_when_starved(view: CycleView, port: AdmissionPort, quota: int | None) -> list[Sync]:
    latest = view.latest_version
    floor = view.abort_floor
    thr = view.config.sync_kv_threshold
    queue = view.queue
    min_partial = queue.min_partial_version(above=floor)
    new_open = queue.has_new and (quota is None or quota > 0)
    new_at: dict[int, bool] = {}

    def new_admissible(v: int) -> bool:
        if not new_open:
            return False
        if v not in new_at:
            new_at[v] = port.admissible(PROBE_GROUP, v)
        return new_at[v]

    work_at_latest = min_partial is not None or new_admissible(latest)
    out: list[Sync] = []
    for iid, inst in view.instances.items():
        if inst.syncing or inst.version >= latest:
            continue
        v = inst.version
        if v <= floor:
            out.append(Sync(instance_id=iid, to_version=latest))
            continue
        if (min_partial is not None and min_partial <= v) or new_admissible(v):
            continue  # it still has admissible work at its own version
        if inst.kv_usage >= thr or inst.waiting > 0:
            continue  # would not unlock routing now
        if work_at_latest or inst.n_running == 0:
            out.append(Sync(instance_id=iid, to_version=latest))
    return out
