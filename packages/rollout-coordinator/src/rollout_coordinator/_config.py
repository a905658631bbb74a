"""Coordinator configuration: every threshold a named, validated field with a documented default.

Out-of-range values raise :class:`ConfigError` naming the field and the allowed range; nothing is
clamped. Batch size, group size and η are *not* here: they belong to the staleness protocol and
the coordinator reads them from it, so the two can never disagree.
"""

from __future__ import annotations

from typing import Any

import attrs

from rollout_coordinator.cost_model import QWEN3_30B_A3B_H20, CostModel
from rollout_coordinator.errors import ConfigError

MIGRATION_INDICATORS = ("kv", "running", "waiting", "throughput")


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


def _indicator(inst: Any, a: attrs.Attribute[str], v: str) -> None:
    if v not in MIGRATION_INDICATORS:
        raise ConfigError(a.name, v, f"one of {list(MIGRATION_INDICATORS)}")


def _policy(inst: Any, a: attrs.Attribute[str], v: str) -> None:
    from rollout_coordinator.policies import POLICIES  # late: policies import this module

    if v not in POLICIES:
        raise ConfigError(a.name, v, f"one of {sorted(POLICIES)}")


def _cost_model(inst: Any, a: attrs.Attribute[CostModel], v: CostModel) -> None:
    if not isinstance(v, CostModel):
        raise ConfigError(a.name, v, "a CostModel (a preset, CostModel.load(path) or from_dict)")


@attrs.frozen(kw_only=True)
class CoordinatorConfig:
    """Thresholds of the snapshot–command cycle. Defaults follow the reference runs (DESIGN §5)."""

    #: Policy name from the registry (``rollout_coordinator.policies.POLICIES``).
    policy: str = attrs.field(default="staleflow", validator=_policy)
    #: Cost model used by routing. Default: the Qwen3-30B-A3B/H20 preset.
    cost_model: CostModel = attrs.field(default=QWEN3_30B_A3B_H20, validator=_cost_model)

    # --- routing ---
    #: Accept a route only if its marginal throughput gain is ≥ θ × an empty instance's gain.
    #: In (0, 1]; the reference runs use 0.2–0.5.
    theta: float = attrs.field(default=0.3, validator=_open_unit)
    #: An instance has KV room for a trajectory if its KV usage *after* adding it stays ≤ this.
    route_kv_limit: float = attrs.field(default=0.9, validator=_open_unit)
    #: Hard cap on routes issued in one cycle (bounds the cycle's cost; the rest go next cycle).
    max_routes_per_cycle: int = attrs.field(default=4096, validator=_positive_int)
    #: Stop scanning the queue after this many consecutive trajectories that found no instance.
    route_miss_limit: int = attrs.field(default=256, validator=_positive_int)

    # --- synchronization (per-instance policy) ---
    #: A stale instance syncs only while its KV usage is below this (syncing unlocks routing
    #: only if the instance would have room; a busy instance keeps serving its version).
    sync_kv_threshold: float = attrs.field(default=0.3, validator=_unit)

    # --- migration ---
    #: Migrate when the loaded instance's indicator is ≥ this × the starving one's (> 1; ≈5).
    migration_ratio: float = attrs.field(default=5.0, validator=_above_one)
    #: Load indicator compared by migration: "kv" (KV tokens), "running", "waiting" or
    #: "throughput" (tokens/s from the snapshot).
    migration_indicator: str = attrs.field(default="kv", validator=_indicator)
    #: A loaded instance gives up trajectories only if it runs at least this many.
    migration_min_running: int = attrs.field(default=4, validator=_positive_int)
    #: Bounce (interrupt for re-routing) trajectories on an instance whose engine waiting queue
    #: is at least this long ...
    bounce_waiting_threshold: int = attrs.field(default=8, validator=_positive_int)
    #: ... while its KV usage is at least this (preemption is imminent) ...
    bounce_kv_threshold: float = attrs.field(default=0.95, validator=_unit)
    #: ... at most this many trajectories per instance per cycle.
    bounce_max_per_instance: int = attrs.field(default=8, validator=_positive_int)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CoordinatorConfig:
        """Build from a plain mapping (YAML); ``cost_model`` may be a preset name, a path to a
        coefficient JSON file, or an inline mapping of coefficients."""
        data = dict(data)
        known = {a.name for a in attrs.fields(cls)}
        unknown = set(data) - known
        if unknown:
            name = sorted(unknown)[0]
            raise ConfigError(name, data[name], f"a known field: one of {sorted(known)}")
        cm = data.get("cost_model")
        if isinstance(cm, str):
            from rollout_coordinator.cost_model import PRESETS

            data["cost_model"] = PRESETS[cm] if cm in PRESETS else CostModel.load(cm)
        elif isinstance(cm, dict):
            data["cost_model"] = CostModel.from_dict(cm)
        return cls(**data)
