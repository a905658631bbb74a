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
reached the concurrency cap) is saturated and leaves the group for the rest of the cycle
(without ``due_first``; with it, see below).
With ``theta_slack`` set, an instance whose routed work all has slack in the η window (see
:func:`instance_thetas`) uses it instead of θ.

With ``due_placement="headroom"``, a *due* queued partial — its group reserved in the buffer
the trainer takes next (``AdmissionPort.due``) — goes, with or without ``due_first``, to the
instance with the lowest KV usage that can take it now, whatever its gain, in the first version
group (``partial_order="version"``) that has one, or over every version that can serve it
(``"gain"``): an engine whose KV fills preempts its newest work first, and a re-routed partial
is the newest wherever it lands.

With ``due_first``, a queued partial whose group is reserved in the buffer the trainer takes
next (``AdmissionPort.due``) skips the θ test: it goes where any partial of its version goes
(the version groups in ``partial_order``, each best first), to the first instance with KV
room, whatever its gain there. And an instance θ refuses for a trajectory of ``L`` tokens
leaves its group only for trajectories of ``L`` tokens or more: it rejoins (at its place in
the order) when a shorter one comes up. A longer trajectory has a lower gain (its context
slows every step of the instance) and a lower threshold (θ × an empty instance's gain falls
too, but more slowly for any instance whose KV holds less than about a million tokens), so a
refusal holds for longer trajectories and says nothing about shorter ones. Without the rule
one long trajectory refuses every loaded instance for the whole cycle: a long partial at the
head of the queue (where the oldest versions, and the work the trainer waits for, sit) stops
all routing, and one long prompt leaves every new prompt after it unrouted. An instance
refused ``_REFUSALS`` times in a cycle leaves for the cycle, so a queue whose lengths go up
and down costs a few passes over the instances, not one per trajectory.

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

