"""The ``coordinator`` section of the app's config and the policy facts it names.

Policies, strategy profiles, strategy fields and routing cost models belong to the
``rollout_coordinator`` package: this module only says which of them the app config may set,
and checks a setting by building the package's own config from it, so the package's ranges and
its cost-model reader are the only ones (a fitted ``.json`` cost model is read when the config
is loaded, so a missing or malformed file fails there, naming ``coordinator.cost_model``).
"""

from __future__ import annotations

import typing
from typing import Any, ClassVar, Literal

import attrs

from engine_adapters.cost_model import PRESETS as COST_PRESETS
from rollout_coordinator import PROFILES as STRATEGY_PROFILES
from rollout_coordinator import CoordinatorConfig as _PackageCoordinatorConfig
from rollout_coordinator.errors import ConfigError as _PackageConfigError
from rollout_coordinator.policies import POLICIES as _POLICY_REGISTRY
from rollout_coordinator.policies import build_policy
from staleflow_trainer.config_schema import check_known
from staleflow_trainer.config_schema import field as _f
from staleflow_trainer.config_schema import section as _section
from staleflow_trainer.errors import ConfigError

# Policy facts come from the coordinator's registry (one place).
POLICIES: tuple[str, ...] = tuple(_POLICY_REGISTRY)
#: Policies whose η is fixed by the system they model (``sync``: 0, ``one-step``: 1).
FIXED_ETA: dict[str, int] = {
    p: eta for p in POLICIES if (eta := build_policy(p).required_eta) is not None
}
#: Policies that model another system: in a comparison they run without StaleFlow's own
#: protocol mechanisms (redundant rollout, stuck-buffer resolution).
BASELINE_POLICIES: tuple[str, ...] = tuple(p for p in POLICIES if build_policy(p).baseline)
#: Policies whose η is kept by ``staleness_protocol.GcFifo`` (a FIFO that drops what ages out)
#: rather than by the buffers.
GC_FIFO_POLICIES: tuple[str, ...] = tuple(
    p for p in POLICIES if build_policy(p).protocol == "gc-fifo"
)
#: Policies over a FIFO that keeps no η (``UnboundedFifo``): verl-async, whose window, sized
#: by ``protocol.eta`` unless ``coordinator.verl_staleness_threshold`` is set, limits admission.
WINDOW_POLICIES: tuple[str, ...] = tuple(p for p in POLICIES if build_policy(p).protocol == "fifo")
#: Policies that run over one FIFO (``GcFifo`` or ``UnboundedFifo``), not per-version buffers.
FIFO_POLICIES: tuple[str, ...] = tuple(
    p for p in POLICIES if build_policy(p).protocol in ("gc-fifo", "fifo")
)


def verl_window(eta: int | str, threshold: float | None) -> float:
    """verl-async's window ``s``: ``coordinator.verl_staleness_threshold``, or the integer
    ``protocol.eta`` where that is null."""
    return float(eta) if threshold is None else float(threshold)


COST_MODEL_PRESETS = tuple(sorted(COST_PRESETS))
#: Policies ``protocol.eta: unbounded`` runs with: greedy global sync on publish and admission
#: by the protocol alone (its in-flight cap), as systems without a staleness guarantee do.
UNBOUNDED_POLICIES = ("all-vanilla", "vanilla-sync")


#: The strategy fields of ``rollout_coordinator.CoordinatorConfig`` the ``coordinator`` section
#: may set. Each defaults to null: the value of ``coordinator.profile`` (the package holds the
#: defaults, the ranges and the profiles; the app only passes what the user set). ``off`` unsets
#: a field a profile turns on where the package field takes None (:data:`_UNSETTABLE`);
#: elsewhere it is passed on as it is (``preemption_rule: off`` is a rule of its own).
STRATEGY_FIELDS = (
    "theta",
    "route_kv_limit",
    "route_max_concurrency",
    "theta_slack",
    "theta_slack_batches",
    "due_first",
    "due_placement",
    "candidate_order",
    "partial_order",
    "max_routes_per_cycle",
    "route_miss_limit",
    "sync_kv_threshold",
    "sync_load_threshold",
    "sync_require_starved",
    "sync_max_lag",
    "sync_lag_fraction",
    "migration_ratio",
    "migration_indicator",
    "migration_min_running",
    "migration_amount",
    "migration_during_sync",
    "migration_min_speedup",
    "migration_move_cost_s",
    "due_spread_ratio",
    "due_spread_max_running",
    "preemption_rule",
    "preempt_abort_waiting",
    "bounce_waiting_threshold",
    "bounce_kv_threshold",
    "bounce_max_per_instance",
    "verl_staleness_threshold",
    "verl_max_concurrent_groups_per_instance",
)


