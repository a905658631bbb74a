"""SimSpec: every knob of one simulated run, resolved and validated, independent of YAML.

The app's :class:`~staleflow_trainer.config.AppConfig` is the user-facing schema; the simulator
reads it once (:func:`spec_from_app_config`) into this record so the event loop, the
comparison and the planner can vary one field (policy, η, split) with ``attrs.evolve`` and
nothing else. The engines, the routing cost model and the length distribution are the library
packages' own config records (``engine_adapters.sim.SimConfig``, ``CostModel``,
``engine_adapters.workload.WorkloadConfig``), built by :mod:`staleflow_trainer.config_sim`.

Time models
-----------
* Trainer step, ``trainer_model="linear"``: ``a + b·tokens``.
* Trainer step, ``trainer_model="flops"``: ``8 · active_params · tokens /
  (train_gpus · peak_flops_per_gpu · mfu) + train_overhead_s`` (forward + backward + one forward
  for the old log-probs: 2 + 4 + 2 FLOPs per parameter per token).
* Trainer step, ``trainer_model="megatron"``: the calibrated Megatron model
  (:mod:`staleflow_trainer.sim.trainer_model`) of ``sim.trainer_setup`` on the training GPUs
  the policy has (its expert parallelism lowered to a divisor of them when needed), timed by
  the batch's tokens and the sum of its squared sequence lengths (attention).
* Every trainer model adds ``trainer.step_delay_s`` (``trainer_step_delay_s``) to each step,
  as the Ray deployment's trainer sleeps that long after each step.
* Param push (trainer → param server) and pull (param server → instance):
  ``model_bytes / bandwidth + transfer_overhead_s``. The push follows every step and blocks the
  trainer (its ranks write their shards); a pull is the instance's weight load.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from engine_adapters.cost_model import CostModel
from engine_adapters.sim import SimConfig as EngineSimConfig
from engine_adapters.workload import WorkloadConfig
from rollout_coordinator.policies import build_policy
from staleflow_trainer.config import (
    BASELINE_POLICIES,
    FIXED_ETA,
    POLICIES,
    is_fifo,
)
from staleflow_trainer.config_sim import check_shared_host, colocated, over_budget, total_gpus
from staleflow_trainer.errors import ConfigError
from staleflow_trainer.sim.trainer_model import MegatronSetup

_PROTOCOL = ("eta", "batch_size", "group_size", "group_redundancy")
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
    "trainer_step_delay_s": "trainer.step_delay_s",
    "stream_batch": "trainer.stream_batch",
    "seed": "run.seed",
    "max_running": "rollout.max_running",
    "rollout_gpus": "rollout.num_instances",
    "prompt_len_max": "data.max_prompt_len",
    "max_response_len": "rollout.sampling.max_new_tokens",
    "cycle_period_s": "coordinator.snapshot_interval_s",
    "timeline": "metrics.timeline",
    "instance_threads": "rollout.cpus_per_instance",
    "trainer_threads": "trainer.torch_threads",
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


def _instance_of(tp: type) -> Any:
    def check(inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
        if not isinstance(v, tp):
            raise ConfigError(
                f"sim.{a.name} must be a {tp.__name__}, got {type(v).__name__}",
                key=f"sim.{a.name}",
                allowed=tp.__name__,
            )

    return check


@attrs.frozen(kw_only=True)
class SimSpec:
    """One simulated run. Units: seconds, tokens, bytes, FLOP/s."""

    # --- what runs (the control core's protocol and coordinator settings are not here: the
    # shell builds the core from the app config, ``control.config.core_config``; these are
    # the protocol facts the simulator itself needs, for the prompt stream, the bounds and
    # the reports)
    policy: str = attrs.field(default="staleflow", validator=_one_of(*POLICIES))
    #: The staleness bound, or "unbounded" (no staleness control).
    eta: int | str = attrs.field(default=1, validator=_check_eta)
    steps: int = attrs.field(default=20, validator=_gt(0))
    seed: int = attrs.field(default=0, validator=_ge(0))
    batch_size: int = attrs.field(default=8, validator=_gt(0))
    group_size: int = attrs.field(default=8, validator=_gt(0))
    #: Extra samples per group (``n' = n + this``): the prompt stream always draws ``n'``
    #: members so every policy sees the same first ``n`` responses of every group.
    group_redundancy: int = attrs.field(default=0, validator=_ge(0))

    # --- GPU budget
    total_gpus: int = attrs.field(default=2, validator=_gt(0))
    #: Disaggregated split (``rollout.num_instances`` x ``gpus_per_instance`` rollout GPUs);
    #: the colocated ``sync`` policy rolls out and trains on all ``total_gpus``.
    rollout_gpus: int = attrs.field(default=1, validator=_gt(0))
    train_gpus: int = attrs.field(default=1, validator=_gt(0))
    gpus_per_instance: int = attrs.field(default=1, validator=_gt(0))

    # --- engines (the package's config: true cost model, memory, prefill) and the router
    engine: EngineSimConfig = attrs.field(
        factory=lambda: EngineSimConfig(kv_capacity_tokens=65_536, max_model_len=4_608),
        validator=_instance_of(EngineSimConfig),
    )
    #: The cost model the coordinator routes by (``coordinator.cost_model``).
    router_cost: CostModel = attrs.field(
        factory=lambda: CostModel.preset("qwen3-30b-a3b-h20"), validator=_instance_of(CostModel)
    )
    #: Per-instance speed factors (index = instance number), drawn for this policy's fleet.
    speed_factors: tuple[float, ...] = ()

    #: ``sim.host_cores``: the CPU cores the instances and the trainer share (None: each has
    #: its own device); the compute threads of one instance and of the trainer; on the shared
    #: host, the threads an instance with work keeps runnable (``sim.host_instance_threads``;
    #: None: ``instance_threads``) and those other processes keep runnable
    #: (``sim.host_load_threads``).
    host_cores: int | None = attrs.field(default=None, validator=attrs.validators.optional(_gt(0)))
    instance_threads: int = attrs.field(default=1, validator=_gt(0))
    host_instance_threads: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(_gt(0))
    )
    host_load_threads: float = attrs.field(default=0.0, validator=_ge(0))
    trainer_threads: int = attrs.field(default=1, validator=_gt(0))

    # --- workload: response lengths (the package's config), prompt lengths, rewards
    lengths: WorkloadConfig = attrs.field(
        factory=lambda: WorkloadConfig(max_length=4096), validator=_instance_of(WorkloadConfig)
    )
    prompt_len: int = attrs.field(default=256, validator=_gt(0))  # median
    prompt_len_max: int = attrs.field(default=512, validator=_gt(0))
    prompt_len_sigma: float = attrs.field(default=0.3, validator=_ge(0))
    reward_mean: float = attrs.field(default=0.5, validator=_ge(0))

    # --- trainer and transfers
    trainer_model: str = attrs.field(
        default="linear", validator=_one_of("linear", "flops", "megatron")
    )
    trainer_time_a_s: float = attrs.field(default=0.5, validator=_ge(0))
    trainer_time_b_s_per_token: float = attrs.field(default=1e-5, validator=_ge(0))
    active_params: float = attrs.field(default=3e9, validator=_gt(0))
    peak_flops_per_gpu: float = attrs.field(default=148e12, validator=_gt(0))
    mfu: float = attrs.field(default=0.3, validator=_gt(0))
    train_overhead_s: float = attrs.field(default=5.0, validator=_ge(0))
    #: ``trainer.step_delay_s``: added to every modeled step, whatever the trainer model.
    trainer_step_delay_s: float = attrs.field(default=0.0, validator=_ge(0))
    #: ``trainer.stream_batch`` (never under the colocated ``sync``): the trainer works on the
    #: groups settled in its next batch while the rest finishes (:meth:`train_split`).
    stream_batch: bool = False
    #: ``trainer_model="megatron"``: the setup (its GPU count is replaced by the policy's).
    megatron: MegatronSetup | None = None
    model_bytes: int = attrs.field(default=100_000_000, validator=_gt(0))
    push_bandwidth_gb_s: float = attrs.field(default=10.0, validator=_gt(0))
    pull_bandwidth_gb_s: float = attrs.field(default=10.0, validator=_gt(0))
    transfer_overhead_s: float = attrs.field(default=0.01, validator=_ge(0))
    reward_time_s: float = attrs.field(default=0.0, validator=_ge(0))

    # --- coordinator clock
    cycle_period_s: float = attrs.field(default=0.1, validator=_gt(0))
    #: An instance with no event or command since its last snapshot is re-snapshotted only
    #: after this long (0 = every cycle).
    snapshot_max_age_s: float = attrs.field(default=0.0, validator=_ge(0))

    # --- measurement
    #: Steps excluded from throughput (pipeline fill); tokens/s counts steps after these.
    warmup_steps: int = attrs.field(default=2, validator=_ge(0))
    timeline: bool = True

    def __attrs_post_init__(self) -> None:
        # The protocol's settings against the policy are the app config's to check (both
        # shells run them): ``config_protocol.check_protocol``. These are the simulator's own.
        if not self.colocated:
            error = over_budget(
                self.rollout_gpus, self.train_gpus, self.total_gpus, self.gpus_per_instance
            )
            if error is not None:
                raise error
        check_shared_host(
            self.host_cores, self.stream_batch, self.host_load_threads, self.host_instance_threads
        )
        if self.warmup_steps >= self.steps:
            raise ConfigError(
                f"sim.warmup_steps ({self.warmup_steps}) must be < trainer.steps ({self.steps})",
                key="sim.warmup_steps",
                allowed=f"< {self.steps}",
            )
        if self.reward_mean > 1:
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
        if self.prompt_len_max + self.max_response_len > self.engine.max_model_len:
            raise ConfigError(
                f"one full trajectory ({self.prompt_len_max} + {self.max_response_len} tokens) "
                f"exceeds the engines' context {self.engine.max_model_len}",
                key="rollout.sampling.max_new_tokens",
                allowed=f"<= {self.engine.max_model_len - self.prompt_len_max}",
            )
        if self.trainer_model == "megatron" and self.megatron is None:
            raise ConfigError(
                "sim.trainer_model 'megatron' needs a setup",
                key="sim.trainer_setup",
                allowed="a Megatron setup",
            )

    # ---- derived ----------------------------------------------------------------------------

    @property
    def colocated(self) -> bool:
        return colocated(self.policy)

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
        return self.engine.max_model_len

    @property
    def max_response_len(self) -> int:
        return self.lengths.max_length

    @property
    def max_running(self) -> int:
        return self.engine.max_running

    @property
    def kv_capacity_tokens(self) -> int:
        """KV tokens one instance holds (derived from the geometry unless overridden)."""
        return self.engine.kv_capacity

    def speed_of(self, index: int) -> float:
        """Speed factor of instance ``index`` (1 when the fleet is homogeneous)."""
        return self.speed_factors[index] if index < len(self.speed_factors) else 1.0

    def trainer_setup(self) -> MegatronSetup:
        """The Megatron setup on this policy's training GPUs (expert parallelism lowered to
        the largest divisor of ``gpus / pipeline`` it allows)."""
        if self.megatron is None:
            raise ConfigError(
                "no Megatron setup", key="sim.trainer_model", allowed="megatron with a setup"
            )
        m, gpus = self.megatron, self.train_gpus_used
        ep = math.gcd(m.expert_parallel, max(1, gpus // m.pipeline_parallel))
        return attrs.evolve(m, num_gpus=gpus, expert_parallel=ep)

    def train_seconds(self, tokens: int, seq_sq_sum: float | None = None) -> float:
        """Modeled compute time of one training step on ``tokens`` (prompt + response) in
        sequences whose squared lengths sum to ``seq_sq_sum`` (megatron's attention term), plus
        the configured ``trainer_step_delay_s``."""
        per_sample, per_step = self.train_split(tokens, seq_sq_sum)
        return per_sample + per_step

    def train_split(self, tokens: int, seq_sq_sum: float | None = None) -> tuple[float, float]:
        """:meth:`train_seconds` in two parts: the work that grows with the samples (log-prob
        pass, forward and backward: what ``trainer.stream_batch`` can do before the batch is
        complete) and the per-step rest (the linear model's intercept, offload, the optimizer,
        fixed overheads, ``trainer_step_delay_s``)."""
        delay = self.trainer_step_delay_s
        if self.trainer_model == "linear":
            return self.trainer_time_b_s_per_token * tokens, self.trainer_time_a_s + delay
        if self.trainer_model == "megatron":
            b = self.trainer_setup().breakdown(tokens, seq_sq_sum)
            return b.update_s + b.logprob_s, b.offload_s + b.optimizer_s + b.fixed_s + delay
        flops = 8.0 * self.active_params * tokens
        rate = self.train_gpus_used * self.peak_flops_per_gpu * self.mfu
        return flops / rate, self.train_overhead_s + delay

    def host_shares(self, busy_instances: int) -> tuple[float, float]:
        """With ``host_cores``, while the trainer computes beside ``busy_instances`` instances
        that have work: the instances' pace (their share of the speed they have without the
        trainer) and the factor on the trainer's compute time (its time alone × this). Every
        thread gets ``min(1, cores / threads)`` of a core: an instance with work counts
        ``host_instance_threads`` (or its ``instance_threads``), the host's load
        (``host_load_threads``) that many more threads that always run; the speed without the
        trainer, and the trainer's time alone, are each with the load beside them. ``(1, 1)``
        without a shared host."""
        if self.host_cores is None:
            return 1.0, 1.0
        cores, trainer, load = self.host_cores, self.trainer_threads, self.host_load_threads
        engines = busy_instances * (self.host_instance_threads or self.instance_threads)
        if not engines:
            return 1.0, 1.0  # the trainer beside the load alone: its time alone
        share = min(1.0, cores / (engines + trainer + load))
        alone = min(1.0, cores / (engines + load))
        return share / alone, min(1.0, cores / (trainer + load)) / share

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
    cap, ``rollout.max_running`` the per-instance batch limit; the engines, their true cost
    model, the speed factors and the length distribution come from
    :mod:`staleflow_trainer.config_sim` (the one translation of the ``sim`` section).
    """
    from staleflow_trainer.config_sim import (
        check_split,
        engine_config,
        length_workload,
        model_bytes,
        rollout_gpus,
        sim_value,
        speed_factors,
        warmup_steps,
    )
    from staleflow_trainer.control.config import coordinator_config, streams
    from staleflow_trainer.sim.trainer_model import setup

    sim = cfg.sim
    wl = sim.workload
    proto = cfg.protocol
    check_split(cfg)
    return SimSpec(
        policy=cfg.coordinator.policy,
        eta=proto.eta,
        steps=cfg.trainer.steps,
        seed=cfg.run.seed,
        batch_size=proto.batch_size,
        group_size=proto.group_size,
        group_redundancy=proto.group_redundancy,
        total_gpus=total_gpus(cfg, colocated=colocated(cfg.coordinator.policy)),
        rollout_gpus=rollout_gpus(cfg),
        train_gpus=sim.train_gpus,
        gpus_per_instance=sim.gpus_per_instance,
        engine=engine_config(cfg),
        router_cost=coordinator_config(cfg).cost_model,
        speed_factors=speed_factors(cfg, cfg.rollout.num_instances),
        host_cores=sim.host_cores,
        host_instance_threads=sim.host_instance_threads,
        host_load_threads=sim.host_load_threads,
        instance_threads=cfg.rollout.engine_threads,
        trainer_threads=cfg.trainer.torch_threads or 1,
        lengths=length_workload(cfg),
        prompt_len=wl.prompt_len,
        prompt_len_max=cfg.data.max_prompt_len,
        prompt_len_sigma=wl.prompt_len_sigma,
        reward_mean=wl.reward_mean,
        trainer_model=sim.trainer_model,
        **{
            k: sim_value(sim, k)
            for k in (
                "trainer_time_a_s",
                "trainer_time_b_s_per_token",
                "active_params",
                "peak_flops_per_gpu",
                "mfu",
                "train_overhead_s",
            )
        },
        trainer_step_delay_s=cfg.trainer.step_delay_s,
        stream_batch=streams(cfg),
        megatron=(
            setup(sim_value(sim, "trainer_setup")) if sim.trainer_model == "megatron" else None
        ),
        model_bytes=model_bytes(cfg),
        push_bandwidth_gb_s=sim.push_bandwidth_gb_s,
        pull_bandwidth_gb_s=sim.pull_bandwidth_gb_s,
        transfer_overhead_s=sim.transfer_overhead_s,
        reward_time_s=sim.reward_time_s,
        cycle_period_s=cfg.coordinator.snapshot_interval_s,
        snapshot_max_age_s=sim.snapshot_max_age_s,
        warmup_steps=warmup_steps(cfg),
        timeline=cfg.metrics.timeline,
    )


