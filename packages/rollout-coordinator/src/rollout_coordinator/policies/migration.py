"""Migration: move work from a loaded instance to a starving one; act on preemptions.

Theory of operation
-------------------
*Starving–loaded migration* (at most one loaded instance per cycle; with
``migration_during_sync=False`` none in a cycle where any instance is syncing or a sync was
just issued). A starving instance is one routing left hungry this cycle: it had room and gain
but the queue held no admissible work for it (the least loaded such instance is picked). Its
partner is the non-syncing instance with the highest load indicator (``migration_indicator``:
KV tokens, running count, engine-waiting count or throughput). If the partner's indicator is
≥ ``migration_ratio`` × the starving instance's (a zero indicator counts as zero, so any
positive load qualifies against an empty instance) and the partner runs ≥
``migration_min_running`` trajectories, the partner's trajectories that the starving instance
can serve (V_traj ≤ its version after sync) are interrupted — largest first (the tail that
holds the batch back and the most KV relief): half the running-count gap
(``migration_amount="half_gap"``) or all of them (``"all"``) — and return to the trajectory
server, where the next cycle's router re-places them by marginal gain (the starving one has the
largest). Not where the router tries a partial's versions oldest first
(:attr:`RoutingResult.partials_oldest_first`) and the starving instance is at a newer version
than the loaded one: the moved work would go to the loaded instance's version first, where the
loaded instance, emptied by the move, is the best place, and it would come straight back and
re-prefill there.

With ``migration_min_speedup`` set, that happens only if the cost model predicts that
balancing the two instances — half the running-count gap onto the starving one — gives the
moved work a decode step at least that many times faster than the loaded instance's now,
whatever amount then moves: below the model's knee a step takes about as long with 5
trajectories as with 20, and moving some of them gains nothing and costs their interrupt, the
trip through the queue and the re-prefill. A loaded instance whose KV usage is at
``route_kv_limit`` or above is exempt, since what it holds is about to be preempted, which the
step-time model does not see. With ``migration_move_cost_s`` as well, the step saved, times the
tokens the moved trajectories are expected to generate still (on average as many as they have
so far, the expectation of a long-tailed length), must be at least that many seconds, what a
move costs a trajectory in standing still: a trajectory that has just started, or a workload of
short responses, gains less from a faster step than it loses in the move.

*Due spreading* (``due_spread_ratio``, off by default; before the starving–loaded move, on
instances no preemption rule interrupted this cycle). Work the trainer's next batch waits for
(V_traj ≤ the abort floor + 1) that shares an instance whose decode step is at least that many
times what it would take alone goes back to the queue while a light instance
(``due_spread_max_running`` running or fewer) is there to take it: the longest such trajectory
of each loaded instance, the largest expected saving first, one per light instance. The
router then places it (by gain, or by ``due_placement``), which puts it on a light instance.
A light instance counts for a trajectory only if the router can send it there instead of back:
at a version that can resume it and, where the router tries a partial's versions oldest first
(:attr:`RoutingResult.partials_oldest_first`: the cost-model router with
``partial_order="version"``), no newer than the loaded instance's. Moved toward newer light
instances alone, it would come straight back, re-prefill, and be moved again, cycle after cycle.
The even router sends a partial to the least-loaded instance of any version that can serve it.

Preemption (``preemption_rule``):

* ``bounce``: an instance whose engine waiting queue is already ≥ ``bounce_waiting_threshold``
  and whose KV usage is ≥ ``bounce_kv_threshold`` is about to preempt running trajectories into
  that queue. The coordinator interrupts the ones the engine would pick (the smallest — most
  recently started, cheapest to move), up to ``bounce_max_per_instance``, enough to bring KV
  usage back under the threshold, so they are re-routed rather than waiting behind the queue.
* ``abort``: once an engine's waiting queue exceeds ``preempt_abort_waiting``, the waiting
  trajectories that were meant to run there — the engine preempted them (a snapshot showed
  them running), or refused them because it had filled since the snapshot they were routed
  against (no room left for them: half ``route_kv_limit`` less what the instance holds) —
  are aborted back to the trajectory server (``Interrupt``, requeue, reason ``bounce``),
  oldest route first, as many as the queue exceeds the allowance by, and re-routed. One routed
  into room that still fits waits for its prefill (the engine's token budget a step) and
  stays (:class:`~rollout_coordinator._meant.MeantToRun`). Work routed to an engine known to
  be full (the even router hands work to an engine whatever its load, as a round-robin front
  end does) stays in that engine's queue, as in a real deployment: aborting it would send it
  straight back to the same full engines, cycle after cycle.
* ``off``: nothing.
"""

from __future__ import annotations