#: The strategy fields whose package field takes None (off), read from its type annotations.
_UNSETTABLE = frozenset(
    a.name
    for a in attrs.fields(attrs.resolve_types(_PackageCoordinatorConfig))
    if type(None) in typing.get_args(a.type)
)


@_section("coordinator")
@attrs.frozen(kw_only=True)
class CoordinatorConfig:
    """The coordinator: policy, routing cost model, a strategy profile and overrides of it.

    Strategy fields are those of ``rollout_coordinator.CoordinatorConfig`` (see
    :data:`STRATEGY_FIELDS`); null takes the profile's value. They are validated by building
    the package's config, so its ranges are the only ones."""

    __section__: ClassVar[str]
    policy: str = _f("staleflow", doc="a policy of the coordinator's registry")
    cost_model: str = _f(
        "qwen3-30b-a3b-h20", doc="routing cost model: a preset name or a fitted JSON file"
    )
    profile: str = _f("default", doc="strategy profile (rollout_coordinator PROFILES)")
    theta: float | None = _f(None, doc="min marginal-gain fraction to route")
    theta_slack: float | Literal["off"] | None = _f(
        None, doc="theta for an instance whose work all has slack in the eta window"
    )
    theta_slack_batches: int | None = _f(
        None,
        doc="theta_slack: an instance holding work the next this many batches need keeps theta",
    )
    due_first: bool | None = _f(
        None, doc="due work skips theta; a theta refusal holds for longer work only"
    )
    due_placement: str | None = _f(
        None, doc="due partials: gain (by marginal gain) or headroom (lowest KV usage)"
    )
    route_kv_limit: float | None = _f(None, doc="route only while KV usage after it stays <=")
    route_max_concurrency: int | Literal["off"] | None = _f(None, doc="running cap per instance")
    candidate_order: str | None = _f(None, doc="new groups: oldest or reserve (newest) first")
    partial_order: str | None = _f(None, doc="partials: version (oldest first) or gain")
    max_routes_per_cycle: int | None = _f(None)
    route_miss_limit: int | None = _f(None)
    sync_kv_threshold: float | None = _f(None, doc="per-instance sync only below this KV usage")
    sync_load_threshold: float | Literal["off"] | None = _f(
        None, doc="... and below this share of the load the cost-model router gives it"
    )
    sync_require_starved: bool | None = _f(None, doc="... and only without work at its version")
    sync_max_lag: int | Literal["off"] | None = _f(None, doc="sync at once at this lag")
    sync_lag_fraction: float | Literal["off"] | None = _f(None, doc="lag bound as a share of eta")
    migration_ratio: float | None = _f(None, doc="load ratio that triggers migration")
    migration_indicator: str | None = _f(None, doc="kv, running, waiting or throughput")
    migration_min_running: int | None = _f(None)
    migration_amount: str | None = _f(None, doc="half_gap or all")
    migration_during_sync: bool | None = _f(None)
    migration_min_speedup: float | Literal["off"] | None = _f(
        None, doc="migrate only for a predicted decode speedup of at least this"
    )
    migration_move_cost_s: float | Literal["off"] | None = _f(
        None,
        doc="... and only if the time it saves the moved work is at least this many seconds "
        "(what a move costs: about two control cycles; scale it with snapshot_interval_s)",
    )
    due_spread_ratio: float | Literal["off"] | None = _f(
        None,
        doc="move due work off an instance whose step is at least this many times its step "
        "alone, onto a light one",
    )
    due_spread_max_running: int | None = _f(None, doc="... light: running at most this many")
    # Literal["off"] too: YAML 1.1 reads an unquoted off as false, which it turns back into "off"
    preemption_rule: str | Literal["off"] | None = _f(None, doc="bounce, abort or off")
    preempt_abort_waiting: int | None = _f(None)
    bounce_waiting_threshold: int | None = _f(None)
    bounce_kv_threshold: float | None = _f(None)
    bounce_max_per_instance: int | None = _f(None)
    verl_staleness_threshold: float | None = _f(None, doc="verl-async window (null: eta)")
    verl_max_concurrent_groups_per_instance: int | None = _f(None)
    snapshot_interval_s: float = _f(
        0.05,
        gt=0.0,
        doc="control cycle period: poll instances, decide (virtual s in the simulator)",
    )
    sync_retries: int = _f(
        5, ge=0, doc="consecutive failed syncs of one instance tolerated; one more fails the run"
    )
    sync_retry_backoff_s: float = _f(
        0.5, ge=0.0, doc="delay before retrying a failed sync; doubles per failure, at most 30 s"
    )
    sync_timeout_s: float = _f(
        600.0,
        gt=0.0,
        doc="a sync not done by then means a hung instance: its actor is killed and it is lost",
    )
    call_timeout_s: float = _f(
        120.0,
        gt=0.0,
        doc="an interrupt, or a call that stops an instance (at the end of the run, or when a "
        "replacement control actor takes over), not answered by then means a hung instance: its "
        "actor is killed and it is lost (an interrupt may wait 30 s for its generations)",
    )
    poll_timeout_s: float = _f(
        30.0,
        gt=0.0,
        doc="a poll or route not answered by then means a hung instance: its actor is killed "
        "and it is lost (a well instance answers a poll at once, once its finished results are "
        "written to the trajectory server, and a route once the server handed it the work; "
        "each of its requests there waits a third of this, 60 s at most, so a stalled server "
        "fails the call before the limit; a failed poll is tried again)",
    )
    instance_error_limit: int = _f(
        3,
        ge=1,
        doc="polls of a live instance that may fail in a row (2 s apart); at this many its "
        "actor is killed and it is lost (a failed route or interrupt: at once)",
    )
    generate_error_limit: int = _f(
        16,
        ge=1,
        doc="prompts whose generations may fail in a row on a live instance, none returning "
        "between (an error of the request itself, such as a prompt too long, does not count); "
        "at this many, with no trajectory gaining a token on its engine, the instance ends "
        "itself as unable to serve and is lost",
    )

    def __attrs_post_init__(self) -> None:
        check_known(self.policy, POLICIES, "coordinator.policy", "policy")
        check_known(self.cost_model, COST_MODEL_PRESETS, "coordinator.cost_model",
                    "cost-model preset", json_ok=True)  # fmt: skip
        check_known(self.profile, sorted(STRATEGY_PROFILES), "coordinator.profile", "profile")
        self._check_read_by_policy()
        try:  # the package's own checks; a fitted .json cost model is read here, at load
            _PackageCoordinatorConfig.from_dict(
                {
                    "profile": self.profile,
                    "policy": self.policy,
                    "cost_model": self.cost_model,
                    **self.strategy_overrides(),
                }
            )
        except _PackageConfigError as e:
            key, off = f"coordinator.{e.field}", e.field in _UNSETTABLE
            # the package spells "off" None; this file takes ``off``
            allowed = e.allowed.replace("None (off)", "off") if off else e.allowed
            value = "off" if off and e.value is None else repr(e.value)
            detail = f" ({e.detail})" if e.detail else ""
            raise ConfigError(
                f"{key} must be {allowed}, got {value}{detail}", key=key, allowed=allowed
            ) from None

    def _check_read_by_policy(self) -> None:
        """A strategy field set here that no strategy of the policy reads would change
        nothing: refused, naming the policies that do read it (``Policy.reads``, the
        registry's own record)."""
        reads = build_policy(self.policy).reads
        for name in self.strategy_overrides():
            if name in reads:
                continue
            readers = [p for p in POLICIES if name in build_policy(p).reads]
            key = f"coordinator.{name}"
            raise ConfigError(
                f"{key} is set, but policy {self.policy!r} does not read it (its strategies "
                f"read {sorted(reads & set(STRATEGY_FIELDS))}); it applies to "
                f"{readers or 'no policy'}",
                key=key,
                allowed=f"null (unset) with policy {self.policy!r}, or a policy of {readers}",
            )

    @property
    def store_wait_s(self) -> float:
        """How long a rollout instance waits on the trajectory server at a time (to connect,
        send, get an answer): a third of ``poll_timeout_s``, 60 s at most. A write is tried
        twice, so a stalled server fails the poll that writes before the poll's limit."""
        return min(60.0, self.poll_timeout_s / 3)

    def strategy_overrides(self) -> dict[str, Any]:
        """The strategy fields set here (null ones left to the profile; ``off`` → None where
        the package field takes None)."""
        out: dict[str, Any] = {}
        for name in STRATEGY_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = None if value == "off" and name in _UNSETTABLE else value
        return out
