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

Every instance is ranked every cycle and most of them leave their group saturated, so the
per-instance work is kept small: the ranking keys, and the hungry set at the end, are computed
at once with numpy over columns of the instances' counters, and each instance carries the two
parts of its gain that do not depend on the trajectory's length (``T(n, kv)`` and the batch
term at ``n + 1``), recomputed only when a route changes it. Every value is the scalar
formula's, with the same floating-point operations in the same order, so each decision is the
one a per-instance loop over ``CostModel.marginal_gain``'s formula makes. Heap entries are
``(-gain_ref, instance_id, position)``; instance ids are unique, so the position (into the
counter lists) never decides an order.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from heapq import heapify, heappop, heappush, heapreplace
from itertools import chain
from operator import attrgetter

import numpy as np
import numpy.typing as npt

from rollout_coordinator._commands import Route
from rollout_coordinator.cost_model import CostModel
from rollout_coordinator.policies._base import AdmissionPort, CycleView, RoutingResult

_ROOM_TRIES = 4  # instances tried per version group when the best lacks KV room
_COUNTERS = attrgetter("target_version", "waiting", "n_running", "kv_used", "kv_capacity")

Entry = tuple[float, str, int]  # (-gain at the reference length, instance id, position)
Ints = npt.NDArray[np.int64]
Floats = npt.NDArray[np.float64]


def _batch_term(n: Ints, k2: float, k3: float, b: float) -> Floats:
    """``max(k2, b + k3·n)`` per element."""
    x = b + k3 * n
    return np.where(x > k2, x, k2)


