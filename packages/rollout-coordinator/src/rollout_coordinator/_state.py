"""A coordinator's whole state as plain data: checkpoints and write-ahead journals.

:func:`coordinator_to_dict` captures everything a :class:`Coordinator` decides by besides its
config and protocol (the speculative instance states, routes held for syncs, reserved-but-
unrouted trajectories, admission counters and gate); :func:`coordinator_from_dict` rebuilds an
equivalent coordinator over a restored protocol, so a replayed event sequence gives the same
commands as the original.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from rollout_coordinator._commands import Route
from rollout_coordinator._config import CoordinatorConfig
from rollout_coordinator._cycle import Coordinator
from rollout_coordinator._meant import MeantToRun
from rollout_coordinator._records import RunningEntry
from rollout_coordinator._speculative import InstanceState
from rollout_coordinator.policies import GateState
from staleness_protocol import StalenessProtocol

FORMAT = "rollout-coordinator/1"


def _f(x: float) -> float | None:
    return None if math.isinf(x) else x


def _unf(x: float | None) -> float:
    return -math.inf if x is None else float(x)


def _entry(e: RunningEntry) -> list[Any]:
    return [e.trajectory_id, e.prompt_tokens, e.generated_tokens, e.v_traj]


def _unentry(d: list[Any]) -> RunningEntry:
    return RunningEntry(
        trajectory_id=str(d[0]),
        prompt_tokens=int(d[1]),
        generated_tokens=int(d[2]),
        v_traj=None if d[3] is None else int(d[3]),
    )


def _route(r: Route) -> dict[str, Any]:
    return {"trajectory_id": r.trajectory_id, "instance_id": r.instance_id, "version": r.version,
            "group_id": r.group_id, "new": r.new, "reserved_buffer": r.reserved_buffer,
            "tokens": r.tokens}  # fmt: skip


def _instance(s: InstanceState) -> dict[str, Any]:
    return {
        "instance_id": s.instance_id,
        "version": s.version,
        "target_version": s.target_version,
        "syncing": s.syncing,
        "base_running": [_entry(e) for e in s._base_running],
        "added": [[t, p, g, v] for t, (p, g, v) in s._added.items()],
        "removed": sorted(s._removed),
        "n_running": s.n_running,
        "kv_used": s.kv_used,
        "kv_capacity": s.kv_capacity,
        "waiting": s.waiting,
        "throughput": s.throughput,
        "last_seq": s.last_seq,
        "last_snapshot_time": _f(s.last_snapshot_time),
        "last_local_update": _f(s.last_local_update),
        "seen_snapshot": s.seen_snapshot,
    }


def _uninstance(d: Mapping[str, Any]) -> InstanceState:
    s = InstanceState(str(d["instance_id"]), int(d["version"]), int(d["kv_capacity"]))
    s.target_version = int(d["target_version"])
    s.syncing = bool(d["syncing"])
    s._base_running = tuple(_unentry(e) for e in d["base_running"])
    s._added = {
        str(e[0]): (int(e[1]), int(e[2]), None if e[3] is None else int(e[3])) for e in d["added"]
    }
    s._removed = {str(t) for t in d["removed"]}
    s.n_running = int(d["n_running"])
    s.kv_used = int(d["kv_used"])
    s.waiting = int(d["waiting"])
    s.throughput = float(d["throughput"])
    s.last_seq = int(d["last_seq"])
    s.last_snapshot_time = _unf(d["last_snapshot_time"])
    s.last_local_update = _unf(d["last_local_update"])
    s.seen_snapshot = bool(d["seen_snapshot"])
    return s


def coordinator_to_dict(c: Coordinator) -> dict[str, Any]:
    """The coordinator's state, JSON-plain (its config and protocol are saved elsewhere)."""
    return {
        "format": FORMAT,
        "gate": attrs.asdict(c._gate),
        "aborted_since": [c._aborted_since, c._dropped_since],
        "admitted_total": c._admitted_total,
        "lost_total": c._lost_total,
        "known_groups": sorted(c._known_groups),
        "routed": {iid: [[t, v, w] for t, (v, w) in m.items()] for iid, m in c._routed.items()},
        **c._meant.to_dict(),
        "orphans": dict(c._orphans),
        "released": [_route(r) for r in c._released],
        "held": {iid: [_route(r) for r in rs] for iid, rs in c.pending._held.items()},
        "instances": [_instance(s) for s in c.state.instances.values()],
        "silent": sorted(c._silent),
    }


def coordinator_from_dict(
    d: Mapping[str, Any],
    config: CoordinatorConfig,
    protocol: StalenessProtocol,
    clock: Callable[[], float],
) -> Coordinator:
    """A coordinator in the state ``d`` describes, over ``protocol`` (restored separately)."""
    if d.get("format") != FORMAT:
        raise ValueError(f"coordinator state format {d.get('format')!r}, expected {FORMAT!r}")
    c = Coordinator(config, protocol, clock)
    c._gate = GateState(**{k: int(v) for k, v in d["gate"].items()})
    c._aborted_since, c._dropped_since = (int(x) for x in d["aborted_since"])
    c._admitted_total = int(d["admitted_total"])
    c._lost_total = int(d["lost_total"])
    c._known_groups = {str(g) for g in d["known_groups"]}
    for s in (_uninstance(x) for x in d["instances"]):
        c.state.instances[s.instance_id] = s
    c._routed = {
        str(iid): {str(t): (int(v), float(w)) for t, v, w in m} for iid, m in d["routed"].items()
    }
    c._where = {t: iid for iid, m in c._routed.items() for t in m}
    c._meant = MeantToRun.from_dict(d, c._routed)
    c._orphans = {str(t): int(v) for t, v in d["orphans"].items()}
    c._released = [Route(**r) for r in d["released"]]
    c.pending._held = {str(iid): [Route(**r) for r in rs] for iid, rs in d["held"].items()}
    c._silent = {str(i) for i in d.get("silent", ())}  # absent: saved before it was kept
    return c
