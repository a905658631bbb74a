"""The control core's configuration, and the one place the staleness protocol is built.

:class:`CoreConfig` holds every setting the core's decisions depend on, as the library
packages' own config records (``staleness_protocol`` and ``rollout_coordinator``) plus the few
the core adds. :func:`core_config` reads it out of the app's config — both the Ray deployment
and the simulator build their core through it, so a setting reaches both or neither.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from rollout_coordinator import CoordinatorConfig
from rollout_coordinator.policies import build_policy
from staleflow_trainer.config_coordinator import verl_window
from staleness_protocol import (
    GcFifo,
    GcFifoConfig,
    ProtocolConfig,
    StalenessProtocol,
    UnboundedConfig,
    UnboundedFifo,
)

ProtocolSpec = ProtocolConfig | UnboundedConfig | GcFifoConfig
#: With dynamic sampling, this many batches' worth of groups filtered in a row stop the run
#: where no limit is set: every reward of every group equal for that long says the data is
#: too easy or too hard for the model, or the reward is constant (verl's DAPO recipe stops
#: after ``max_num_gen_batches`` generation batches without a full one, in the same spirit).
FILTERED_BATCHES_IN_ROW = 20
AnyProtocol = StalenessProtocol | UnboundedFifo


def _positive(inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"CoreConfig.{a.name} must be an integer >= 1, got {v!r}")


def _non_negative(inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < float("inf"):
        raise ValueError(f"CoreConfig.{a.name} must be a finite number >= 0, got {v!r}")


@attrs.frozen(kw_only=True)
class CoreConfig:
    """Everything the control core decides by."""

    #: The staleness protocol: ``ProtocolConfig`` (per-version buffers, bound η),
    #: ``UnboundedConfig`` (no bound, FIFO) or ``GcFifoConfig`` (a FIFO dropping what ages out).
    protocol: ProtocolSpec
    coordinator: CoordinatorConfig
    #: Training steps of the run.
    steps: int = attrs.field(validator=_positive)
    #: Drop a group whose kept members' rewards are all equal (DAPO dynamic sampling), before
    #: it occupies a slot; a replacement prompt is admitted.
    dynamic_sampling: bool = False
    #: Resolve a stuck buffer only after the trainer has waited this long for it.
    stuck_after_s: float = attrs.field(default=5.0, validator=_non_negative)
    #: A checkpoint every this many steps (and after the last); 0 = only after the last.
    checkpoint_every: int = attrs.field(default=0, validator=_non_negative)
    #: Consecutive failed syncs of one instance tolerated; one more halts the run.
    sync_retries: int = attrs.field(default=5, validator=_non_negative)
    #: Dataset rows the prompt feed draws from; None = an unbounded synthetic stream (row =
    #: group serial, the simulator's prompt stream).
    rows: int | None = None
    seed: int = 0
    shuffle: bool = True
    #: Keep at least this many batches of never-admitted groups queued.
    feed_batches: int = attrs.field(default=1, validator=_positive)
    #: At most this many queued trajectories are offered to the coordinator per cycle (None:
    #: the whole queue).
    queue_view_limit: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive)
    )
    #: Rewards failed in a row (after the workers' retries) that stop the run.
    reward_failures_in_row: int = attrs.field(default=100, validator=_positive)
    #: With ``dynamic_sampling``: groups filtered in a row that stop the run (None:
    #: :data:`FILTERED_BATCHES_IN_ROW` x ``batch_size``).
    filtered_in_row: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive)
    )
    #: Send the trainer each group settled in the batch it takes next before the batch is
    #: complete (:mod:`.stream`).
    stream_batch: bool = False
    #: Steps over which ``gen_tokens_per_s`` is averaged.
    rate_window_steps: int = attrs.field(default=5, validator=_positive)

    @property
    def batch_size(self) -> int:
        return self.protocol.batch_size

    @property
    def group_size(self) -> int:
        return self.protocol.group_size

    @property
    def filtered_limit(self) -> int:
        """Groups filtered in a row that stop the run (``filtered_in_row``, or its default)."""
        given = self.filtered_in_row
        return FILTERED_BATCHES_IN_ROW * self.batch_size if given is None else given

    @property
    def members(self) -> int:
        """Trajectories submitted per group: ``n' = n + group_redundancy``."""
        return self.protocol.group_size + self.protocol.group_redundancy


