"""StaleFlow routing: cost-model marginal gain over version groups, θ acceptance.

Theory of operation
-------------------
Serve the queue in its multi-level order (oldest V_traj first, new prompts last). For each
trajectory, candidates are instances whose version after sync is ≥ V_traj (new trajectories:
> abort floor, and the protocol admits the group at that version). Within a version group, only
instances that can run the trajectory *now* — no engine waiting queue, KV usage after adding it
≤ ``route_kv_limit``, fewer than ``route_max_concurrency`` running — compete, and the one with
the largest marginal throughput gain ``T(n+1, kv+len) − T(n, kv)`` wins, if that gain is ≥ θ ×
an empty instance's gain ``T(1, len)``. An instance whose best gain falls below θ (or that
reached the concurrency cap) is saturated and leaves the group for the rest of the cycle.

Which version group is tried first:

* new trajectories, ``candidate_order="oldest"``: smaller versions first (they are the ones
  that can still serve old work; fresh instances stay free for fresh work);
* new trajectories, ``candidate_order="reserve"``: the version whose latest reservable buffer
  is latest first. A fresh group at version ``v`` reserves the latest buffer in
  ``[c, v + η]`` with a free slot, so a newer version can reach every buffer an older one can
  and more: the order is newest admissible version first. The group gets the loosest deadline
  the protocol allows, and old instances are left to drain and sync;
* partials, ``partial_order="version"``: smallest version first, as for new ones;
* partials, ``partial_order="gain"``: every version group that can serve it competes and the
  best gain wins — no version is preferred, so old partials do not pile up on the few
  instances still at an old version.

Cost: one max-heap per version group, keyed by the gain at a reference length (the queue
head's length; the k1·len term is tiny next to the others, so the ranking barely depends on
it); the θ test and the KV check use the exact length. Each route is O(log instances); each
instance saturates at most once per cycle; the scan stops after ``route_miss_limit``
consecutive trajectories that found nothing, or at ``max_routes_per_cycle``.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable

from rollout_coordinator._commands import Route
from rollout_coordinator.policies._base import AdmissionPort, CycleView, RoutingResult, eligible

_ROOM_TRIES = 4  # instances tried per version group when the best lacks KV room


def route_by_marginal_gain(
    view: CycleView, port: AdmissionPort, quota: int | None
) -> RoutingResult:
    cfg = view.config
    cm = cfg.cost_model
    k1, k2, k3, k4, b = cm.k1, cm.k2, cm.k3, cm.k4, cm.b
    theta = cfg.theta
    kv_limit = cfg.route_kv_limit
    max_n = cfg.route_max_concurrency or 1 << 62
    newest_first = cfg.candidate_order == "reserve"
    partials_by_gain = cfg.partial_order == "gain"
    floor = view.abort_floor
    items = view.queue.items
    if items:
        ref_len = items[0].prompt_len + items[0].generated_len
    else:  # nothing to route; rank (for the hungry set) at the mean running trajectory size
        n_all = sum(i.n_running for i in view.instances.values())
        ref_len = sum(i.kv_used for i in view.instances.values()) // n_all if n_all else 1

    def gain(n: int, kv: float, length: int) -> float:
        # max(k2, x) written out: this runs a few times per instance and per route, and the
        # builtin call was most of its cost
        x = b + k3 * (n + 1)
        after = (n + 1) / (k4 + k1 * (kv + length) + (x if x > k2 else k2))
        if n <= 0:
            return after
        x = b + k3 * n
        return after - n / (k4 + k1 * kv + (x if x > k2 else k2))

    # local copies: [n, kv, cap]; heaps per version of (-gain_ref, iid)
    local: dict[str, list[int]] = {}
    heaps: dict[int, list[tuple[float, str]]] = {}
    for iid, inst in view.instances.items():
        if not eligible(inst, floor) or inst.waiting > 0:
            continue
        local[iid] = [inst.n_running, inst.kv_used, inst.kv_capacity]
        heaps.setdefault(inst.target_version, []).append(
            (-gain(inst.n_running, inst.kv_used, ref_len), iid)
        )
    for h in heaps.values():
        heapq.heapify(h)
    versions = sorted(heaps)
    version_of = {iid: view.instances[iid].target_version for iid in local}

    routes: list[Route] = []
    max_routes = cfg.max_routes_per_cycle
    miss_limit = cfg.route_miss_limit
    misses = 0
    new_admitted = 0
    stopped_early = False
    live = len(local)

    def pick(h: list[tuple[float, str]], length: int) -> str | None:
        """Best instance in one version group with room and gain ≥ θ; saturated ones leave."""
        nonlocal live
        skipped: list[tuple[float, str]] = []
        chosen: str | None = None
        threshold = theta / (k4 + k1 * length + max(k2, b + k3))
        while h and len(skipped) < _ROOM_TRIES:
            top = h[0]
            n, kv, cap = local[top[1]]
            if n >= max_n or gain(n, kv, length) < threshold:
                heapq.heappop(h)  # saturated: no trajectory of this size is worth it
                live -= 1
                continue
            if kv + length > kv_limit * cap:
                skipped.append(heapq.heappop(h))
                continue
            chosen = top[1]
            heapq.heappop(h)
            break
        for s in skipped:
            heapq.heappush(h, s)
        return chosen

    for item in items:
        if live <= 0:
            break
        if len(routes) >= max_routes:
            stopped_early = True
            break
        v_traj = item.v_traj
        is_new = v_traj is None
        if is_new and quota is not None and new_admitted >= quota:
            break  # new prompts are last in the queue: nothing else to route
        length = item.prompt_len + item.generated_len
        start = bisect.bisect_left(versions, floor + 1 if v_traj is None else v_traj)
        candidates = versions[start:]
        if is_new and newest_first:
            candidates = candidates[::-1]
        routed = False
        resumable_checked = False
        if not is_new and partials_by_gain and candidates:
            if not port.can_resume(item, candidates[0]):
                candidates = []  # aborted or unknown to the protocol: never route it
            else:
                resumable_checked = True
                candidates = _best_group(candidates, heaps, pick, local, length, gain, ref_len)
        for v in candidates:
            h = heaps[v]
            if not h:
                continue
            if is_new:
                if not port.admissible(item.group_id, v):
                    continue
            elif not resumable_checked:
                if not port.can_resume(item, v):
                    break  # aborted or unknown to the protocol: never route it
                resumable_checked = True
            picked = pick(h, length)
            if picked is None:
                continue
            iid = picked
            buffer: int | None = None
            if is_new:
                buffer = port.admit(item, v)
                if buffer is None:
                    n_run, kv = local[iid][:2]
                    heapq.heappush(h, (-gain(n_run, kv, ref_len), iid))
                    continue
                new_admitted += 1
            st = local[iid]
            st[0] += 1
            st[1] += length
            heapq.heappush(h, (-gain(st[0], st[1], ref_len), iid))
            routes.append(
                Route(
                    trajectory_id=item.trajectory_id,
                    instance_id=iid,
                    version=version_of[iid] if is_new else v_traj,  # type: ignore[arg-type]
                    group_id=item.group_id,
                    new=is_new,
                    reserved_buffer=buffer,
                    tokens=length,
                )
            )
            routed = True
            break
        if routed:
            misses = 0
        else:
            misses += 1
            if misses >= miss_limit:
                stopped_early = True
                break
    hungry: frozenset[str] = frozenset()
    if not stopped_early:
        threshold = theta * cm.empty_gain(ref_len)
        hungry = frozenset(
            iid
            for h in heaps.values()
            for _, iid in h
            if local[iid][1] + ref_len <= kv_limit * local[iid][2]
            and gain(local[iid][0], local[iid][1], ref_len) >= threshold
        )
    return RoutingResult(routes=routes, hungry=hungry, new_admitted=new_admitted)


def _best_group(
    candidates: list[int],
    heaps: dict[int, list[tuple[float, str]]],
    pick: Callable[[list[tuple[float, str]], int], str | None],
    local: dict[str, list[int]],
    length: int,
    gain: Callable[[int, float, int], float],
    ref_len: int,
) -> list[int]:
    """The one version group whose best acceptable instance has the largest gain ([] if none).

    Each group's pick is put back (with its ranking key), so the caller's own pick in the
    chosen group finds the same instance.
    """
    best: tuple[float, int] | None = None
    for v in candidates:
        h = heaps[v]
        if not h:
            continue
        iid = pick(h, length)
        if iid is None:
            continue
        n, kv = local[iid][0], local[iid][1]
        heapq.heappush(h, (-gain(n, kv, ref_len), iid))
        g = gain(n, kv, length)
        if best is None or g > best[0]:
            best = (g, v)
    return [] if best is None else [best[1]]