def gain_terms(n: Ints, kv: Ints, cm: CostModel) -> tuple[Floats, Floats]:
    """Per instance, the parts of the marginal gain that do not depend on the trajectory's
    length: the batch term at ``n + 1`` (``x1``) and ``T(n, kv)`` (``t``, 0 when ``n = 0``).
    ``(n + 1) / (k4 + k1·(kv + length) + x1) − t`` is then ``cm.marginal_gain(n, kv, length)``
    exactly (the same operations in the same order)."""
    x1 = _batch_term(n + 1, cm.k2, cm.k3, cm.b)
    t = n / (cm.k4 + cm.k1 * kv + _batch_term(n, cm.k2, cm.k3, cm.b))
    return x1, t


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
    iids = list(view.instances)
    count = len(iids)
    cols = np.fromiter(
        chain.from_iterable(map(_COUNTERS, view.instances.values())), np.int64, 5 * count
    ).reshape(count, 5)
    tv, waiting, n_arr, kv_arr, cap_arr = cols.T
    if items:
        ref_len = items[0].prompt_len + items[0].generated_len
    else:  # nothing to route; rank (for the hungry set) at the mean running trajectory size
        n_all = int(n_arr.sum())
        ref_len = int(kv_arr.sum()) // n_all if n_all else 1

    # Per position: the counters (plain ints, updated as routes are placed), the batch term at
    # n + 1 and T(n, kv) (0 when nothing runs). The gain of a trajectory of ``length`` tokens
    # is then (n + 1) / (k4 + k1·(kv + length) + x1) − t: the scalar formula's value exactly.
    n_l: list[int] = n_arr.tolist()
    kv_l: list[int] = kv_arr.tolist()
    cap_l: list[int] = cap_arr.tolist()
    tv_l: list[int] = tv.tolist()
    x1_arr, t_arr = gain_terms(n_arr, kv_arr, cm)
    x1_l: list[float] = x1_arr.tolist()
    t_l: list[float] = t_arr.tolist()

    def gain_at(p: int, length: int) -> float:
        return (n_l[p] + 1) / (k4 + k1 * (kv_l[p] + length) + x1_l[p]) - t_l[p]

    # heaps per version of (-gain_ref, iid, position) over the eligible instances without an
    # engine waiting queue
    pos = np.flatnonzero((tv > floor) & (waiting <= 0))
    key_arr = t_arr[pos] - (n_arr[pos] + 1) / (k4 + k1 * (kv_arr[pos] + ref_len) + x1_arr[pos])
    pos_l: list[int] = pos.tolist()
    entries = list(zip(key_arr.tolist(), [iids[p] for p in pos_l], pos_l, strict=True))
    heaps: dict[int, list[Entry]] = {}
    if entries:
        tv_pos = tv[pos]
        lo, hi = int(tv_pos.min()), int(tv_pos.max())
        if lo == hi:
            heaps[lo] = entries
        else:
            for e, v in zip(entries, tv_pos.tolist(), strict=True):
                h = heaps.get(v)
                if h is None:
                    heaps[v] = h = []
                h.append(e)
    for h in heaps.values():
        heapify(h)
    versions = sorted(heaps)

    routes: list[Route] = []
    max_routes = cfg.max_routes_per_cycle
    miss_limit = cfg.route_miss_limit
    misses = 0
    new_admitted = 0
    stopped_early = False
    live = len(entries)
    batch_one = max(k2, b + k3)  # the batch term of T(1, ·)

    def pick(h: list[Entry], length: int) -> Entry | None:
        """Best instance in one version group with room and gain ≥ θ; saturated ones leave
        the group. The pick stays at the top of the heap, unless instances before it lacked
        KV room: then it is popped and they go back (``h[0] is pick`` tells which)."""
        nonlocal live
        skipped: list[Entry] = []
        threshold = theta / (k4 + k1 * length + batch_one)
        while h:
            top = h[0]
            p = top[2]
            n = n_l[p]
            kv = kv_l[p]
            if n >= max_n or (n + 1) / (k4 + k1 * (kv + length) + x1_l[p]) - t_l[p] < threshold:
                heappop(h)  # saturated: no trajectory of this size is worth it
                live -= 1
                continue
            chosen: Entry | None = top
            if kv + length > kv_limit * cap_l[p]:
                skipped.append(heappop(h))
                if len(skipped) < _ROOM_TRIES:
                    continue
                chosen = None  # tried enough instances without room
            elif skipped:
                heappop(h)
            for s in skipped:
                heappush(h, s)
            return chosen
        for s in skipped:
            heappush(h, s)
        return None

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
                candidates = _best_group(candidates, heaps, pick, gain_at, length)
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
            buffer: int | None = None
            if is_new:
                buffer = port.admit(item, v)
                if buffer is None:
                    if not h or h[0] is not picked:
                        heappush(h, picked)  # its counters did not change: the same key
                    continue
                new_admitted += 1
            p = picked[2]
            n = n_l[p] = n_l[p] + 1
            kv = kv_l[p] = kv_l[p] + length
            x0 = x1_l[p]  # the batch term at the new n
            x = b + k3 * (n + 1)
            x1 = x1_l[p] = x if x > k2 else k2
            t = t_l[p] = n / (k4 + k1 * kv + x0)
            entry = (t - (n + 1) / (k4 + k1 * (kv + ref_len) + x1), picked[1], p)
            if h and h[0] is picked:
                heapreplace(h, entry)
            else:
                heappush(h, entry)
            routes.append(
                Route(
                    trajectory_id=item.trajectory_id,
                    instance_id=picked[1],
                    version=tv_l[p] if is_new else v_traj,  # type: ignore[arg-type]
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
        left = [e[2] for h in heaps.values() for e in h]
        if left:
            at = np.array(left, dtype=np.int64)
            n_left = np.array(n_l, dtype=np.int64)[at]
            kv_left = np.array(kv_l, dtype=np.int64)[at]
            room = kv_left + ref_len <= kv_limit * cap_arr[at]
            g = (n_left + 1) / (k4 + k1 * (kv_left + ref_len) + np.array(x1_l)[at]) - np.array(t_l)[
                at
            ]
            worth = g >= theta * cm.empty_gain(ref_len)
            hungry = frozenset(iids[p] for p in at[room & worth].tolist())
    return RoutingResult(routes=routes, hungry=hungry, new_admitted=new_admitted)


def _best_group(
    candidates: list[int],
    heaps: dict[int, list[Entry]],
    pick: Callable[[list[Entry], int], Entry | None],
    gain_at: Callable[[int, int], float],
    length: int,
) -> list[int]:
    """The one version group whose best acceptable instance has the largest gain ([] if none).
    Picks stay in their heaps, so the caller's own pick in the chosen group finds the same
    instance."""
    best: tuple[float, int] | None = None
    for v in candidates:
        h = heaps[v]
        if not h:
            continue
        picked = pick(h, length)
        if picked is None:
            continue
        if not h or h[0] is not picked:
            heappush(h, picked)
        g = gain_at(picked[2], length)
        if best is None or g > best[0]:
            best = (g, v)
    return [] if best is None else [best[1]]
