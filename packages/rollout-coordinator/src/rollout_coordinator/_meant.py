"""Which routed trajectories were meant to run on their instance, for the ``abort`` preemption
rule (:func:`~rollout_coordinator.policies.migration.abort_preempted`).

A trajectory routed into room, or shown running by a snapshot since, was meant to run where it
was routed. Found later in the engine's waiting queue, it is one of:

* *preempted*: a snapshot showed it running, and the engine put it back in its queue (the
  paper's rule aborts these);
* *refused*: routed into room, never shown running, and the instance has no room left for it
  — it filled after the snapshot the trajectory was routed against, or will fill: the room
  counted is half the router's KV limit (``route_kv_limit``) less what the instance holds,
  because the trajectories it runs are on average halfway through their responses and will
  about double what they hold. Counted in route order over the queue, since the engine admits
  its queue in order. Work sent back before its prefill costs the engine nothing, and on an
  instance that is filling the router places it better than the engine's queue would;
* *waiting for its prefill*: routed into room, never shown running, and the instance still has
  that room for it. The engine prefills under a token budget a step, so a burst of routes
  (after a sync, say) waits a few steps for its turn; it stays.

Work routed to an instance the router knew was full is not meant to run there yet: the engine
queues it as intended, and it stays too. State: per instance, trajectory id → the KV tokens it
needs to be admitted (its context when routed), or :data:`SEEN_RUNNING`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rollout_coordinator._config import CoordinatorConfig
from rollout_coordinator._records import InstanceSnapshot, running_ids
from rollout_coordinator._speculative import InstanceState

#: a trajectory a snapshot showed running (preempted if it waits later)
SEEN_RUNNING = -1


class MeantToRun:
    """The per-instance record (see the module docstring)."""

    def __init__(self) -> None:
        self._by: dict[str, dict[str, int]] = {}

    def reset(self, instance_id: str) -> None:
        """The instance is new, or syncs (its work is interrupted): nothing meant there."""
        self._by[instance_id] = {}

    def remove(self, instance_id: str) -> None:
        self._by.pop(instance_id, None)

    def routed_into_room(self, instance_id: str, trajectory_id: str, tokens: int) -> None:
        self._by[instance_id][trajectory_id] = tokens

    def note_running(self, snap: InstanceSnapshot, routed: Mapping[str, Any]) -> None:
        """Routed trajectories the snapshot shows running."""
        seen = filter(routed.__contains__, running_ids(snap.running))
        self._by[snap.instance_id].update(dict.fromkeys(seen, SEEN_RUNNING))

    def forget(self, instance_id: str, trajectory_id: str) -> None:
        meant = self._by.get(instance_id)
        if meant:
            meant.pop(trajectory_id, None)

    def out_of_place(
        self, inst: InstanceState, routed: Iterable[str], config: CoordinatorConfig
    ) -> tuple[str, ...]:
        """The trajectories of ``routed`` (the instance's routes, oldest first) in its engine's
        waiting queue that were preempted or refused; empty while it syncs."""
        meant = self._by.get(inst.instance_id)
        if not meant or inst.syncing:
            return ()
        running = set(inst.running_ids())
        room = config.route_kv_limit * inst.kv_capacity / 2 - inst.kv_used  # see the docstring
        out: list[str] = []
        for t in routed:
            need = meant.get(t)
            if need is None or t in running:
                continue
            if need != SEEN_RUNNING and need <= room:
                room -= need  # waiting for its prefill
                continue
            out.append(t)
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "meant_to_run": {
                iid: ids
                for iid, r in self._by.items()
                if (ids := sorted(t for t, need in r.items() if need == SEEN_RUNNING))
            },
            "routed_into_room": {
                iid: pairs
                for iid, r in self._by.items()
                if (pairs := sorted([t, need] for t, need in r.items() if need != SEEN_RUNNING))
            },
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], instance_ids: Iterable[str]) -> MeantToRun:
        """From :meth:`to_dict`'s keys of a coordinator state (a state written before
        ``routed_into_room`` was kept lists those trajectories as seen running)."""
        out = cls()
        for iid in instance_ids:
            out.reset(iid)
        for iid, ids in d.get("meant_to_run", {}).items():
            out._by.setdefault(str(iid), {}).update((str(t), SEEN_RUNNING) for t in ids)
        for iid, pairs in d.get("routed_into_room", {}).items():
            out._by.setdefault(str(iid), {}).update((str(t), int(n)) for t, n in pairs)
        return out
