"""A straightforward reference for the coordinator's hot paths, kept to check the fast ones.

The package ranks instances with numpy, keeps per-instance gain terms, accepts snapshots
through one compound test and accounts a cycle's routes in one loop. This module holds the
per-instance versions those replaced — one scalar ``gain`` call per instance and check, the
acceptance rules checked one by one, one ``RunningEntry`` per route — so
``test_equivalence.py`` can run both over random cycles and require the same commands and
the same state.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from rollout_coordinator import Coordinator, InstanceSnapshot, RunningEntry, SpeculativeState
from rollout_coordinator._commands import Route
from rollout_coordinator.errors import (
    FutureSnapshot,
    InconsistentSnapshot,
    InvalidSnapshot,
    SnapshotRejected,
    StaleSnapshot,
    UnknownInstance,
)
from rollout_coordinator.policies import routing_gain
from rollout_coordinator.policies._base import AdmissionPort, CycleView, RoutingResult, eligible

_ROOM_TRIES = 4
_REFUSALS = 4  # due_first: an instance θ refuses this many times in a cycle stays out


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

    def theta_of(iid: str) -> float:
        # theta_slack: an instance holding work only the next theta_slack_batches batches can
        # take, or none, keeps theta
        if cfg.theta_slack is None:
            return theta
        oldest = view.oldest_routed(iid)
        return (
            theta
            if oldest is None or oldest <= floor + cfg.theta_slack_batches
            else cfg.theta_slack
        )

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
    # due_first: instance θ refused -> the length it was refused for (back for a shorter
    # one), and how often θ refused it this cycle (after _REFUSALS times it stays out)
    refused: dict[str, int] = {}
    refusals: dict[str, int] = {}

    def pick(h: list[tuple[float, str]], length: int, due: bool) -> str | None:
        """Best instance in one version group with room and gain ≥ θ (any gain when
        ``due``); saturated ones leave (with ``due_first``, until a shorter trajectory)."""
        nonlocal live
        if due and cfg.due_placement == "headroom":  # lowest KV usage that fits; no θ
            fits = [
                (local[i][1] / local[i][2], -gain(local[i][0], local[i][1], ref_len), i)
                for _, i in h
                if local[i][0] < max_n and local[i][1] + length <= kv_limit * local[i][2]
            ]
            if not fits:
                return None
            iid = min(fits)[2]
            h[:] = [e for e in h if e[1] != iid]
            heapq.heapify(h)
            return iid
        skipped: list[tuple[float, str]] = []
        chosen: str | None = None
        den = k4 + k1 * length + max(k2, b + k3)
        while h and len(skipped) < _ROOM_TRIES:
            top = h[0]
            n, kv, cap = local[top[1]]
            if n >= max_n or (not due and gain(n, kv, length) < theta_of(top[1]) / den):
                heapq.heappop(h)  # saturated: no trajectory of this size is worth it
                live -= 1
                if cfg.due_first and n < max_n:
                    refusals[top[1]] = refusals.get(top[1], 0) + 1
                    if refusals[top[1]] < _REFUSALS:
                        refused[top[1]] = length
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
        if live <= 0 and not refused:
            break
        if len(routes) >= max_routes:
            stopped_early = True
            break
        v_traj = item.v_traj
        is_new = v_traj is None
        if is_new and quota is not None and new_admitted >= quota:
            break  # new prompts are last in the queue: nothing else to route
        length = item.prompt_len + item.generated_len
        for iid in [i for i, at in refused.items() if at > length]:
            del refused[iid]  # refused only for longer ones: back in its group
            n_run, kv = local[iid][:2]
            heapq.heappush(heaps[version_of[iid]], (-gain(n_run, kv, ref_len), iid))
            live += 1
        due = (cfg.due_first or cfg.due_placement == "headroom") and not is_new and port.due(item)
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
                candidates = _best_group(
                    candidates, heaps, pick, local, length, gain, ref_len, due,
                    by_usage=due and cfg.due_placement == "headroom",
                )  # fmt: skip
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
            picked = pick(h, length, due)
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
        empty = cm.empty_gain(ref_len)
        hungry = frozenset(
            iid
            for h in heaps.values()
            for _, iid in h
            if local[iid][1] + ref_len <= kv_limit * local[iid][2]
            and gain(local[iid][0], local[iid][1], ref_len) >= theta_of(iid) * empty
        )
    return RoutingResult(
        routes=routes,
        hungry=hungry,
        new_admitted=new_admitted,
        partials_oldest_first=not partials_by_gain,
    )


def _best_group(
    candidates: list[int],
    heaps: dict[int, list[tuple[float, str]]],
    pick: Callable[[list[tuple[float, str]], int, bool], str | None],
    local: dict[str, list[int]],
    length: int,
    gain: Callable[[int, float, int], float],
    ref_len: int,
    due: bool,
    by_usage: bool = False,
) -> list[int]:
    """The one version group whose best acceptable instance has the largest gain (lowest KV
    usage ``by_usage``) ([] if none).

    Each group's pick is put back (with its ranking key), so the caller's own pick in the
    chosen group finds the same instance.
    """
    best: tuple[float, int] | None = None
    for v in candidates:
        h = heaps[v]
        if not h:
            continue
        iid = pick(h, length, due)
        if iid is None:
            continue
        n, kv = local[iid][0], local[iid][1]
        heapq.heappush(h, (-gain(n, kv, ref_len), iid))
        g = -kv / local[iid][2] if by_usage else gain(n, kv, length)
        if best is None or g > best[0]:
            best = (g, v)
    return [] if best is None else [best[1]]


class ReferenceState(SpeculativeState):
    """Snapshots checked rule by rule; each route accounted on its own (``route``)."""

    def apply_snapshot(self, snap: InstanceSnapshot, *, now: float, latest_version: int) -> float:
        """Replace an instance's counters with a snapshot, or raise and change nothing.
        Returns the time of the snapshot it replaces."""
        iid = snap.instance_id
        state = self.instances.get(iid)
        if state is None:
            raise UnknownInstance(iid, list(self.instances))
        if snap.time_s > now:
            raise FutureSnapshot(
                f"taken at time_s={snap.time_s}, after the coordinator's now={now}",
                instance_id=iid,
                field="time_s",
            )
        if snap.seq <= state.last_seq:
            raise StaleSnapshot(
                f"seq {snap.seq} does not increase past the last accepted seq {state.last_seq}",
                instance_id=iid,
                field="seq",
            )
        if snap.time_s < state.last_local_update:
            raise StaleSnapshot(
                f"taken at time_s={snap.time_s}, before the coordinator's last command to it "
                f"at {state.last_local_update}",
                instance_id=iid,
                field="time_s",
            )
        if snap.time_s < state.last_snapshot_time:
            raise StaleSnapshot(
                f"time_s={snap.time_s} regresses past the last accepted {state.last_snapshot_time}",
                instance_id=iid,
                field="time_s",
            )
        if snap.version > latest_version:
            raise InconsistentSnapshot(
                f"version {snap.version} was never published (latest is {latest_version})",
                instance_id=iid,
                field="version",
            )
        sync_done = False
        if state.seen_snapshot or state.syncing:
            if snap.version < state.version:
                raise InconsistentSnapshot(
                    f"version regressed from {state.version} to {snap.version}",
                    instance_id=iid,
                    field="version",
                )
            if snap.version > state.version:
                if not state.syncing or snap.version != state.target_version:
                    raise InconsistentSnapshot(
                        f"version {snap.version} but the coordinator synced it to "
                        f"{state.target_version if state.syncing else state.version}",
                        instance_id=iid,
                        field="version",
                    )
                sync_done = True
        # --- accepted: nothing above changed state ---
        state.version = snap.version
        if sync_done:
            state.syncing = False
        if not state.syncing:
            state.target_version = state.version
        state._base_running = snap.running
        state._added = {}
        state._removed = set()
        state.n_running = len(snap.running)
        state.kv_used = snap.kv_used_tokens
        state.kv_capacity = snap.kv_capacity_tokens
        state.waiting = snap.waiting
        state.throughput = snap.throughput_tokens_per_s
        state.last_seq = snap.seq
        prev_time = state.last_snapshot_time
        state.last_snapshot_time = snap.time_s
        state.seen_snapshot = True
        return prev_time

    def route_all(self, routes: Sequence[Route], *, now: float) -> None:
        for r in routes:
            entry = RunningEntry(
                trajectory_id=r.trajectory_id,
                prompt_tokens=r.tokens,
                generated_tokens=0,
                v_traj=r.version,
            )
            self.route(r.instance_id, entry, now=now)


class ReferenceCoordinator(Coordinator):
    """The coordinator with the reference state, snapshot intake and cost-model router."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state = ReferenceState()
        if self.policy.routing is routing_gain.route_by_marginal_gain:
            self.policy = attrs.evolve(self.policy, routing=route_by_marginal_gain)

    def _ingest(self, snapshots: Iterable[Any], now: float) -> list[SnapshotRejected]:
        rejected: list[SnapshotRejected] = []
        for raw in snapshots:
            try:
                try:
                    snap = InstanceSnapshot.from_engine(raw)
                except (AttributeError, TypeError) as exc:
                    raise InvalidSnapshot(
                        f"not a snapshot: {exc}",
                        instance_id=str(getattr(raw, "instance_id", "?")),
                        field="snapshot",
                    ) from exc
                st = self.state.instances.get(snap.instance_id)
                prev_time = st.last_snapshot_time if st is not None else 0.0
                self.state.apply_snapshot(
                    snap, now=now, latest_version=self.protocol.published_version
                )
                if self._track_meant and snap.running:
                    self._meant.note_running(snap, self._routed[snap.instance_id])
                self._prune(snap, prev_time)
            except SnapshotRejected as exc:
                rejected.append(exc)
                self._log.warning(
                    "snapshot_rejected", instance=exc.instance_id, field=exc.field, error=str(exc)
                )
        return rejected
