"""Coordinator configuration: every threshold a named, validated field with a documented default.

Out-of-range values raise :class:`ConfigError` naming the field and the allowed range; nothing is
clamped. Batch size, group size and η are *not* here: they belong to the staleness protocol and
the coordinator reads them from it, so the two can never disagree.

Profiles
--------
A *profile* is a named set of field values (:data:`PROFILES`), applied with
:meth:`CoordinatorConfig.from_profile` or ``from_dict({"profile": ...})``; explicit fields win.

* ``default`` — the field defaults below (among them ``migration_min_speedup`` 1.1 and
  ``migration_move_cost_s`` 0.1, rules beyond the paper: migrate only where the cost model
  predicts that balancing the two instances gives the moved work a faster step, and that the
  time this saves the moved trajectories exceeds what the move costs them).
* ``paper`` — the values of the published StaleFlow runs: θ 0.3; the router takes at most 128
  concurrent requests per instance with a KV limit of 100 %; a stale instance syncs once its KV
  usage is at most 0.5 and its engine waiting queue is empty, whether or not work at its version
  remains; migration compares throughput, needs a ratio above 5 and at least 8 running, moves
  all the loaded instance's movable requests (the router re-places them by the cost model), one
  instance per cycle, never while a sync is issued or in flight; a request the engine preempts
  is aborted back to the trajectory server once the engine's waiting queue exceeds 3; new
  groups go to the version whose latest reservable buffer is latest.
* ``robust`` — ``paper`` plus three rules beyond it: a stale instance syncs at once when it
  lags the latest published version by ``⌈η/2⌉`` (greedy global sync at η ≤ 2; no instance
  rides an old version to the abort floor, so syncs cannot pile up into a herd there; see
  :mod:`rollout_coordinator.policies.sync_per_instance`); queued partial trajectories go to
  the instance with the best marginal gain among every version that can serve them, not to
  the oldest version first; and ``due_first`` (work the trainer waits for skips θ, and θ
  refuses an instance only for trajectories at least as long as the one it refused).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from rollout_coordinator.cost_model import QWEN3_30B_A3B_H20, CostModel
from rollout_coordinator.errors import ConfigError, CostModelError

MIGRATION_INDICATORS = ("kv", "running", "waiting", "throughput")
MIGRATION_AMOUNTS = ("half_gap", "all")
PREEMPTION_RULES = ("bounce", "abort", "off")
CANDIDATE_ORDERS = ("oldest", "reserve")
PARTIAL_ORDERS = ("version", "gain")
DUE_PLACEMENTS = ("gain", "headroom")


def _open_unit(inst: Any, a: attrs.Attribute[float], v: float) -> None:
    if not (isinstance(v, int | float) and 0.0 < v <= 1.0):
        raise ConfigError(a.name, v, "in (0, 1]")


def _unit(inst: Any, a: attrs.Attribute[float], v: float) -> None:
    if not (isinstance(v, int | float) and 0.0 <= v <= 1.0):
        raise ConfigError(a.name, v, "in [0, 1]")


def _above_one(inst: Any, a: attrs.Attribute[float], v: float) -> None:
    if not (isinstance(v, int | float) and v > 1.0 and v != float("inf")):
        raise ConfigError(a.name, v, "a finite number > 1")


def _positive_int(inst: Any, a: attrs.Attribute[int], v: int) -> None:
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise ConfigError(a.name, v, "an integer >= 1")


def _non_negative_int(inst: Any, a: attrs.Attribute[int], v: int) -> None:
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
        raise ConfigError(a.name, v, "an integer >= 0")


def _optional_positive_int(inst: Any, a: attrs.Attribute[int | None], v: int | None) -> None:
    if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise ConfigError(a.name, v, "an integer >= 1 or None (off)")


def _optional_finite(low: float, allowed: str) -> Any:
    """A validator: None, or a finite number (not a bool) >= ``low``; ``allowed`` says so."""

    def check(inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
        if v is not None and not (
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= low
        ):
            raise ConfigError(a.name, v, allowed)

    return check


_optional_non_negative = _optional_finite(0.0, "a finite number >= 0 or None (η)")
_optional_speedup = _optional_finite(1.0, "a finite number >= 1 or None (off)")
_optional_cost = _optional_finite(0.0, "a finite number of seconds >= 0 or None (off)")


def _optional_fraction(inst: Any, a: attrs.Attribute[float | None], v: float | None) -> None:
    if v is not None and not (
        isinstance(v, int | float) and not isinstance(v, bool) and 0.0 < v <= 1.0
    ):
        raise ConfigError(a.name, v, "in (0, 1] or None (off)")


def _bool(inst: Any, a: attrs.Attribute[bool], v: bool) -> None:
    if not isinstance(v, bool):
        raise ConfigError(a.name, v, "true or false")


def _one_of(*choices: str) -> Any:
    def check(inst: Any, a: attrs.Attribute[str], v: str) -> None:
        if v not in choices:
            raise ConfigError(a.name, v, f"one of {list(choices)}")

    return check


def _policy(inst: Any, a: attrs.Attribute[str], v: str) -> None:
    from rollout_coordinator.policies import POLICIES  # late: policies import this module

    if v not in POLICIES:
        raise ConfigError(a.name, v, f"one of {sorted(POLICIES)}")


def _cost_model(inst: Any, a: attrs.Attribute[CostModel], v: CostModel) -> None:
    if not isinstance(v, CostModel):
        raise ConfigError(a.name, v, "a CostModel (a preset, CostModel.load(path) or from_dict)")


@attrs.frozen(kw_only=True)
class CoordinatorConfig:
    """Thresholds of the snapshot–command cycle (see the module docstring for profiles)."""

    #: Policy name from the registry (``rollout_coordinator.policies.POLICIES``).
    policy: str = attrs.field(default="staleflow", validator=_policy)
    #: Cost model used by routing. Default: the Qwen3-30B-A3B/H20 preset.
    cost_model: CostModel = attrs.field(default=QWEN3_30B_A3B_H20, validator=_cost_model)

    # --- routing ---
    #: Accept a route only if its marginal throughput gain is ≥ θ × an empty instance's gain.
    #: In (0, 1]; the reference runs use 0.2–0.5.
    theta: float = attrs.field(default=0.3, validator=_open_unit)
    #: θ for an instance whose work all has slack in the η window: it holds routed work and
    #: every trajectory routed to it can still be trained after the batches the trainer needs
    #: next (its V_traj is above the abort floor + ``theta_slack_batches``). Such an instance
    #: may take work at a smaller gain (more running, each slower); one holding work the next
    #: batches wait for, or holding none, keeps ``theta``. None: ``theta`` everywhere. In
    #: (0, 1]. A rule beyond the paper's runs (see the throughput docs for what it measured).
    theta_slack: float | None = attrs.field(default=None, validator=_optional_fraction)
    #: What "holding work the next batches wait for" means for ``theta_slack``: a trajectory
    #: routed at a V_traj ≤ the abort floor + this can only be trained in one of the next this
    #: many batches, and its instance keeps ``theta``. 1: the next batch alone; 2 (the
    #: default): the next two, so a trajectory admitted one step ahead of the trainer is not
    #: slowed down by work packed beside it under ``theta_slack`` a step before the trainer
    #: needs it (at η = 1 every trajectory is such). ≥ 1.
    theta_slack_batches: int = attrs.field(default=2, validator=_positive_int)
    #: Serve what the trainer waits for first: a queued partial whose group is reserved in
    #: the buffer the trainer takes next is *due*, and θ never refuses it (it goes where a
    #: partial of its version goes, to the first instance with KV room, whatever the gain);
    #: and an instance θ refuses for a trajectory of ``L`` tokens stays a candidate for
    #: shorter ones later in the queue (see :mod:`~rollout_coordinator.policies.routing_gain`).
    #: False: the paper's rule (θ for every trajectory; an instance θ refuses leaves the
    #: cycle). A rule beyond the paper's runs (see the throughput docs).
    due_first: bool = attrs.field(default=False, validator=_bool)
    #: Where a *due* queued partial (its group reserved in the buffer the trainer takes next)
    #: goes: ``gain`` (as any partial of its version, by marginal gain) or ``headroom`` (the
    #: instance with the lowest KV usage among those that can take it now, whatever its gain,
    #: in the version group ``partial_order`` sends it to — with ``gain``, over every version
    #: that can serve it: an engine preempts its newest work first when its KV fills, so a
    #: re-routed trajectory is the first to go again on a nearly full instance). A rule beyond
    #: the paper's runs (see the throughput docs for what it measured).
    due_placement: str = attrs.field(default="gain", validator=_one_of(*DUE_PLACEMENTS))
    #: An instance has KV room for a trajectory if its KV usage *after* adding it stays ≤ this.
    route_kv_limit: float = attrs.field(default=0.9, validator=_open_unit)
    #: The cost-model router gives an instance no more work once it runs this many
    #: trajectories (None: no cap; the paper's runs: 128).
    route_max_concurrency: int | None = attrs.field(default=None, validator=_optional_positive_int)
    #: Which version group new groups try first: ``oldest`` (smallest admissible version) or
    #: ``reserve`` (the version whose latest reservable buffer is latest: under the buffer
    #: protocol that is the newest admissible version).
    candidate_order: str = attrs.field(default="oldest", validator=_one_of(*CANDIDATE_ORDERS))
    #: Where queued partials go: ``version`` (the smallest version that can serve them first)
    #: or ``gain`` (the best marginal gain among every version that can serve them).
    partial_order: str = attrs.field(default="version", validator=_one_of(*PARTIAL_ORDERS))
    #: Hard cap on routes issued in one cycle (bounds the cycle's cost; the rest go next cycle).
    max_routes_per_cycle: int = attrs.field(default=4096, validator=_positive_int)
    #: Stop scanning the queue after this many consecutive trajectories that found no instance.
    route_miss_limit: int = attrs.field(default=256, validator=_positive_int)

    # --- synchronization (per-instance policy) ---
    #: A stale instance syncs only while its KV usage is below this (syncing unlocks routing
    #: only if the instance would have room; a busy instance keeps serving its version).
    sync_kv_threshold: float = attrs.field(default=0.3, validator=_unit)
    #: ... and only while it runs less than this share of the trajectories the cost-model
    #: router would give it: trajectories of its mean context, placed one by one on it empty
    #: until a route fails θ, ``route_kv_limit`` or ``route_max_concurrency``. KV usage
    #: measures how much a sync interrupts only where the KV is what fills an instance; where
    #: θ stops routing first (a dense model, whose KV holds several times what θ lets run),
    #: every stale instance is below any KV threshold and per-instance sync becomes greedy
    #: global sync. None: no such test (the paper's rule). In (0, 1]. A rule beyond the
    #: paper's runs (see the throughput docs for what it measured).
    sync_load_threshold: float | None = attrs.field(default=None, validator=_optional_fraction)
    #: ... and only once it cannot take admissible work at its own version (the paper's runs
    #: do not require this: False).
    sync_require_starved: bool = attrs.field(default=True, validator=_bool)
    #: A stale instance that lags the latest published version by at least this many versions
    #: syncs at once, whatever its load (None: never forced before the abort floor; 1 is greedy
    #: global sync).
    sync_max_lag: int | None = attrs.field(default=None, validator=_optional_positive_int)
    #: The same bound relative to the staleness bound: ``max(1, ⌈fraction × η⌉)`` versions
    #: (None: off). When both are set the tighter one applies.
    sync_lag_fraction: float | None = attrs.field(default=None, validator=_optional_fraction)

    # --- migration ---
    #: Migrate when the loaded instance's indicator is ≥ this × the starving one's (> 1; ≈5).
    migration_ratio: float = attrs.field(default=5.0, validator=_above_one)
    #: Load indicator compared by migration: "kv" (KV tokens), "running", "waiting" or
    #: "throughput" (tokens/s from the snapshot).
    migration_indicator: str = attrs.field(default="kv", validator=_one_of(*MIGRATION_INDICATORS))
    #: A loaded instance gives up trajectories only if it runs at least this many.
    migration_min_running: int = attrs.field(default=4, validator=_positive_int)
    #: How many it gives up: ``half_gap`` (half the running-count gap, largest first) or
    #: ``all`` (every one the starving instance can serve; the router re-places them).
    migration_amount: str = attrs.field(default="half_gap", validator=_one_of(*MIGRATION_AMOUNTS))
    #: Whether migration may act in a cycle where a sync is issued or in flight.
    migration_during_sync: bool = attrs.field(default=True, validator=_bool)
    #: Migrate only if the routing cost model predicts that balancing the two instances (half
    #: the running-count gap onto the starving one, whatever ``migration_amount`` then moves)
    #: gives the moved trajectories a decode step at least this many times faster than the
    #: loaded instance's now: below the model's knee an instance's step takes about the same
    #: time whatever it runs, so moving part of a small load only costs the move. A loaded
    #: instance at or above ``route_kv_limit`` KV usage is exempt (its work is about to be
    #: preempted, which the model does not see). None: no such test (the paper's rule; the
    #: ``paper`` and ``robust`` profiles). A rule beyond the paper's runs (see the throughput
    #: docs for what it measured).
    migration_min_speedup: float | None = attrs.field(default=1.1, validator=_optional_speedup)
    #: Seconds a moved trajectory stands still (the interrupt, the trip through the queue, the
    #: route to the starving instance: about two control cycles). With it, migration also
    #: needs the step it saves the moved trajectories, times the tokens each is expected to
    #: generate still (as many as it has so far: a long-tailed length's expectation), to be
    #: at least this on average: a young or short trajectory gains less from a faster step
    #: than it loses in the move. Judged with ``migration_min_speedup``'s split and exemption
    #: (and only where that test is on). None: no such test (the paper's rule). A rule beyond
    #: the paper's runs.
    migration_move_cost_s: float | None = attrs.field(default=0.1, validator=_optional_cost)

    #: Spread due work: a trajectory the trainer's next batch waits for (V_traj ≤ the abort
    #: floor + 1) on an instance whose decode step is at least this many times the step it
    #: would take alone (routing cost model) is interrupted and re-routed while a light
    #: instance (``due_spread_max_running`` running or fewer, no waiting queue, not syncing)
    #: that the router can send it to is there (at a version that can resume it; with
    #: ``partial_order="version"`` no newer than the loaded one's, else it comes straight
    #: back): per loaded instance its longest due trajectory, the largest
    #: expected saving first (its step saved × the tokens it has generated, a long-tailed
    #: length's expectation of what it still has to go), one per light instance. Where the
    #: tail of a batch binds (η = 1), the last responses of a batch otherwise run beside the
    #: rest of it and the next batch's work. None: off. A rule beyond the paper's runs (see
    #: the throughput docs for what it measured).
    due_spread_ratio: float | None = attrs.field(default=None, validator=_optional_speedup)
    #: The most trajectories a light instance runs for ``due_spread_ratio``; a loaded one
    #: runs at least two more.
    due_spread_max_running: int = attrs.field(default=2, validator=_non_negative_int)

    # --- preemption ---
    #: What happens to work the engine preempts or is about to: ``bounce`` (interrupt running
    #: trajectories of an instance with a long waiting queue and nearly full KV, below),
    #: ``abort`` (the paper's rule: once the engine's waiting queue exceeds
    #: ``preempt_abort_waiting``, the excess waiting trajectories go back to the trajectory
    #: server, oldest routed first — those are the preempted ones) or ``off``.
    preemption_rule: str = attrs.field(default="bounce", validator=_one_of(*PREEMPTION_RULES))
    #: The waiting queue an engine may keep under the ``abort`` rule.
    preempt_abort_waiting: int = attrs.field(default=3, validator=_positive_int)
    #: Bounce (interrupt for re-routing) trajectories on an instance whose engine waiting queue
    #: is at least this long ...
    bounce_waiting_threshold: int = attrs.field(default=8, validator=_positive_int)
    #: ... while its KV usage is at least this (preemption is imminent) ...
    bounce_kv_threshold: float = attrs.field(default=0.95, validator=_unit)
    #: ... at most this many trajectories per instance per cycle.
    bounce_max_per_instance: int = attrs.field(default=8, validator=_positive_int)

    # --- the VeRL-Async baseline (policy ``verl-async``) ---
    #: verl's ``staleness_threshold``: between two parameter syncs the rollouter starts at most
    #: ``(1 + this) × B`` groups, counting those still in flight or queued (None: η).
    verl_staleness_threshold: float | None = attrs.field(
        default=None, validator=_optional_non_negative
    )
    #: verl's concurrency cap: at most this many groups in flight per rollout server.
    verl_max_concurrent_groups_per_instance: int = attrs.field(default=16, validator=_positive_int)

    @classmethod
    def from_profile(cls, name: str, **overrides: Any) -> CoordinatorConfig:
        """The named profile (:data:`PROFILES`) with ``overrides`` on top."""
        if name not in PROFILES:
            raise ConfigError("profile", name, f"one of {sorted(PROFILES)}")
        return cls.from_dict({**PROFILES[name], **overrides})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CoordinatorConfig:
        """Build from a plain mapping (YAML). ``profile`` names a profile the other keys
        override; ``cost_model`` may be a preset name, a path to a coefficient JSON file, or an
        inline mapping of coefficients."""
        data = dict(data)
        profile = data.pop("profile", None)
        if profile is not None:
            if profile not in PROFILES:
                raise ConfigError("profile", profile, f"one of {sorted(PROFILES)}")
            data = {**PROFILES[profile], **data}
        known = {a.name for a in attrs.fields(cls)}
        unknown = set(data) - known
        if unknown:
            name = sorted(unknown)[0]
            raise ConfigError(
                name, data[name], f"a known field: one of {sorted(known | {'profile'})}"
            )
        cm = data.get("cost_model")
        if isinstance(cm, str | Mapping):
            try:
                data["cost_model"] = CostModel.resolve(cm)
            except CostModelError as exc:
                raise ConfigError(
                    "cost_model", cm, "a preset, a .json path or coefficients", detail=str(exc)
                ) from exc
        return cls(**data)


PAPER: dict[str, Any] = {
    "theta": 0.3,
    "route_max_concurrency": 128,
    "route_kv_limit": 1.0,
    "candidate_order": "reserve",
    "sync_kv_threshold": 0.5,
    "sync_require_starved": False,
    "migration_indicator": "throughput",
    "migration_ratio": 5.0,
    "migration_min_running": 8,
    "migration_amount": "all",
    "migration_during_sync": False,
    "migration_min_speedup": None,
    "migration_move_cost_s": None,
    "preemption_rule": "abort",
    "preempt_abort_waiting": 3,
}

#: Named field sets; see the module docstring.
PROFILES: dict[str, dict[str, Any]] = {
    "default": {},
    "paper": PAPER,
    "robust": {**PAPER, "sync_lag_fraction": 0.5, "partial_order": "gain", "due_first": True},
}