import bisect

from rollout_coordinator._commands import Interrupt, InterruptReason
from rollout_coordinator._config import CoordinatorConfig
from rollout_coordinator._records import RunningEntry
from rollout_coordinator._speculative import InstanceState
from rollout_coordinator.policies._base import CycleView, RoutingResult, VTrajLookup, reads


def _indicator(inst: InstanceState, kind: str) -> float:
    if kind == "kv":
        return float(inst.kv_used)
    if kind == "running":
        return float(inst.n_running)
    if kind == "waiting":
        return float(inst.waiting)
    return inst.throughput


@reads(
    "migration_ratio",
    "migration_indicator",
    "migration_min_running",
    "migration_amount",
    "migration_during_sync",
    "migration_min_speedup",
    "migration_move_cost_s",
    "route_kv_limit",
    "preemption_rule",
    "preempt_abort_waiting",
    "bounce_waiting_threshold",
    "bounce_kv_threshold",
    "bounce_max_per_instance",
    "due_spread_ratio",
    "due_spread_max_running",
)
def migrate_to_starving(
    view: CycleView, routing: RoutingResult, v_traj: VTrajLookup
) -> list[Interrupt]:
    cfg = view.config
    out: list[Interrupt] = []
    if cfg.preemption_rule == "bounce":
        out.extend(_bounce(view))
    elif cfg.preemption_rule == "abort":
        out.extend(_abort_preempted(view))
    out.extend(_spread_due(view, routing, v_traj, {i.instance_id for i in out}))
    bounced = {i.instance_id for i in out}
    if not routing.hungry:
        return out
    if not cfg.migration_during_sync and any(i.syncing for i in view.instances.values()):
        return out
    kind = cfg.migration_indicator
    instances = view.instances
    starving = min(
        (instances[i] for i in routing.hungry),
        key=lambda s: (_indicator(s, kind), s.instance_id),
    )
    s_ind = _indicator(starving, kind)
    loaded: InstanceState | None = None
    best = -1.0
    for iid, inst in instances.items():
        if iid == starving.instance_id or iid in bounced or inst.syncing:
            continue
        if inst.n_running < cfg.migration_min_running:
            continue
        ind = _indicator(inst, kind)
        if ind > best or (ind == best and loaded is not None and iid < loaded.instance_id):
            loaded, best = inst, ind
    if loaded is None or best <= 0 or best < cfg.migration_ratio * s_ind:
        return out
    if _sent_back(routing, loaded, starving.target_version):
        return out
    target_v = starving.target_version
    movable = [e for e in loaded.running_entries() if (v_traj(e.trajectory_id) or 0) <= target_v]
    half_gap = min(len(movable), (loaded.n_running - starving.n_running) // 2)
    k = len(movable) if cfg.migration_amount == "all" else half_gap
    if k <= 0:
        return out
    movable.sort(key=lambda e: (-e.tokens, e.trajectory_id))
    if not _pays(cfg, loaded, starving, movable, half_gap):
        return out
    out.append(
        Interrupt(
            instance_id=loaded.instance_id,
            trajectory_ids=tuple(e.trajectory_id for e in movable[:k]),
            reason=InterruptReason.MIGRATION,
            requeue=True,
        )
    )
    return out


def _sent_back(routing: RoutingResult, source: InstanceState, target_version: int) -> bool:
    """Would work moved off ``source`` toward an instance at ``target_version`` come straight
    back? Where the router tries a partial's versions oldest first, a newer target is tried
    only after ``source``'s version, where ``source``, just relieved of the work, is the best
    place (see the module docstring)."""
    return routing.partials_oldest_first and target_version > source.target_version


def _pays(
    cfg: CoordinatorConfig,
    loaded: InstanceState,
    starving: InstanceState,
    movable: list[RunningEntry],
    half_gap: int,
) -> bool:
    """``migration_min_speedup``: balancing the two instances (the largest ``half_gap`` of
    ``movable``, sorted largest first, onto the starving one) must give the moved trajectories
    a step at least that many times faster than the loaded instance's now, and
    (``migration_move_cost_s``) the time that saves them, their mean generated count taken as
    the tokens each has still to go, at least the move's cost. Judged at the balanced split
    whatever ``migration_amount`` moves: with ``all`` the router re-places the moved work by
    marginal gain, and moving everything onto one instance is never faster. A loaded instance
    at or above ``route_kv_limit`` KV usage passes: its work is about to be preempted, which
    the step-time model does not see."""
    speedup = cfg.migration_min_speedup
    if speedup is None or loaded.kv_usage >= cfg.route_kv_limit:
        return True
    if half_gap <= 0:
        return False
    cm = cfg.cost_model
    moved = movable[:half_gap]
    moved_kv = sum(e.tokens for e in moved)
    before = cm.step_latency(loaded.n_running, loaded.kv_used)
    after = cm.step_latency(starving.n_running + half_gap, starving.kv_used + moved_kv)
    if before < speedup * after:
        return False
    cost = cfg.migration_move_cost_s
    if cost is None:
        return True
    # each moved trajectory is expected to generate as many tokens again as it has
    expected = sum(e.generated_tokens for e in moved) / len(moved)
    return expected * (before - after) >= cost


def _spread_due(
    view: CycleView, routing: RoutingResult, v_traj: VTrajLookup, busy: set[str]
) -> list[Interrupt]:
    """``due_spread_ratio``: due trajectories off loaded instances, while light ones can take
    them (see :class:`~rollout_coordinator.CoordinatorConfig`). ``busy``: instances already
    given an interrupt this cycle."""
    cfg = view.config
    cm = cfg.cost_model
    ratio = cfg.due_spread_ratio
    if ratio is None:
        return []
    light = cfg.due_spread_max_running
    last_chance = view.abort_floor + 1
    instances = view.instances
    taker_versions = sorted(
        inst.version
        for iid, inst in instances.items()
        if inst.n_running <= light and not inst.syncing and inst.waiting == 0 and iid not in busy
    )
    takers = len(taker_versions)
    if not takers:
        return []
    # τ(1, kv) never falls as kv grows, so no trajectory runs alone faster than one of no
    # tokens: an instance stepping faster than ``ratio`` times that keeps its due work (checked
    # before the per-trajectory scan below, which most instances would not pass)
    least_alone = ratio * cm.step_latency(1, 0)
    moves: list[tuple[float, str, str]] = []
    for iid, inst in instances.items():
        if iid in busy or inst.syncing or inst.n_running < light + 2:
            continue
        step = cm.step_latency(inst.n_running, inst.kv_used)
        if step < least_alone:
            continue
        due = [
            e
            for e in inst.running_entries()
            if (v := e.v_traj if e.v_traj is not None else v_traj(e.trajectory_id)) is not None
            and v <= last_chance
        ]
        if not due:
            continue
        e = max(due, key=lambda e: (e.tokens, e.trajectory_id))
        alone = cm.step_latency(1, e.tokens)
        if step < ratio * alone:
            continue
        # a light instance at a version that can resume it, the oldest such (the router's
        # first choice among them) not one it would send the trajectory back from
        lo = e.v_traj if e.v_traj is not None else v_traj(e.trajectory_id)
        at = bisect.bisect_left(taker_versions, lo if lo is not None else 0)
        if at == takers or _sent_back(routing, inst, taker_versions[at]):
            continue
        moves.append((-(e.generated_tokens * (step - alone)), iid, e.trajectory_id))
    moves.sort()
    return [
        Interrupt(
            instance_id=iid,
            trajectory_ids=(tid,),
            reason=InterruptReason.MIGRATION,
            requeue=True,
        )
        for _, iid, tid in moves[:takers]
    ]


def _bounce(view: CycleView) -> list[Interrupt]:
    cfg = view.config
    out: list[Interrupt] = []
    for iid, inst in view.instances.items():
        if inst.syncing or inst.waiting < cfg.bounce_waiting_threshold:
            continue
        if inst.kv_usage < cfg.bounce_kv_threshold or inst.n_running == 0:
            continue
        excess = inst.kv_used - cfg.bounce_kv_threshold * inst.kv_capacity
        picked: list[str] = []
        for e in sorted(inst.running_entries(), key=lambda e: (e.tokens, e.trajectory_id)):
            if len(picked) >= cfg.bounce_max_per_instance or (picked and excess <= 0):
                break
            picked.append(e.trajectory_id)
            excess -= e.tokens
        out.append(
            Interrupt(instance_id=iid, trajectory_ids=tuple(picked), reason=InterruptReason.BOUNCE)
        )
    return out


def _abort_preempted(view: CycleView) -> list[Interrupt]:
    keep = view.config.preempt_abort_waiting
    out: list[Interrupt] = []
    for iid, inst in view.instances.items():
        if inst.syncing or inst.waiting <= keep:
            continue
        ids = view.preempted_ids(iid)[: inst.waiting - keep]
        if ids:
            out.append(
                Interrupt(instance_id=iid, trajectory_ids=ids, reason=InterruptReason.BOUNCE)
            )
    return out


def no_migration(view: CycleView, routing: RoutingResult, v_traj: VTrajLookup) -> list[Interrupt]:
    """Vanilla: passive — trajectories stay where they were routed."""
    return []