Cost: each version group is a list sorted best first, keyed by the gain at a reference length
(the queue head's length; the k1·len term is tiny next to the others, so the ranking barely
depends on it); the θ test and the KV check use the exact length. A route moves its instance
to its new place in the list (a binary search); instances that saturate at the head of a
group leave it together (one slice deletion), and each instance saturates at most once per
cycle (``_REFUSALS`` times with ``due_first``), so most instances cost one gain evaluation and
no reordering. The scan stops after ``route_miss_limit`` consecutive trajectories that found
nothing, or at ``max_routes_per_cycle``. Once every candidate version of new work has no
instance left or refuses fresh groups (the port's cached refusal), a run of new trajectories
of fresh groups is counted as that many misses in one pass, without an admission check each.
Likewise a new trajectory that missed without changing anything (no instance left its group,
none was picked): the members of its group queued right behind it with the same length would
meet the same groups and the same cached admission answers, so they count as misses at once.

Every instance is ranked every cycle and most of them leave their group saturated, so the
per-instance work is kept small: the ranking keys, and the hungry set at the end, are computed
at once with numpy over columns of the instances' counters, and each instance carries the two
parts of its gain that do not depend on the trajectory's length (``T(n, kv)`` and the batch
term at ``n + 1``), recomputed only when a route changes it. Every value is the scalar
formula's, with the same floating-point operations in the same order, so each decision is the
one a per-instance loop over ``CostModel.marginal_gain``'s formula makes. Group entries are
``(-gain_ref, instance_id, position)`` in ascending order (the order a min-heap of them pops
in); instance ids are unique, so the position (into the counter lists) never decides an
order.
"""

from __future__ import annotations

import bisect
import heapq
import math
from bisect import bisect_left
from collections.abc import Callable, Sequence
from itertools import chain, islice, pairwise
from operator import attrgetter

import numpy as np
import numpy.typing as npt

from rollout_coordinator._commands import Route
from rollout_coordinator._records import QueuedTrajectory
from rollout_coordinator.cost_model import CostModel
from rollout_coordinator.policies._base import AdmissionPort, CycleView, RoutingResult, reads

#: due_first: after this many θ refusals in one cycle an instance leaves for the cycle (each
#: refusal for a longer trajectory than the next one brings it back: the bound keeps the cost
#: of a cycle at a few passes over the instances, whatever the order of lengths in the queue)
_REFUSALS = 4
_ROOM_TRIES = 4  # instances tried per version group when the best lacks KV room
_COUNTERS = attrgetter("target_version", "waiting", "n_running", "kv_used", "kv_capacity")

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


def instance_thetas(view: CycleView, iids: list[str]) -> list[float] | None:
    """Per instance (in ``iids`` order) the θ its routes must pass, or None when every
    instance uses ``theta``. With ``theta_slack``: an instance holding a trajectory routed at
    a V_traj ≤ the abort floor + ``theta_slack_batches`` — work that can only be trained in
    one of the batches the trainer needs next, whose wait every extra trajectory on that
    instance lengthens — keeps ``theta``, and so does an instance holding no routed work; any
    other instance (all its work can still land in a later buffer) uses ``theta_slack``. (This
    judges routed work by its version alone, which is all the coordinator keeps of it;
    ``due_first`` asks the protocol where a queued partial's group is reserved.)"""
    cfg = view.config
    slack = cfg.theta_slack
    if slack is None:
        return None
    theta = cfg.theta
    last_chance = view.abort_floor + cfg.theta_slack_batches
    oldest = view.oldest_routed
    return [theta if (v := oldest(iid)) is None or v <= last_chance else slack for iid in iids]


@reads(
    "theta",
    "theta_slack",
    "theta_slack_batches",
    "due_first",
    "due_placement",
    "route_kv_limit",
    "route_max_concurrency",
    "candidate_order",
    "partial_order",
    "max_routes_per_cycle",
    "route_miss_limit",
)
def route_by_marginal_gain(  # noqa: C901 - one pass over the queue: the per-instance counters
    # stay locals of this frame and its helpers are closures over them (a class, or helper calls per
    # queued trajectory cost the cycle budget at 64K queued; bench_coordinator measures it)
    view: CycleView,
    port: AdmissionPort,
    quota: int | None,
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
    th_l = instance_thetas(view, iids)
    x1_arr, t_arr = gain_terms(n_arr, kv_arr, cm)
    x1_l: list[float] = x1_arr.tolist()
    t_l: list[float] = t_arr.tolist()

    def gain_at(p: int, length: int) -> float:
        return (n_l[p] + 1) / (k4 + k1 * (kv_l[p] + length) + x1_l[p]) - t_l[p]

    # per version, the eligible instances without an engine waiting queue, best first
    pos = np.flatnonzero((tv > floor) & (waiting <= 0))
    if _no_room(items, kv_arr[pos], cap_arr[pos], kv_limit, cfg.route_miss_limit):
        return RoutingResult(routes=[], partials_oldest_first=not partials_by_gain)
    key_arr = t_arr[pos] - (n_arr[pos] + 1) / (k4 + k1 * (kv_arr[pos] + ref_len) + x1_arr[pos])
    groups = _version_groups(tv[pos], key_arr, pos, iids)
    versions = sorted(groups)

    routes: list[Route] = []
    max_routes = cfg.max_routes_per_cycle
    miss_limit = cfg.route_miss_limit
    misses = 0
    new_admitted = 0
    stopped_early = False
    live = len(pos)
    batch_one = max(k2, b + k3)  # the batch term of T(1, ·)
    run: list[int] = []  # the candidate versions for V_traj = run_v
    run_v: int | None = None
    # Set when every candidate version of new trajectories has no instance left (none to come
    # back: see ``refused``) or refuses fresh groups: from then on a new trajectory of a fresh
    # group misses without asking (such groups stay empty and refusals last until the cycle
    # ends), and a run of them is counted at once.
    fresh_refused = False
    admitted = port.admitted_groups
    refuses_fresh, admissible, is_due = port.refuses_fresh, port.admissible, port.due
    # due_first: the instances θ refused, as (-length refused, position): one rejoins its
    # version group for a shorter trajectory, unless θ has refused it _REFUSALS times this
    # cycle (then it leaves for the cycle, as every refused one does without due_first).
    # ``refused_at``: how many of them each version has.
    due_first = cfg.due_first
    headroom = cfg.due_placement == "headroom"
    due_rule = due_first or headroom
    refused: list[tuple[int, int]] = []
    refusals: dict[int, int] = {}
    refused_at: dict[int, int] = {}
    n_items = len(items)

    def pick(g: _Group, length: int, due: bool) -> int:
        """Index in the version group ``g`` of its best instance with room and gain ≥ θ (any
        gain when ``due``), or -1. Saturated instances met on the way leave the group (no
        trajectory of this size is worth it: with ``due_first`` until a shorter one, else for
        the cycle); those without KV room stay, and after ``_ROOM_TRIES`` of them the search
        gives up."""
        nonlocal live
        if due and headroom:
            return _most_headroom(g.members, length, n_l, kv_l, cap_l, max_n, kv_limit)
        den = k4 + k1 * length + batch_one
        threshold = -math.inf if due else theta / den
        members = g.members
        j = dead = skipped = 0
        chosen = -1
        while j < len(members):
            p = members[j]
            n = n_l[p]
            kv = kv_l[p]
            limit = threshold if th_l is None or due else th_l[p] / den
            if n >= max_n or (n + 1) / (k4 + k1 * (kv + length) + x1_l[p]) - t_l[p] < limit:
                live -= 1
                if due_first and n < max_n:
                    times = refusals[p] = refusals.get(p, 0) + 1
                    if times < _REFUSALS:
                        heapq.heappush(refused, (-length, p))
                        refused_at[tv_l[p]] = refused_at.get(tv_l[p], 0) + 1
                if skipped:
                    g.drop(j)  # behind one without room: it leaves on its own
                else:
                    dead += 1  # the saturated head of the group, removed at once below
                    j += 1
                continue
            if kv + length > kv_limit * cap_l[p]:
                skipped += 1
                j += 1
                if skipped < _ROOM_TRIES:
                    continue
                break  # tried enough instances without room
            chosen = j
            break
        if dead:
            g.drop_head(dead)
            if chosen >= 0:
                chosen -= dead
        return chosen

    def revive(length: int) -> None:
        """Instances θ refused only for trajectories longer than ``length`` rejoin their
        version groups (their counters have not changed: nothing is routed to them)."""
        nonlocal live
        while refused and -refused[0][0] > length:
            p = heapq.heappop(refused)[1]
            refused_at[tv_l[p]] -= 1
            groups[tv_l[p]].insert(-gain_at(p, ref_len), p, iids)  # its ranking key
            live += 1

    resume_at = 0  # the next item to try (runs of misses counted at once skip ahead)
    while resume_at < n_items:
        i = resume_at
        item = items[i]
        resume_at = i + 1
        if live <= 0 and not refused:
            break
        if len(routes) >= max_routes:
            stopped_early = True
            break
        v_traj = item.v_traj
        is_new = v_traj is None
        if is_new and quota is not None and new_admitted >= quota:
            break  # new prompts are last in the queue: nothing else to route
        if fresh_refused and is_new and item.group_id not in admitted:
            stop = min(n_items, i + miss_limit - misses)
            j = i + 1
            while j < stop and items[j].v_traj is None and items[j].group_id not in admitted:
                j += 1
            misses += j - i
            if misses >= miss_limit:
                stopped_early = True
                break
            if refused:  # as if each skipped one had been tried: who it would bring back
                revive(min(it.prompt_len + it.generated_len for it in items[i:j]))
            resume_at = j
            continue
        length = item.prompt_len + item.generated_len
        if refused and -refused[0][0] > length:  # (revive's own test: most items revive none)
            revive(length)
        due = due_rule and not is_new and is_due(item)
        if v_traj != run_v or not run:  # the queue comes in runs of one V_traj
            start = bisect.bisect_left(versions, floor + 1 if v_traj is None else v_traj)
            run = versions[start:]
            if is_new and newest_first:
                run.reverse()
            run_v = v_traj
        candidates = run
        routed = False
        resumable_checked = False
        if not is_new and partials_by_gain and candidates:
            if not port.can_resume(item, candidates[0]):
                candidates = []  # aborted or unknown to the protocol: never route it
            else:
                resumable_checked = True
                usage = _usage_of(kv_l, cap_l) if due and headroom else None
                candidates = _best_group(candidates, groups, pick, gain_at, length, due, usage)
        live_at, picked = live, False
        for v in candidates:
            g = groups[v]
            if not g.members:
                continue
            if is_new:
                if not admissible(item.group_id, v):
                    continue
            elif not resumable_checked:
                if not port.can_resume(item, v):
                    break  # aborted or unknown to the protocol: never route it
                resumable_checked = True
            at = pick(g, length, due)
            if at < 0:
                continue
            picked = True
            p = g.members[at]
            buffer: int | None = None
            if is_new:
                buffer = port.admit(item, v)
                if buffer is None:
                    continue  # its counters did not change: it keeps its place
                new_admitted += 1
            n = n_l[p] = n_l[p] + 1
            kv = kv_l[p] = kv_l[p] + length
            x0 = x1_l[p]  # the batch term at the new n
            x = b + k3 * (n + 1)
            x1 = x1_l[p] = x if x > k2 else k2
            t = t_l[p] = n / (k4 + k1 * kv + x0)
            g.move(at, t - (n + 1) / (k4 + k1 * (kv + ref_len) + x1), iids)
            # (trajectory_id, instance_id, version, group_id, new, reserved_buffer, tokens)
            version = tv_l[p] if v_traj is None else v_traj
            tid, gid = item.trajectory_id, item.group_id
            routes.append(Route(tid, iids[p], version, gid, is_new, buffer, length))
            routed = True
            break
        if routed:
            misses = 0
        else:
            if is_new and not fresh_refused and item.group_id not in admitted:
                for v in run:  # (a loop, not all(): this runs for most misses of new work)
                    if (groups[v].members or refused_at.get(v)) and not refuses_fresh(v):
                        break
                else:
                    fresh_refused = True
            misses += 1
            if misses >= miss_limit:
                stopped_early = True
                break
            if is_new and not fresh_refused and live == live_at and not picked:
                # It missed without changing anything (no instance left its group, none was
                # picked): the next members of its group, queued behind it with the same
                # length, meet the same groups and the same cached admission answers, and miss
                # the same way. Count them at once.
                j = _same_prompt_run(items, i + 1, miss_limit - misses, item.group_id, length)
                misses += j - i - 1
                if misses >= miss_limit:
                    stopped_early = True
                    break
                resume_at = j
    hungry: frozenset[str] = frozenset()
    if not stopped_early:
        left = [p for g in groups.values() for p in g.members]
        if left:
            idx = np.array(left, dtype=np.int64)
            n_left = np.array(n_l, dtype=np.int64)[idx]
            kv_left = np.array(kv_l, dtype=np.int64)[idx]
            room = kv_left + ref_len <= kv_limit * cap_arr[idx]
            gain = (n_left + 1) / (k4 + k1 * (kv_left + ref_len) + np.array(x1_l)[idx])
            th = theta if th_l is None else np.array(th_l)[idx]
            worth = gain - np.array(t_l)[idx] >= th * cm.empty_gain(ref_len)
            hungry = frozenset(iids[p] for p in idx[room & worth].tolist())
    return RoutingResult(
        routes=routes,
        hungry=hungry,
        new_admitted=new_admitted,
        partials_oldest_first=not partials_by_gain,
    )


def _no_room(
    items: Sequence[QueuedTrajectory], kv: Ints, cap: Ints, kv_limit: float, miss_limit: int
) -> bool:
    """Whether no eligible instance (KV use ``kv`` of ``cap``) has room under ``kv_limit`` for
    even the shortest of the trajectories the scan can reach: with nothing routed it stops
    after ``miss_limit`` misses, so it reaches the first ``miss_limit`` of ``items`` at most.
    Then the cycle routes nothing and, as no instance has room for the queue head either,
    leaves none hungry: :func:`route_by_marginal_gain` answers that at once instead of
    trying each trajectory on instances that cannot take it (the θ refusals such a scan
    meets change neither answer). False when nothing is queued."""
    if not items:
        return False
    if not len(kv):
        return True
    # The most room any instance has: ``kv + length <= kv_limit * cap`` holds for some instance
    # iff ``length <= room`` (the subtraction is exact: ``kv`` is an integer within ``cap`` of
    # ``kv_limit * cap``), so the scan stops at the first trajectory that fits.
    room = float((kv_limit * cap - kv).max())
    return not any(it.prompt_len + it.generated_len <= room for it in islice(items, miss_limit))


def _same_prompt_run(
    items: Sequence[QueuedTrajectory], start: int, most: int, group_id: str, length: int
) -> int:
    """The end of the run of new trajectories of ``group_id`` with ``length`` tokens that
    starts at ``start`` (at most ``most`` of them): the members of a group queued together."""
    stop = min(len(items), start + most)
    j = start
    while (
        j < stop
        and (nxt := items[j]).v_traj is None
        and nxt.group_id == group_id
        and nxt.prompt_len + nxt.generated_len == length
    ):
        j += 1
    return j


class _Group:
    """One version's candidate instances, best first: ``members`` (positions into the counter
    lists) and their ``keys`` (the negated gain at the reference length) in ascending key
    order, equal keys in instance-id order: the order a min-heap of ``(key, instance id,
    position)`` pops in, kept as two flat lists so that building it makes no per-instance
    objects."""

    __slots__ = ("keys", "members")

    def __init__(self, keys: list[float], members: list[int]) -> None:
        self.keys = keys
        self.members = members

    def drop(self, j: int) -> None:
        del self.keys[j]
        del self.members[j]

    def drop_head(self, count: int) -> None:
        del self.keys[:count]
        del self.members[:count]

    def move(self, j: int, key: float, iids: list[str]) -> None:
        """The member at ``j`` has a new key: put it where the order places it."""
        p = self.members[j]
        del self.keys[j]
        del self.members[j]
        self.insert(key, p, iids)

    def insert(self, key: float, p: int, iids: list[str]) -> None:
        """Add the instance at position ``p`` with ``key`` where the order places it."""
        keys, members = self.keys, self.members
        i = bisect_left(keys, key)
        iid = iids[p]
        while i < len(keys) and keys[i] == key and iids[members[i]] < iid:
            i += 1
        keys.insert(i, key)
        members.insert(i, p)


def _version_groups(versions: Ints, keys: Floats, pos: Ints, iids: list[str]) -> dict[int, _Group]:
    """The instances at ``pos`` (with their ``versions`` and ranking ``keys``) as one
    :class:`_Group` per version."""
    if not len(pos):
        return {}
    order = np.lexsort((keys, versions))  # by version, then key
    v_sorted, k_sorted = versions[order], keys[order]
    members: list[int] = pos[order].tolist()
    same_v = v_sorted[1:] == v_sorted[:-1]
    tied = same_v & (k_sorted[1:] == k_sorted[:-1])
    if tied.any():  # equal keys (idle instances, say): instance id order
        edges = np.flatnonzero(np.diff(np.concatenate(([False], tied, [False])))).tolist()
        for lo, hi in zip(edges[::2], edges[1::2], strict=True):
            members[lo : hi + 1] = sorted(members[lo : hi + 1], key=iids.__getitem__)
    key_l: list[float] = k_sorted.tolist()
    cuts = [0, *(np.flatnonzero(~same_v) + 1).tolist(), len(members)]
    return {int(v_sorted[lo]): _Group(key_l[lo:hi], members[lo:hi]) for lo, hi in pairwise(cuts)}


def _best_group(
    candidates: list[int],
    groups: dict[int, _Group],
    pick: Callable[[_Group, int, bool], int],
    gain_at: Callable[[int, int], float],
    length: int,
    due: bool,
    usage: Callable[[int], float] | None = None,
) -> list[int]:
    """The one version group whose best acceptable instance has the largest gain (with
    ``usage``, the lowest KV usage: ``due_placement="headroom"``) ([] if none). Picks stay in
    their groups, so the caller's own pick in the chosen group finds the same instance."""
    best: tuple[float, int] | None = None
    for v in candidates:
        g = groups[v]
        if not g.members:
            continue
        at = pick(g, length, due)
        if at < 0:
            continue
        p = g.members[at]
        score = -usage(p) if usage is not None else gain_at(p, length)
        if best is None or score > best[0]:
            best = (score, v)
    return [] if best is None else [best[1]]


def _usage_of(kv: list[int], cap: list[int]) -> Callable[[int], float]:
    """KV usage of the instance at a position, from the router's running counters."""
    return lambda p: kv[p] / cap[p]


def _most_headroom(
    members: list[int],
    length: int,
    n: list[int],
    kv: list[int],
    cap: list[int],
    max_n: int,
    kv_limit: float,
) -> int:
    """``due_placement="headroom"``: the index in ``members`` (a version group, best gain
    first) of the instance with the lowest KV usage that can take ``length`` tokens now (under
    the concurrency cap, KV room), the first in the group's order among equals; -1 if none.
    Nothing leaves the group: θ does not apply to due work placed so."""
    chosen, low, usage = -1, math.inf, _usage_of(kv, cap)
    for j, p in enumerate(members):
        if n[p] >= max_n or kv[p] + length > kv_limit * cap[p]:
            continue
        u = usage(p)
        if u < low:
            chosen, low = j, u
    return chosen
