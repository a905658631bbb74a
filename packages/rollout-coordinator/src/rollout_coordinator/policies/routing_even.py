"""Vanilla routing: even split by trajectory count (the baselines' and the ablation's router).

Each trajectory goes to the candidate instance (version after sync ≥ V_traj; new
trajectories: above the abort floor and admitted by the protocol) with the fewest trajectories
(running + engine-waiting), ties by instance id. No KV-room or cost check: like verl's chunked
dispatch and AReaL/ROLL's least-requests client, the request is handed to the engine, whose
own scheduler queues it if it cannot run now. Bounded by ``max_routes_per_cycle``.

When the queue runs out of work the router can place (no route cap or quota stopped it), the
eligible instances that got nothing this cycle, have no engine waiting queue and KV usage
below ``route_kv_limit`` are reported *hungry*: the queue holds no admissible work for them,
so migration (where the policy has it) may move work to them.
"""

from __future__ import annotations

import bisect
import heapq

from rollout_coordinator._commands import Route
from rollout_coordinator.policies._base import (
    AdmissionPort,
    CycleView,
    RoutingResult,
    eligible,
    reads,
)


@reads("max_routes_per_cycle", "route_kv_limit")
def route_evenly(view: CycleView, port: AdmissionPort, quota: int | None) -> RoutingResult:
    cfg = view.config
    floor = view.abort_floor
    heaps: dict[int, list[tuple[int, str]]] = {}
    for iid, inst in view.instances.items():
        if eligible(inst, floor):
            heaps.setdefault(inst.target_version, []).append((inst.n_running + inst.waiting, iid))
    for h in heaps.values():
        heapq.heapify(h)
    versions = sorted(heaps)
    routes: list[Route] = []
    new_admitted = 0
    max_routes = cfg.max_routes_per_cycle
    # Set once every candidate version of new work refuses fresh groups: from then on new
    # trajectories of fresh groups are passed over a group at a time without asking (refusals
    # last until the cycle ends, and a fresh group cannot be admitted meanwhile).
    fresh_refused = False
    admitted = port.admitted_groups
    items = view.queue.items
    run_end = view.queue.group_run_end
    n_items = len(items)
    i = 0
    stopped_early = False
    while i < n_items:
        item = items[i]
        i += 1
        if not versions or len(routes) >= max_routes:
            stopped_early = bool(versions)
            break
        is_new = item.v_traj is None
        if is_new and quota is not None and new_admitted >= quota:
            stopped_early = True
            break
        if fresh_refused and is_new and item.group_id not in admitted:
            # a fresh group's run at a time (new work comes last: the rest of a run is new)
            while i < n_items and items[i].v_traj is None and items[i].group_id not in admitted:
                i = run_end(i)
            continue
        start = bisect.bisect_left(versions, floor + 1 if item.v_traj is None else item.v_traj)
        best: tuple[int, str] | None = None
        best_v = -1
        for v in versions[start:]:
            top = heaps[v][0]
            if best is not None and top >= best:
                continue
            if is_new:
                if not port.admissible(item.group_id, v):
                    continue
            elif not port.can_resume(item, v):
                continue
            best, best_v = top, v
        if best is None:
            if is_new and item.group_id not in admitted:
                fresh_refused = all(port.refuses_fresh(v) for v in versions[start:])
            continue
        buffer: int | None = None
        if is_new:
            buffer = port.admit(item, best_v)
            if buffer is None:
                continue
            new_admitted += 1
        heapq.heapreplace(heaps[best_v], (best[0] + 1, best[1]))
        version = best_v if item.v_traj is None else item.v_traj
        tokens = item.prompt_len + item.generated_len
        # (trajectory_id, instance_id, version, group_id, new, reserved_buffer, tokens)
        routes.append(
            Route(item.trajectory_id, best[1], version, item.group_id, is_new, buffer, tokens)
        )
    hungry: frozenset[str] = frozenset()
    if not stopped_early:
        got = {r.instance_id for r in routes}
        limit = cfg.route_kv_limit
        hungry = frozenset(
            iid
            for iid, inst in view.instances.items()
            if iid not in got
            and eligible(inst, floor)
            and not inst.syncing
            and inst.waiting == 0
            and inst.kv_used < limit * inst.kv_capacity
        )
    return RoutingResult(routes=routes, hungry=hungry, new_admitted=new_admitted)