def with_policy(cfg: Any, policy: str, eta: int | str | None = None) -> Any:
    """``cfg`` (an ``AppConfig``) for another policy: η forced for the fixed-η baselines, the
    colocated ``sync`` given instances on every GPU of the budget, and
    for a baseline StaleFlow's batch redundancy and stuck-buffer resolution off — the systems
    they model have neither (nor has a FIFO a buffer to get stuck; nor do buffers take the
    FIFO's admission limit). (Group redundancy stays:
    every policy then draws the same ``n'`` responses per prompt from the prompt stream.) A
    strategy setting the policy does not read is left out of its run. ``compare`` and ``plan``
    build every run this way."""
    if policy in FIXED_ETA:
        eta = FIXED_ETA[policy]
    if eta is None:
        eta = cfg.protocol.eta
    over = [f"coordinator.policy={policy}", f"protocol.eta={eta}"]
    if colocated(policy):  # its instances cover the whole budget
        over += [f"rollout.num_instances={total_gpus(cfg) // cfg.sim.gpus_per_instance}"]
    if policy in BASELINE_POLICIES:
        over += ["protocol.stuck_threshold=0", "protocol.batch_redundancy=0"]
    elif is_fifo(policy, eta):
        over += ["protocol.stuck_threshold=0"]  # a FIFO has no buffer to get stuck
    if policy in BASELINE_POLICIES or is_fifo(policy, eta):
        over += ["protocol.stuck_after_s=null"]  # no stuck resolution: no wait for it
    if eta != "unbounded":
        over += ["protocol.unbounded_inflight_batches=null"]  # buffers admit by themselves
    # a strategy setting the policy does not read is left out of its run (the config refuses
    # it for a single run, as it would change nothing)
    reads = build_policy(policy).reads
    over += [
        f"coordinator.{f}=null" for f in cfg.coordinator.strategy_overrides() if f not in reads
    ]
    return cfg.evolve(*over)
