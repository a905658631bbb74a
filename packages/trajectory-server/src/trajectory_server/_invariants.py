"""The trajectory store's consistency check: every trajectory in exactly one place (sans-IO).

:meth:`TrajectoryStore.check_invariants` delegates here; tests call it after every operation
and :func:`~trajectory_server._state.store_from_dict` after rebuilding a store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trajectory_server._queue import FRESH, PROMOTED
from trajectory_server._records import LocationState
from trajectory_server._state import routed_groups

if TYPE_CHECKING:
    from trajectory_server._core import TrajectoryStore


def check_store(store: TrajectoryStore) -> None:
    """Raise AssertionError unless every trajectory is in exactly one consistent place."""
    places: dict[str, str] = {}

    def put(tid: str, place: str) -> None:
        assert tid not in places, f"{tid} is both {places[tid]} and {place}"
        places[tid] = place

    for tid in store._queue.key_of:
        put(tid, "queued")
    for inst, held in store._running.items():
        for tid in held:
            put(tid, f"running:{inst}")
    for tid in store._finished:
        put(tid, "finished")
    for tid in store._released:
        put(tid, "released")
    for tid, where in store._where.items():
        if where.state is LocationState.DROPPED:
            put(tid, "dropped")
    assert set(places) == set(store._where), "a trajectory vanished or appeared"
    for tid, place in places.items():
        where = store._where[tid]
        expect = {
            "queued": LocationState.QUEUED,
            "finished": LocationState.FINISHED,
            "released": LocationState.FINISHED,
            "dropped": LocationState.DROPPED,
        }.get(place, LocationState.RUNNING)
        assert where.state is expect, f"{tid}: ledger {where.state} but held as {place}"
        if place.startswith("running:"):
            assert where.instance_id == place.split(":", 1)[1]
        has_payload = place in ("queued", "finished") or place.startswith("running:")
        assert (tid in store._payload) == has_payload, f"{tid}: payload presence wrong"
    assert store._routed_groups == routed_groups(store), "routed groups out of sync"
    for tid, (level, key) in store._queue.key_of.items():
        t = store._payload[tid]
        if level is None:
            rank = PROMOTED if t.group_id in store._routed_groups else FRESH
        else:
            rank = -t.generated_len
        assert level == t.v_traj and key[0] == rank, f"{tid}: stale queue key"
        assert level is not None or not t.generated_len, f"{tid}: unversioned with output"
    order = store._queue.order()
    assert order == sorted(v for v in order if v is not None) + ([None] if None in order else [])
    for bucket in store._queue.levels.values():
        assert bucket and bucket == sorted(bucket)
    members = [tid for ids in store._groups.values() for tid in ids]
    assert sorted(members) == sorted(store._where), "group membership out of sync"
    for tid, t in store._payload.items():
        assert tid in store._groups.get(t.group_id, ()), f"{tid}: not a member of its group"
    queued = sum(len(bucket) for bucket in store._queue.levels.values())
    assert queued == len(store._queue.key_of), "a trajectory is queued twice"
