"""StaleFlow synchronization: each instance syncs at its own pace, and never later than it must.

Theory of operation
-------------------
Greedy global sync (the baselines, :mod:`~rollout_coordinator.policies.sync_global`) pulls every
instance the moment a version is published. Each pull costs the instance its load time and
interrupts everything it runs: those trajectories resume elsewhere (or here) and re-prefill their
whole context. StaleFlow instead lets each instance choose its moment. A stale instance (version
``v`` below the latest published ``L``, not mid-sync) pulls ``L`` when the first of these holds:

1. **Floor.** ``v`` is at or below the protocol's abort floor: it can place nothing.
2. **Lag bound.** ``L − v ≥ k`` with ``k`` the tighter of ``sync_max_lag`` and
   ``max(1, ⌈sync_lag_fraction × η⌉)`` (each when set): it has ridden an old version long
   enough; it pulls now whatever it runs, as greedy sync would have done ``k − 1`` versions
   ago.
3. **Cheap moment.** Its KV usage is below ``sync_kv_threshold``, its engine waiting queue is
   empty (an interrupted batch is small) and, with ``sync_load_threshold``, it runs less than
   that share of what the router would load it with (:func:`router_load`); with
   ``sync_require_starved`` it also cannot take admissible work at ``v`` (no queued partial
   with ``V_traj ≤ v`` above the floor; new prompts absent, over the quota or not admitted at
   ``v``); and either there is work routable at ``L`` or it is idle (then syncing costs
   nothing).

Why this never does worse than greedy global sync: every pull goes to the latest version, so an
instance pulls at most once per published version — never more loads than greedy; a pull by
rule 3 interrupts less than ``sync_kv_threshold`` of a KV cache where greedy interrupts whatever
runs at the publish; a pull by rules 1–2 interrupts what greedy would, but at most once per
``k`` versions. No instance lags by ``k`` or more, so new work is never admitted more than
``k − 1`` versions behind greedy's (its reservation deadline is at most that much tighter)
and, with ``k ≤ η``, a rollout-bound run never reaches the abort floor: instances cannot ride
an old version together until the floor forces them all to pull at once (a *herd*), and
trajectories admitted at an old version are not left to be aborted there. With ``k = 1`` this
is greedy global sync. How large ``k`` may be depends on the tail: new work at lag ``ℓ`` has
about ``(η − ℓ)`` step times before its latest buffer is trained, which must cover the longest
response; ``k = ⌈η/2⌉`` (``sync_lag_fraction = 0.5``) leaves half the window. Two routing rules close the rest
(:mod:`~rollout_coordinator.policies.routing_gain`): new groups go to the newest version first
(``candidate_order="reserve"``) so old instances drain and hit rule 3, and partials go to the
best gain over every version that can serve them (``partial_order="gain"``) so long partials of
old versions do not pile onto the few instances still at those versions.

Why a load test beside the KV one: the KV threshold stands for "the sync interrupts little"
only where the KV is what fills an instance (the paper's 30B-A3B runs, where the router's θ
test and the KV stop routing at about the same load). On a dense model the KV holds several
times what θ lets run — a Qwen2.5-7B instance on an H20 holds 214 trajectories of a 6K-token
mean, θ = 0.3 stops routing near 30 — so every loaded instance sits far below any KV
threshold, every stale one syncs at once, and per-instance sync is greedy global sync (each
publish interrupts and re-prefills everything).

Running work of a syncing instance is interrupted by the engine and returns to the trajectory
server with V_traj kept (partial rollout).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from rollout_coordinator._commands import Sync
from rollout_coordinator._config import CoordinatorConfig
from rollout_coordinator._speculative import InstanceState
from rollout_coordinator.policies._base import AdmissionPort, CycleView, reads

#: A group id the protocol has never seen: asking about it asks "would a *fresh* group be
#: admitted at this version?" without touching state.
PROBE_GROUP = "\x00rollout-coordinator-probe"


def _route_fails(inst: InstanceState, cfg: CoordinatorConfig) -> tuple[Callable[[int], bool], int]:
    """``fails(j)``: would the cost-model router refuse one more trajectory of ``inst``'s mean
    context ``c = kv_used / n`` on an instance like it running ``j`` of them (θ × an empty
    instance's gain, with the smaller of ``theta`` and ``theta_slack``; KV after it ≤
    ``route_kv_limit``; fewer than ``route_max_concurrency`` running)? False up to some ``m``,
    then True: ``T(j, j·c)`` is concave in ``j``, so the gain of one more falls as ``j`` grows.
    Returned with ``fit``, from which on every ``j`` fails (KV or the cap). Only for
    ``n ≥ 1``."""
    c = max(inst.kv_used / inst.n_running, 1.0)
    cm = cfg.cost_model
    theta = cfg.theta if cfg.theta_slack is None else min(cfg.theta, cfg.theta_slack)
    floor = theta * cm.empty_gain(c)
    fit = int(cfg.route_kv_limit * inst.kv_capacity // c)  # j + 1 of them fit while j < fit
    if cfg.route_max_concurrency is not None:
        fit = min(fit, cfg.route_max_concurrency)

    def fails(j: int) -> bool:
        return j >= fit or cm.marginal_gain(j, j * c, c) < floor

    return fails, fit


def router_load(inst: InstanceState, cfg: CoordinatorConfig) -> float:
    """What ``inst`` runs as a share of what the cost-model router would give it: ``n`` running
    over ``m``, the trajectories of its mean context the router places on it empty, one by one,
    before one fails a test (see :func:`_route_fails`); 0 when nothing runs, infinite when not
    even one fits. ``m`` is found by bisection."""
    n = inst.n_running
    if n <= 0:
        return 0.0
    fails, hi = _route_fails(inst, cfg)
    lo = 0
    while lo < hi:  # the first j that fails lies in [lo, hi]
        mid = (lo + hi) // 2
        if fails(mid):
            hi = mid
        else:
            lo = mid + 1
    return n / lo if lo else math.inf


def router_loaded(inst: InstanceState, cfg: CoordinatorConfig, share: float) -> bool:
    """``router_load(inst, cfg) ≥ share`` without the search: ``n ≥ share × m`` holds exactly
    when the route at ``⌊n / share⌋`` running fails (``m`` is the first ``j`` that fails)."""
    n = inst.n_running
    return n > 0 and _route_fails(inst, cfg)[0](math.floor(n / share))


@reads(
    "sync_kv_threshold",
    "sync_load_threshold",
    "sync_require_starved",
    "sync_max_lag",
    "sync_lag_fraction",
    "theta",
    "theta_slack",
    "route_kv_limit",
    "route_max_concurrency",
)
def sync_when_starved(view: CycleView, port: AdmissionPort, quota: int | None) -> list[Sync]:
    cfg = view.config
    latest = view.latest_version
    floor = view.abort_floor
    thr = cfg.sync_kv_threshold
    load_thr = cfg.sync_load_threshold
    bounds = [cfg.sync_max_lag] if cfg.sync_max_lag is not None else []
    if cfg.sync_lag_fraction is not None:
        bounds.append(max(1, math.ceil(cfg.sync_lag_fraction * view.eta)))
    max_lag = min(bounds) if bounds else None
    starved_only = cfg.sync_require_starved
    queue = view.queue
    min_partial = queue.min_partial_version(above=floor)
    new_open = queue.has_new and (quota is None or quota > 0)
    new_at: dict[int, bool] = {}

    def new_admissible(v: int) -> bool:
        if not new_open:
            return False
        if v not in new_at:
            new_at[v] = port.admissible(PROBE_GROUP, v)
        return new_at[v]

    work_at_latest: bool | None = None
    out: list[Sync] = []
    for iid, inst in view.instances.items():
        if inst.syncing or inst.version >= latest:
            continue
        v = inst.version
        if v <= floor or (max_lag is not None and latest - v >= max_lag):
            out.append(Sync(instance_id=iid, to_version=latest))
            continue
        if inst.kv_usage >= thr or inst.waiting > 0:
            continue  # would interrupt too much now
        if starved_only and ((min_partial is not None and min_partial <= v) or new_admissible(v)):
            continue  # it still has admissible work at its own version
        if inst.n_running == 0:
            out.append(Sync(instance_id=iid, to_version=latest))
            continue
        if work_at_latest is None:
            work_at_latest = min_partial is not None or new_admissible(latest)
        if work_at_latest and (load_thr is None or not router_loaded(inst, cfg, load_thr)):
            out.append(Sync(instance_id=iid, to_version=latest))  # (not while loaded: see rule 3)
    return out
