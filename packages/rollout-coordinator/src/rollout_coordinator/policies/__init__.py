"""Policies: pure strategy functions, composed into named policies by a small registry.

from rollout_coordinator.policies import build_policy, POLICIES
policy = build_policy("staleflow")   # or "sync", "one-step", "coarse-async", "verl-async", ...
"""

from __future__ import annotations

from collections.abc import Callable

from rollout_coordinator.errors import UnknownPolicy
from rollout_coordinator.policies._base import (
    AdmissionGate,
    AdmissionPort,
    CycleView,
    GateState,
    MigrationFn,
    RoutingFn,
    RoutingResult,
    SyncFn,
)
from rollout_coordinator.policies.baselines import (
    Policy,
    all_vanilla,
    coarse_async_baseline,
    coarse_async_drop_baseline,
    one_step_baseline,
    staleflow_policy,
    sync_baseline,
    vanilla_migration,
    vanilla_routing,
    vanilla_sync,
    verl_async_baseline,
)

POLICIES: dict[str, Callable[[], Policy]] = {
    "staleflow": staleflow_policy,
    "sync": sync_baseline,
    "one-step": one_step_baseline,
    "coarse-async": coarse_async_baseline,
    "coarse-async-drop": coarse_async_drop_baseline,
    "verl-async": verl_async_baseline,
    "vanilla-routing": vanilla_routing,
    "vanilla-sync": vanilla_sync,
    "vanilla-migration": vanilla_migration,
    "all-vanilla": all_vanilla,
}


def build_policy(name: str) -> Policy:
    """The named policy; raises UnknownPolicy listing the known names."""
    try:
        factory = POLICIES[name]
    except (KeyError, TypeError):
        raise UnknownPolicy(str(name), list(POLICIES)) from None
    return factory()


__all__ = [
    "POLICIES",
    "AdmissionGate",
    "AdmissionPort",
    "CycleView",
    "GateState",
    "MigrationFn",
    "Policy",
    "RoutingFn",
    "RoutingResult",
    "SyncFn",
    "build_policy",
]
