"""The control core's instance events: an instance joins, is lost or falls silent, and a sync
ends (done or failed). Functions over the :class:`~.core.ControlCore` they change, as
:mod:`.state` is; the core's ``handle`` dispatches to them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from staleflow_trainer.control import effects as fx
from staleflow_trainer.control.events import (
    InstanceJoined,
    InstanceLost,
    InstanceSilent,
    Reported,
    SyncDone,
    SyncFailed,
)

if TYPE_CHECKING:
    from staleflow_trainer.control.core import ControlCore


def joined(core: ControlCore, ev: InstanceJoined) -> None:
    core.coordinator.add_instance(
        ev.instance_id, kv_capacity_tokens=ev.kv_capacity_tokens, version=ev.version
    )
    if not ev.setup:
        core.counters["instances_joined"] += 1
    core.report.instance_joined(ev.instance_id, ev.at, ev.version)


def lost(core: ControlCore, ev: InstanceLost, out: list[fx.Effect]) -> None:
    iid = ev.instance_id
    if iid not in core.coordinator.instances:
        return
    # what the store holds as finished or dropped of its work: settled as the report the
    # instance's death swallowed would have settled it (not requeued: the store would
    # refuse to route it again)
    held = core.ledger.held.get(iid, {})
    finished = [o for o in ev.finished if o.trajectory_id in held]
    dropped = [d for d in ev.dropped if d[0] in held]
    if finished or dropped:
        core.counters["lost_finished"] += len(finished)
        core._reported(Reported(at=ev.at, instance_id=iid, outcomes=finished,
                                dropped=dropped), out)  # fmt: skip
    core.coordinator.remove_instance(iid)  # routes held for it stay queued, reserved
    lengths = dict(ev.requeued)
    held_ids = core.ledger.held_by(iid)
    for tid in held_ids:
        core.ledger.requeue(tid, lengths.get(tid))
    core.ledger.forget_instance(iid)
    core._snapshots.pop(iid, None)
    core._sync_fail_streak.pop(iid, None)
    if not ev.setup:
        core.counters["instances_lost"] += 1
    # (one the store lists that is not held there any more was requeued before: taken
    # back unsent while the instance was silent)
    core.counters["lost_requeued"] += sum(1 for t in held_ids if t in lengths)
    core.report.instance_gone(iid, ev.at)


def silent(core: ControlCore, ev: InstanceSilent) -> None:
    iid = ev.instance_id
    if iid not in core.coordinator.instances:
        return  # lost meanwhile
    if ev.silent and iid not in core.coordinator.silent:
        core.counters["instances_silent"] += 1
    core.coordinator.set_silent(iid, ev.silent)
    held = core.ledger.held.get(iid, {})
    back = [t for t in ev.withdrawn if t in held]  # (not settled or moved meanwhile)
    for tid in back:
        core.ledger.requeue(tid, None)
    if back:
        core.counters["withdrawn_routes"] += len(back)
        core.coordinator.unroute(iid, back)


def sync_done(core: ControlCore, ev: SyncDone) -> None:
    inst = core.coordinator.instances.get(ev.instance_id)
    if inst is None or ev.version < max(inst.version, inst.target_version):
        return  # lost meanwhile, or superseded by a later sync (greedy sync)
    core._sync_fail_streak.pop(ev.instance_id, None)
    core.coordinator.on_sync_done(ev.instance_id, ev.version)
    core.report.instance_synced(ev.instance_id, ev.at, ev.version)


def sync_failed(core: ControlCore, ev: SyncFailed, out: list[fx.Effect]) -> None:
    iid = ev.instance_id
    if iid not in core.coordinator.instances:
        return
    core.counters["sync_failures"] += 1
    streak = core._sync_fail_streak.get(iid, 0) + 1
    core._sync_fail_streak[iid] = streak
    core.coordinator.on_sync_failed(iid)  # routes held for it stay queued, reserved
    core.report.instance_synced(iid, ev.at, None)
    if streak > core.config.sync_retries:
        core.halt(
            f"rollout:{iid}",
            f"instance {iid} failed to sync {streak} times in a row "
            f"(sync_retries={core.config.sync_retries}); last error: {ev.error}",
            out,
        )