def build_protocol(spec: ProtocolSpec, *, start_version: int = 0) -> AnyProtocol:
    """A fresh protocol for ``spec``, its first published version ``start_version``."""
    if isinstance(spec, GcFifoConfig):
        return GcFifo(spec, start_version=start_version)
    if isinstance(spec, UnboundedConfig):
        return UnboundedFifo(spec, start_version=start_version)
    return StalenessProtocol(spec, start_version=start_version)


def protocol_mode(spec: ProtocolSpec) -> str:
    """``"buffers"``, ``"unbounded"`` or ``"gc-fifo"``."""
    if isinstance(spec, GcFifoConfig):
        return "gc-fifo"
    return "unbounded" if isinstance(spec, UnboundedConfig) else "buffers"


#: protocol settings -> the config key a user changes them with
_KEYS = {
    "batch_size": "protocol.batch_size",
    "group_size": "protocol.group_size",
    "eta": "protocol.eta",
    "batch_redundancy": "protocol.batch_redundancy",
    "group_redundancy": "protocol.group_redundancy",
    "filtering": "trainer.dynamic_sampling",
    "stuck_threshold": "protocol.stuck_threshold",
    "max_inflight_groups": "protocol.unbounded_inflight_batches (eta 'unbounded'), or "
    "protocol.eta / coordinator.verl_staleness_threshold (verl-async's window)",
}


def check_resumable(restored: AnyProtocol, spec: ProtocolSpec) -> None:
    """Refuse to resume a protocol state under a config that would run it differently (a
    different mode, η, batch or group size, redundancy, ...): the checkpoint was written under
    its own rules, and changing them mid-run would break the bound or lose admitted work.
    Raises :class:`~staleflow_trainer.errors.CheckpointError` naming every differing key."""
    import attrs

    from staleflow_trainer.errors import CheckpointError

    have, want = protocol_mode(restored.config), protocol_mode(spec)
    if have != want:
        raise CheckpointError(
            f"the checkpoint's protocol runs in mode {have!r} ({_describe(restored.config)}) but "
            f"the config asks for {want!r} ({_describe(spec)}); resume with the settings the "
            "run was started with (protocol.eta, coordinator.policy), or start a new run "
            "(run.resume=never). A verl-async checkpoint from before verl-async ran over a "
            "FIFO without a bound ('gc-fifo') cannot be resumed by this version"
        )
    old, new = attrs.asdict(restored.config), attrs.asdict(spec)
    diff = [f"{config_key(k)}: checkpoint {old[k]!r}, config {new.get(k)!r}"
            for k in old if old[k] != new.get(k)]  # fmt: skip
    if diff:
        raise CheckpointError(
            "the config changes the protocol of the run it resumes: "
            + "; ".join(diff)
            + ". Resume with the checkpoint's values, or start a new run (run.resume=never)"
        )


def _describe(spec: ProtocolSpec) -> str:
    eta = getattr(spec, "eta", None)
    if eta is None and isinstance(spec, UnboundedConfig):
        cap = spec.max_inflight_groups
        return f"no eta, at most {cap} groups in flight, batch_size={spec.batch_size}"
    return f"eta={eta}, batch_size={spec.batch_size}"


def coordinator_config(cfg: Any) -> CoordinatorConfig:
    """The coordinator's config from the app's: ``coordinator.profile`` with the strategy fields
    the app config sets on top (``AppConfig.coordinator.strategy_overrides``), the policy and the
    routing cost model (a preset or a fitted JSON file, read here)."""
    c = cfg.coordinator
    return CoordinatorConfig.from_dict(
        {
            "profile": c.profile,
            "policy": c.policy,
            "cost_model": c.cost_model,
            **c.strategy_overrides(),
        }
    )


