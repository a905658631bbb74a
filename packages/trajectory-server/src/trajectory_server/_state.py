"""The trajectory store as plain data, and back (the checkpoint state; sans-IO).

:meth:`TrajectoryStore.to_dict` / :meth:`TrajectoryStore.from_dict` delegate here. The state
is JSON-able unless written ``binary`` (arrays as raw bytes, for msgpack checkpoints).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from trajectory_server import _plain
from trajectory_server._records import EventKind, finish_reason
from trajectory_server.errors import CheckpointCorrupt, TrajectoryServerError

if TYPE_CHECKING:
    from trajectory_server._core import TrajectoryStore

STATE_FORMAT = "staleflow.trajectory-store/1"


def store_to_dict(store: TrajectoryStore, *, binary: bool = False) -> dict[str, Any]:
    """The whole store as plain data; JSON-able unless ``binary`` (arrays as raw bytes)."""
    queued = {tid: key[1] for tid, (_lv, key) in store._queue.key_of.items()}
    return {
        "format": STATE_FORMAT,
        "event_seq": store._event_seq,
        "enqueue_seq": store._enqueue_seq,
        "payloads": [_plain.trajectory_to_plain(t, binary) for t in store._payload.values()],
        "locations": {tid: _plain.location_to_plain(w) for tid, w in store._where.items()},
        "queue": [[tid, queued[tid]] for tid in store._queue.iter()],
        "running": {inst: list(held) for inst, held in store._running.items() if held},
        "finished": [
            [tid, reason.value, store._finished_by[tid]] for tid, reason in store._finished.items()
        ],
        "released": sorted(store._released),
        "groups": {g: list(ids) for g, ids in store._groups.items()},
        "history": {
            tid: [_plain.event_to_plain(e) for e in events]
            for tid, events in store._history.items()
        },
    }


def store_from_dict(cls: type[TrajectoryStore], state: Mapping[str, Any]) -> TrajectoryStore:
    """Rebuild a store of class ``cls`` from :func:`store_to_dict` output; inconsistent state
    raises :class:`~trajectory_server.errors.CheckpointCorrupt` naming the field."""
    try:
        store = _read_state(cls, state)
        store.check_invariants()
    except TrajectoryServerError as exc:
        raise CheckpointCorrupt(
            f"store state is invalid: {exc}", path=None, field=exc.context.get("field")
        ) from exc
    except (AssertionError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointCorrupt(f"store state is inconsistent: {exc!r}", path=None) from exc
    return store


def _read_state(cls: type[TrajectoryStore], state: Mapping[str, Any]) -> TrajectoryStore:
    r = _plain.Reader(dict(state), "state", CheckpointCorrupt)
    fmt = r.text("format")
    if fmt != STATE_FORMAT:
        r.fail("state.format", f"must be {STATE_FORMAT!r}, got {fmt!r:.60}")
    store = cls()
    store._event_seq = r.integer("event_seq")
    store._enqueue_seq = r.integer("enqueue_seq")
    for i, p in enumerate(r.items("payloads")):
        t = _plain.trajectory_from_plain(_plain.Reader(p, f"state.payloads[{i}]", r.error))
        store._payload[t.trajectory_id] = t
    for tid, loc in r.mapping("locations").items():
        store._where[tid] = _plain.location_from_plain(
            _plain.Reader(loc, f"state.locations.{tid}", r.error)
        )
    for inst, ids in r.mapping("running").items():
        store._running[inst] = dict.fromkeys(ids)
    for tid, reason, inst in r.items("finished"):
        store._finished[tid] = finish_reason(reason)
        store._finished_by[tid] = inst
    store._released = set(r.texts("released"))
    store._groups = {g: list(ids) for g, ids in r.mapping("groups").items()}
    for tid, events in r.mapping("history").items():
        store._history[tid] = [
            _plain.event_from_plain(_plain.Reader(e, f"state.history.{tid}", r.error))
            for e in events
        ]
    store._routed_groups = routed_groups(store)
    for tid, seq in r.items("queue"):
        t = store._payload[tid]
        promoted = t.v_traj is None and t.group_id in store._routed_groups
        store._queue.push(tid, t.v_traj, t.generated_len, seq, promoted)
    r.done()
    return store


def routed_groups(store: TrajectoryStore) -> set[str]:
    """The groups a member of which has been routed, from the trajectories' histories."""
    return {
        gid
        for gid, ids in store._groups.items()
        if any(e.kind is EventKind.ROUTED for tid in ids for e in store._history.get(tid, ()))
    }
