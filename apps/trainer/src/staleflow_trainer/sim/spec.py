"""SimSpec: every knob of one simulated run, resolved and validated, independent of YAML.

The app's :class:`~staleflow_trainer.config.AppConfig` is the user-facing schema; the simulator
reads it once (:func:`spec_from_app_config`) into this flat record so the event loop, the
comparison and the planner can vary one field (policy, η, split) with ``attrs.evolve`` and
nothing else. Every constant of the timing models lives here.

Time models
-----------
* Trainer step, ``trainer_model="linear"``: ``a + b·tokens``.
* Trainer step, ``trainer_model="flops"``: ``8 · active_params · tokens /
  (train_gpus · peak_flops_per_gpu · mfu) + train_overhead_s`` (forward + backward + one forward
  for the old log-probs: 2 + 4 + 2 FLOPs per parameter per token).
* Param push (trainer → param server) and pull (param server → instance):
  ``model_bytes / bandwidth + transfer_overhead_s``. The push follows every step and blocks the
  trainer (its ranks write their shards); a pull is the instance's weight load.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from engine_adapters.cost_model import PRESETS as COST_PRESETS
from staleflow_trainer.config import (
    BASELINE_POLICIES,
    FIXED_ETA,
    GC_FIFO_POLICIES,
    POLICIES,
    UNBOUNDED_POLICIES,
)
from staleflow_trainer.errors import ConfigError

_PROTOCOL = ("eta", "unbounded_inflight_batches", "batch_size", "group_size", "stuck_threshold",
             "stuck_after_s", "batch_redundancy", "group_redundancy")  # fmt: skip
_WORKLOAD = ("prompt_len", "prompt_len_sigma", "response_len_median", "response_len_sigma",
             "group_correlation", "reward_mean")  # fmt: skip

#: The app config key each :class:`SimSpec` field is read from (see
#: :func:`spec_from_app_config`), for error messages that name keys a user can set. Fields
#: not listed are ``sim.<field>``.
CONFIG_KEYS: dict[str, str] = {
    **{f: f"protocol.{f}" for f in _PROTOCOL},
    **{f: f"sim.workload.{f}" for f in _WORKLOAD},
    "policy": "coordinator.policy",
    "steps": "trainer.steps",
    "seed": "run.seed",
    "dynamic_sampling": "trainer.dynamic_sampling",
    "k_inner": "sim.b",
    "max_running": "rollout.max_running",
    "prompt_len_max": "data.max_prompt_len",
    "max_response_len": "rollout.sampling.max_new_tokens",
    "cycle_period_s": "coordinator.snapshot_interval_s",
    "theta": "coordinator.theta",
    "migration_ratio": "coordinator.migration_ratio",
    "sync_kv_threshold": "coordinator.sync_kv_threshold",
    "timeline": "metrics.timeline",
}


def config_key(field: str) -> str:
    """The app config key of the :class:`SimSpec` field ``field``."""
    return CONFIG_KEYS.get(field, f"sim.{field}")


def _ge(low: float) -> Any:
    def check(inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
        if isinstance(v, bool) or not isinstance(v, int | float) or not v >= low:
            raise ConfigError(
                f"{config_key(a.name)} must be >= {low}, got {v!r}",
                key=config_key(a.name),
                allowed=f">= {low}",
            )
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(
                f"{config_key(a.name)} must be finite, got {v!r}",
                key=config_key(a.name),
                allowed="a finite number",
            )

    return check


def _check_eta(inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
    if v == "unbounded":
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(
            f"protocol.eta must be an int >= 0 or 'unbounded', got {v!r}",
            key="protocol.eta",
            allowed="an int >= 0 or 'unbounded'",
        )


def _gt(low: float) -> Any:
    def check(inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
        if (
            isinstance(v, bool)
            or not isinstance(v, int | float)
            or not v > low
            or not math.isfinite(v)
        ):
            raise ConfigError(
                f"{config_key(a.name)} must be > {low}, got {v!r}",
                key=config_key(a.name),
                allowed=f"> {low}",
            )

    return check


def _one_of(*choices: str) -> Any:
    def check(inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
        if v not in choices:
            raise ConfigError(
                f"{config_key(a.name)} must be one of {list(choices)}, got {v!r}",
                key=config_key(a.name),
                allowed=", ".join(choices),
            )

    return check


@attrs.frozen(kw_only=True)
class SimSpec:
    """One simulated run. Units: seconds, tokens, bytes, FLOP/s."""

    # --- what runs
    policy: str = attrs.field(default="staleflow", validator=_one_of(*POLICIES))
    #: The staleness bound, or "unbounded": no staleness control (``UnboundedFifo``: FIFO
    #: consumption, at most ``unbounded_inflight_batches × batch_size`` groups in flight).
    eta: int | str = attrs.field(default=1, validator=_check_eta)
    unbounded_inflight_batches: int = attrs.field(default=2, validator=_gt(0))
    steps: int = attrs.field(default=20, validator=_gt(0))
    seed: int = attrs.field(default=0, validator=_ge(0))
    batch_size: int = attrs.field(default=8, validator=_gt(0))
    group_size: int = attrs.field(default=8, validator=_gt(0))
    stuck_threshold: int = attrs.field(default=0, validator=_ge(0))  # 0 = off
    #: Resolve a stuck buffer only after the trainer has waited this long for it.
    stuck_after_s: float = attrs.field(default=5.0, validator=_ge(0))
    #: Redundant rollout: spare slots per buffer (``B' = B + this``; surplus groups are
    #: aborted once a buffer is READY) ...
    batch_redundancy: int = attrs.field(default=0, validator=_ge(0))
    #: ... and extra samples per group (``n' = n + this``; the slowest are aborted once ``n``
    #: finish). The prompt stream always draws ``n'`` members so every policy sees the same
    #: first ``n`` responses of every group.
    group_redundancy: int = attrs.field(default=0, validator=_ge(0))
    dynamic_sampling: bool = False

    # --- GPU budget
    total_gpus: int = attrs.field(default=2, validator=_gt(0))
    #: Disaggregated split (ignored by the colocated ``sync`` policy, which uses all GPUs).
    rollout_gpus: int = attrs.field(default=1, validator=_gt(0))
    train_gpus: int = attrs.field(default=1, validator=_gt(0))
    gpus_per_instance: int = attrs.field(default=1, validator=_gt(0))

    # --- engines
    cost_model: str = "custom"
    k1: float = attrs.field(default=1e-7, validator=_ge(0))
    k2: float = attrs.field(default=2e-3, validator=_ge(0))
    k3: float = attrs.field(default=5e-5, validator=_ge(0))
    k4: float = attrs.field(default=2e-4, validator=_ge(0))
    k_inner: float = attrs.field(default=0.0, validator=_ge(0))
    max_running: int = attrs.field(default=64, validator=_gt(0))
    kv_capacity_tokens: int = attrs.field(default=65_536, validator=_gt(0))
    prefill_s_per_token: float = attrs.field(default=0.0, validator=_ge(0))

    # --- workload (response lengths: capped lognormal, group-correlated)
    prompt_len: int = attrs.field(default=256, validator=_gt(0))  # median
    prompt_len_max: int = attrs.field(default=512, validator=_gt(0))
    prompt_len_sigma: float = attrs.field(default=0.3, validator=_ge(0))
    response_len_median: int = attrs.field(default=1000, validator=_gt(0))
    response_len_sigma: float = attrs.field(default=1.0, validator=_ge(0))
    max_response_len: int = attrs.field(default=4096, validator=_gt(0))
    group_correlation: float = attrs.field(default=0.5, validator=_ge(0))
    reward_mean: float = attrs.field(default=0.5, validator=_ge(0))

    # --- trainer and transfers
    trainer_model: str = attrs.field(default="linear", validator=_one_of("linear", "flops"))
    trainer_time_a_s: float = attrs.field(default=0.5, validator=_ge(0))
    trainer_time_b_s_per_token: float = attrs.field(default=1e-5, validator=_ge(0))
    active_params: float = attrs.field(default=3e9, validator=_gt(0))
    peak_flops_per_gpu: float = attrs.field(default=148e12, validator=_gt(0))
    mfu: float = attrs.field(default=0.3, validator=_gt(0))
    train_overhead_s: float = attrs.field(default=5.0, validator=_ge(0))
    model_bytes: int = attrs.field(default=100_000_000, validator=_gt(0))
    push_bandwidth_gb_s: float = attrs.field(default=10.0, validator=_gt(0))
    pull_bandwidth_gb_s: float = attrs.field(default=10.0, validator=_gt(0))
    transfer_overhead_s: float = attrs.field(default=0.01, validator=_ge(0))
    reward_time_s: float = attrs.field(default=0.0, validator=_ge(0))

    # --- coordinator
    cycle_period_s: float = attrs.field(default=0.1, validator=_gt(0))
    #: An instance with no event or command since its last snapshot is re-snapshotted only
    #: after this long (0 = every cycle).
    snapshot_max_age_s: float = attrs.field(default=0.0, validator=_ge(0))
    theta: float = attrs.field(default=0.3, validator=_gt(0))
    migration_ratio: float = attrs.field(default=5.0, validator=_gt(1))
    sync_kv_threshold: float = attrs.field(default=0.3, validator=_ge(0))

    # --- measurement
    #: Steps excluded from throughput (pipeline fill); tokens/s counts steps after these.
    warmup_steps: int = attrs.field(default=2, validator=_ge(0))
    timeline: bool = True

    def __attrs_post_init__(self) -> None:
        if self.eta == "unbounded" and self.policy not in UNBOUNDED_POLICIES:
            raise ConfigError(
                f"policy {self.policy!r} cannot run eta 'unbounded' (no staleness control "
                "syncs greedily)",
                key="coordinator.policy",
                allowed=f"one of {list(UNBOUNDED_POLICIES)}",
            )
        if self.eta == "unbounded" and self.policy in GC_FIFO_POLICIES:
            raise ConfigError(
                f"policy {self.policy!r} keeps a bound by dropping; it needs an integer eta",
                key="protocol.eta",
                allowed="an int >= 0",
            )
        if self.eta == "unbounded" and self.batch_redundancy:
            raise ConfigError(
                f"batch_redundancy {self.batch_redundancy} means nothing with eta 'unbounded'",
                key="protocol.batch_redundancy",
                allowed="0 with eta 'unbounded'",
            )
        if self.policy in FIXED_ETA and self.eta != FIXED_ETA[self.policy]:
            raise ConfigError(
                f"policy {self.policy!r} models a fixed staleness: eta must be "
                f"{FIXED_ETA[self.policy]}, got {self.eta}",
                key="protocol.eta",
                allowed=str(FIXED_ETA[self.policy]),
            )
        if self.policy != "sync" and self.rollout_gpus + self.train_gpus > self.total_gpus:
            raise ConfigError(
                f"sim.rollout_gpus ({self.rollout_gpus}) + sim.train_gpus ({self.train_gpus}) "
                f"exceed sim.total_gpus ({self.total_gpus})",
                key="sim.rollout_gpus",
                allowed=f"<= {self.total_gpus - self.train_gpus}",
            )
        if self.warmup_steps >= self.steps:
            raise ConfigError(
                f"sim.warmup_steps ({self.warmup_steps}) must be < trainer.steps ({self.steps})",
                key="sim.warmup_steps",
                allowed=f"< {self.steps}",
            )
        if self.prompt_len_max + self.max_response_len > self.kv_capacity_tokens:
            raise ConfigError(
                f"one full trajectory ({self.prompt_len_max} + {self.max_response_len} tokens) "
                f"must fit in sim.kv_capacity_tokens={self.kv_capacity_tokens}",
                key="sim.kv_capacity_tokens",
                allowed=f">= {self.prompt_len_max + self.max_response_len}",
            )
        if self.stuck_threshold and self.stuck_threshold >= self.batch_size:
            raise ConfigError(
                f"protocol.stuck_threshold ({self.stuck_threshold}) must be < batch_size "
                f"({self.batch_size}) or 0 (off)",
                key="protocol.stuck_threshold",
                allowed=f"0..{self.batch_size - 1}",
            )
        if self.reward_mean > 1 or self.group_correlation > 1 or self.sync_kv_threshold > 1:
            raise ConfigError(
                "sim.workload.reward_mean, sim.workload.group_correlation and "
                "coordinator.sync_kv_threshold must be <= 1",
                key="sim.workload.reward_mean",
                allowed="[0, 1]",
            )
        if self.prompt_len > self.prompt_len_max:
            raise ConfigError(
                f"sim.workload.prompt_len ({self.prompt_len}) exceeds data.max_prompt_len "
                f"({self.prompt_len_max}); a config written for real engines keeps its prompts "
                "short: set sim.workload.prompt_len, or raise data.max_prompt_len",
                key="sim.workload.prompt_len",
                allowed=f"<= {self.prompt_len_max} (data.max_prompt_len)",
            )

    # ---- derived ----------------------------------------------------------------------------

    @property
    def colocated(self) -> bool:
        return self.policy == "sync"

    @property
    def rollout_gpus_used(self) -> int:
        return self.total_gpus if self.colocated else self.rollout_gpus

    @property
    def train_gpus_used(self) -> int:
        return self.total_gpus if self.colocated else self.train_gpus

    @property
    def num_instances(self) -> int:
        return max(1, self.rollout_gpus_used // self.gpus_per_instance)

    @property
    def max_model_len(self) -> int:
        return self.prompt_len_max + self.max_response_len

    def train_seconds(self, tokens: int) -> float:
        """Modeled compute time of one training step on ``tokens`` (prompt + response)."""
        if self.trainer_model == "linear":
            return self.trainer_time_a_s + self.trainer_time_b_s_per_token * tokens
        flops = 8.0 * self.active_params * tokens
        rate = self.train_gpus_used * self.peak_flops_per_gpu * self.mfu
        return flops / rate + self.train_overhead_s

    @property
    def push_seconds(self) -> float:
        return self.model_bytes / (self.push_bandwidth_gb_s * 1e9) + self.transfer_overhead_s

    @property
    def pull_seconds(self) -> float:
        return self.model_bytes / (self.pull_bandwidth_gb_s * 1e9) + self.transfer_overhead_s

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def spec_from_app_config(cfg: Any) -> SimSpec:
    """Read the simulator's fields out of an ``AppConfig``.

    ``rollout.sampling.max_new_tokens`` is the response cap, ``data.max_prompt_len`` the prompt
    cap, ``rollout.max_running`` the per-instance batch limit; ``sim.cost_model`` (a preset,
    or ``custom`` with ``sim.k1..k4, b``) is the engines' true cost.
    """
    sim = cfg.sim
    wl = sim.workload
    proto = cfg.protocol
    coord = cfg.coordinator
    policy = coord.policy
    if sim.cost_model == "custom":
        coeffs = {"k1": sim.k1, "k2": sim.k2, "k3": sim.k3, "k4": sim.k4, "k_inner": sim.b or 0.0}
    else:
        cm = COST_PRESETS[sim.cost_model]
        coeffs = {"k1": cm.k1, "k2": cm.k2, "k3": cm.k3, "k4": cm.k4, "k_inner": cm.b}
    return SimSpec(
        policy=policy,
        eta=proto.eta,
        unbounded_inflight_batches=proto.unbounded_inflight_batches,
        steps=cfg.trainer.steps,
        seed=cfg.run.seed,
        batch_size=proto.batch_size,
        group_size=proto.group_size,
        stuck_threshold=proto.stuck_threshold,
        stuck_after_s=proto.stuck_after_s,
        batch_redundancy=proto.batch_redundancy,
        group_redundancy=proto.group_redundancy,
        dynamic_sampling=cfg.trainer.dynamic_sampling,
        total_gpus=sim.total_gpus,
        rollout_gpus=sim.rollout_gpus,
        train_gpus=sim.train_gpus,
        gpus_per_instance=sim.gpus_per_instance,
        cost_model=sim.cost_model,
        **coeffs,
        max_running=cfg.rollout.max_running,
        kv_capacity_tokens=sim.kv_capacity_tokens,
        prefill_s_per_token=sim.prefill_s_per_token,
        prompt_len=wl.prompt_len,
        prompt_len_max=cfg.data.max_prompt_len,
        prompt_len_sigma=wl.prompt_len_sigma,
        response_len_median=wl.response_len_median,
        response_len_sigma=wl.response_len_sigma,
        max_response_len=cfg.rollout.sampling.max_new_tokens,
        group_correlation=wl.group_correlation,
        reward_mean=wl.reward_mean,
        trainer_model=sim.trainer_model,
        trainer_time_a_s=sim.trainer_time_a_s,
        trainer_time_b_s_per_token=sim.trainer_time_b_s_per_token,
        active_params=sim.active_params,
        peak_flops_per_gpu=sim.peak_flops_per_gpu,
        mfu=sim.mfu,
        train_overhead_s=sim.train_overhead_s,
        model_bytes=sim.model_bytes,
        push_bandwidth_gb_s=sim.push_bandwidth_gb_s,
        pull_bandwidth_gb_s=sim.pull_bandwidth_gb_s,
        transfer_overhead_s=sim.transfer_overhead_s,
        reward_time_s=sim.reward_time_s,
        cycle_period_s=coord.snapshot_interval_s,
        snapshot_max_age_s=sim.snapshot_max_age_s,
        theta=coord.theta,
        migration_ratio=coord.migration_ratio,
        sync_kv_threshold=coord.sync_kv_threshold,
        warmup_steps=min(sim.warmup_steps, cfg.trainer.steps - 1),
        timeline=cfg.metrics.timeline,
    )


def with_policy(cfg: Any, policy: str, eta: int | str | None = None) -> Any:
    """``cfg`` (an ``AppConfig``) for another policy: η forced for the fixed-η baselines, and
    for a baseline StaleFlow's batch redundancy and stuck-buffer resolution off — the systems
    they model have neither. (Group redundancy stays: every policy then draws the same ``n'``
    responses per prompt from the prompt stream.) ``compare`` and ``plan`` build every run
    this way."""
    if policy in FIXED_ETA:
        eta = FIXED_ETA[policy]
    over = [
        f"coordinator.policy={policy}",
        f"protocol.eta={cfg.protocol.eta if eta is None else eta}",
    ]
    if policy in BASELINE_POLICIES:
        over += ["protocol.stuck_threshold=0", "protocol.batch_redundancy=0"]
    return cfg.evolve(*over)