def protocol_spec(cfg: Any) -> ProtocolSpec:
    """The staleness protocol's config from the app's: per-version buffers, or the FIFO of
    ``eta: unbounded``, verl-async (its window ``s`` sizes the FIFO's cap) or a policy that
    drops what ages out. The one place it is built: ``core_config`` for a run, and the app's
    config at load (so the package's own checks refuse a bad value before a run starts)."""
    from staleflow_trainer.config import GC_FIFO_POLICIES, stuck_threshold

    p = cfg.protocol
    filtering = cfg.trainer.dynamic_sampling
    s = _window(cfg)
    if s is not None:
        # the FIFO's own cap sits above the most verl's window admits ((1 + s)·B groups not
        # yet consumed), so the window always binds first
        return UnboundedConfig(
            batch_size=p.batch_size,
            group_size=p.group_size,
            max_inflight_groups=(math.floor(s) + 2) * p.batch_size,
            group_redundancy=p.group_redundancy,
            filtering=filtering,
        )
    if p.eta == "unbounded":
        return UnboundedConfig(
            batch_size=p.batch_size,
            group_size=p.group_size,
            max_inflight_groups=p.inflight_batches * p.batch_size,
            group_redundancy=p.group_redundancy,
            filtering=filtering,
        )
    if cfg.coordinator.policy in GC_FIFO_POLICIES:
        # its own cap is (η + 1)·B groups in flight, so the policy's (η + v + 1)·B budget gate,
        # which also counts finished groups, always binds first
        return GcFifoConfig(
            batch_size=p.batch_size,
            group_size=p.group_size,
            eta=int(p.eta),
            max_inflight_groups=(int(p.eta) + 1) * p.batch_size,
            group_redundancy=p.group_redundancy,
            filtering=filtering,
        )
    return ProtocolConfig(
        batch_size=p.batch_size,
        group_size=p.group_size,
        eta=int(p.eta),
        batch_redundancy=p.batch_redundancy,
        group_redundancy=p.group_redundancy,
        filtering=filtering,
        stuck_threshold=stuck_threshold(cfg) or None,
    )


def _window(cfg: Any) -> float | None:
    """verl-async's window ``s`` where the policy runs over a FIFO under a window (η sets it
    unless ``coordinator.verl_staleness_threshold`` does); None for every other run."""
    if cfg.protocol.eta == "unbounded" or build_policy(cfg.coordinator.policy).protocol != "fifo":
        return None
    return verl_window(cfg.protocol.eta, cfg.coordinator.verl_staleness_threshold)


def config_key(field: str) -> str:
    """The app config key that sets the staleness protocol's ``field``."""
    return _KEYS.get(field, f"protocol.{field}")


def streams(cfg: Any) -> bool:
    """Does the run stream the next batch into its trainer (``trainer.stream_batch``)? Not in
    the simulator's colocated ``sync``: its trainer's GPUs generate until the batch is
    complete, so nothing can start early (the setting is documented to do nothing there)."""
    from staleflow_trainer.config_sim import colocated

    sim = cfg.rollout.backend == "sim"
    return bool(cfg.trainer.stream_batch) and not (sim and colocated(cfg.coordinator.policy))


def core_config(cfg: Any, *, rows: int | None) -> CoreConfig:
    """The core's config from the app's (``staleflow_trainer.config.AppConfig``): the one
    place both shells read their decisions' settings from. ``rows``: the dataset size (None
    for the simulator's unbounded prompt stream)."""
    from staleflow_trainer.config import stuck_after_s

    coordinator = coordinator_config(cfg)
    s = _window(cfg)
    if s is not None:  # verl-async runs by the window its FIFO's cap is sized for
        coordinator = attrs.evolve(coordinator, verl_staleness_threshold=s)
    return CoreConfig(
        protocol=protocol_spec(cfg),
        coordinator=coordinator,
        steps=cfg.trainer.steps,
        dynamic_sampling=cfg.trainer.dynamic_sampling,
        stuck_after_s=stuck_after_s(cfg),
        checkpoint_every=cfg.run.checkpoint_every,
        sync_retries=cfg.coordinator.sync_retries,
        reward_failures_in_row=cfg.reward.max_failures_in_row,
        filtered_in_row=cfg.trainer.max_filtered_in_row,
        stream_batch=streams(cfg),
        rows=rows,
        seed=cfg.run.seed,
        shuffle=cfg.data.shuffle,
    )
