"""The app's configuration: nested frozen attrs sections, one YAML file plus dotted overrides.

Theory of operation
-------------------
* Every section is a frozen attrs class whose fields carry their type and allowed range
  (``_f(default, ge=…, choices=…)``). The same check runs when a section is built from YAML and
  when code constructs it directly, and every failure is a :class:`ConfigError` whose ``key`` is
  the full dotted key (``trainer.lr``) and whose ``allowed`` says what would be accepted.
* :func:`load_config` reads one YAML mapping, applies ``key=value`` overrides (values parsed as
  YAML scalars, so ``trainer.steps=20`` is an int and ``protocol.eta=unbounded`` a string),
  rejects unknown keys, then runs cross-field checks (:func:`validate`).
* ``run_dir=DIR`` (top level) is an alias of ``run.run_dir=DIR``.
* :func:`dump_config` writes the resolved config as YAML; loading that file gives the same
  config back (round trip).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import ClassVar, Literal

import attrs

from staleflow_trainer.config_coordinator import BASELINE_POLICIES as BASELINE_POLICIES
from staleflow_trainer.config_coordinator import COST_MODEL_PRESETS as COST_MODEL_PRESETS
from staleflow_trainer.config_coordinator import FIFO_POLICIES as FIFO_POLICIES
from staleflow_trainer.config_coordinator import FIXED_ETA as FIXED_ETA
from staleflow_trainer.config_coordinator import GC_FIFO_POLICIES as GC_FIFO_POLICIES
from staleflow_trainer.config_coordinator import POLICIES as POLICIES
from staleflow_trainer.config_coordinator import STRATEGY_FIELDS as STRATEGY_FIELDS
from staleflow_trainer.config_coordinator import UNBOUNDED_POLICIES as UNBOUNDED_POLICIES
from staleflow_trainer.config_coordinator import WINDOW_POLICIES as WINDOW_POLICIES
from staleflow_trainer.config_coordinator import CoordinatorConfig as CoordinatorConfig
from staleflow_trainer.config_protocol import DEFAULT_INFLIGHT_BATCHES as DEFAULT_INFLIGHT_BATCHES
from staleflow_trainer.config_protocol import DEFAULT_STUCK_THRESHOLD as DEFAULT_STUCK_THRESHOLD
from staleflow_trainer.config_protocol import MAX_ADMITTED_TRAJECTORIES as MAX_ADMITTED_TRAJECTORIES
from staleflow_trainer.config_protocol import MAX_BATCH_SIZE as MAX_BATCH_SIZE
from staleflow_trainer.config_protocol import MAX_ETA as MAX_ETA
from staleflow_trainer.config_protocol import ProtocolConfig as ProtocolConfig
from staleflow_trainer.config_protocol import check_protocol
from staleflow_trainer.config_protocol import fifo_protocol as fifo_protocol
from staleflow_trainer.config_protocol import is_fifo as is_fifo
from staleflow_trainer.config_protocol import stuck_after_s as stuck_after_s
from staleflow_trainer.config_protocol import stuck_threshold as stuck_threshold
from staleflow_trainer.config_schema import config_error as _err
from staleflow_trainer.config_schema import field as _f
from staleflow_trainer.config_schema import section as _section
from staleflow_trainer.config_schema import validate_field as _validate_field
from staleflow_trainer.config_sim import SimConfig as SimConfig  # the sim sections live there
from staleflow_trainer.config_sim import SimWorkloadConfig as SimWorkloadConfig
from staleflow_trainer.config_sim import validate_sim
from staleflow_trainer.control.config import FILTERED_BATCHES_IN_ROW
from staleflow_trainer.errors import ConfigError

# ---------------------------------------------------------------------------------------------
# sections


@_section("run")
@attrs.frozen(kw_only=True)
class RunConfig:
    __section__: ClassVar[str]
    run_dir: str = _f(
        "runs/latest", nonempty=True, doc="run directory (metrics, checkpoints, plots)"
    )
    seed: int = _f(0, ge=0)
    checkpoint_every: int = _f(10, ge=0, doc="steps between checkpoints; 0 = only at the end")
    keep_checkpoints: int = _f(2, ge=1)
    resume: Literal["auto", "never", "must"] = _f("auto")
    coordinator_restarts: int = _f(
        3,
        ge=0,
        doc="a crashed coordinator is replaced from its write-ahead journal at most this often "
        "per deployment; then the run stops (restart it from its last checkpoint)",
    )


@_section("model.tiny")
@attrs.frozen(kw_only=True)
class TinyModelConfig:
    __section__: ClassVar[str]
    hidden_size: int = _f(64, ge=32)
    intermediate_size: int = _f(128, ge=1)
    num_layers: int = _f(2, ge=1)
    num_heads: int = _f(2, ge=1)
    num_kv_heads: int = _f(1, ge=1)
    max_position_embeddings: int = _f(256, ge=16)

    def __attrs_post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"model.tiny.hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}",
                key="model.tiny.num_heads",
                allowed=f"a divisor of {self.hidden_size}",
            )
        if self.hidden_size // self.num_heads < 32:
            raise ConfigError(
                f"model.tiny: head_dim = hidden_size/num_heads = "
                f"{self.hidden_size // self.num_heads} < 32 (vLLM-CPU needs >= 32)",
                key="model.tiny.num_heads",
                allowed=f"<= {self.hidden_size // 32}",
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.tiny.num_kv_heads={self.num_kv_heads} must divide num_heads="
                f"{self.num_heads}",
                key="model.tiny.num_kv_heads",
                allowed=f"a divisor of {self.num_heads}",
            )


@_section("model")
@attrs.frozen(kw_only=True)
class ModelConfig:
    __section__: ClassVar[str]
    path: str = _f("", doc="HF model dir; empty = create a tiny Qwen2 in RUN_DIR/model")
    dtype: Literal["float32", "bfloat16", "float16"] = _f("float32")
    tiny: TinyModelConfig = attrs.field(factory=TinyModelConfig, validator=_validate_field)


@_section("data")
@attrs.frozen(kw_only=True)
class DataConfig:
    __section__: ClassVar[str]
    path: str = _f("", doc="JSONL or Parquet file; empty = the built-in toy task")
    toy_task: Literal["add", "add_mod10", "successor", "copy"] = _f("add")
    toy_size: int = _f(512, ge=1, doc="number of toy prompts generated")
    prompt_key: str = _f("prompt", nonempty=True)
    answer_key: str = _f(
        "reward_model.ground_truth", nonempty=True, doc="falls back to 'ground_truth'"
    )
    shuffle: bool = _f(True)
    max_prompt_len: int = _f(64, ge=1)
    apply_chat_template: bool = _f(False)


@_section("rollout.sampling")
@attrs.frozen(kw_only=True)
class SamplingConfig:
    __section__: ClassVar[str]
    temperature: float = _f(1.0, ge=0.0)
    top_p: float = _f(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = _f(4, ge=1)


#: ``rollout.replace_lost`` at most: far beyond the instances any run loses (each replacement
#: starts an engine and loads the weights, minutes on a large model).
MAX_REPLACEMENTS = 10_000


@_section("rollout")
@attrs.frozen(kw_only=True)
class RolloutConfig:
    __section__: ClassVar[str]
    backend: Literal["vllm", "sglang", "sim"] = _f("vllm")
    num_instances: int = _f(2, ge=1)
    max_running: int = _f(64, ge=1, doc="max concurrent trajectories per instance")
    max_model_len: int = _f(128, ge=8)
    cpus_per_instance: float = _f(1.0, ge=0.0)
    gpus_per_instance: float = _f(0.0, ge=0.0)
    kv_cache_gib: float = _f(1.0, gt=0.0)
    enforce_eager: bool = _f(True)
    sglang_url: str = _f("", doc="SGLang server base URL(s), comma-separated; sglang only")
    replace_lost: int = _f(
        0,
        ge=0,
        le=MAX_REPLACEMENTS,
        doc="start a new instance in place of a lost one, at most this many times a run "
        "(0: a lost instance is not replaced)",
    )
    sampling: SamplingConfig = attrs.field(factory=SamplingConfig, validator=_validate_field)

    @property
    def engine_threads(self) -> int:
        """Compute threads of one instance's engine: ``cpus_per_instance`` rounded down, at
        least 1 (Ray gives the actor ``OMP_NUM_THREADS`` = its CPUs)."""
        return max(math.floor(self.cpus_per_instance), 1)

    @property
    def sglang_urls(self) -> list[str]:
        """The servers of ``sglang_url``: instance i attaches to server i mod their count."""
        return [u for u in self.sglang_url.split(",") if u]


#: Upper bounds of the protocol section. Admission keeps up to (η + 1) buffers of
#: ``trainer.step_delay_s`` at most: an hour per step is far beyond any real trainer step.
MAX_STEP_DELAY_S = 3600.0


@_section("trainer.overlong")
@attrs.frozen(kw_only=True)
class OverlongConfig:
    __section__: ClassVar[str]
    enabled: bool = _f(False)
    buffer_len: int = _f(0, ge=0, doc="soft-penalty ramp length before max_new_tokens")
    penalty_factor: float = _f(1.0, ge=0.0)


@_section("trainer")
@attrs.frozen(kw_only=True)
class TrainerConfig:
    __section__: ClassVar[str]
    steps: int = _f(20, ge=1)
    lr: float = _f(1e-3, gt=0.0)
    warmup_steps: int = _f(0, ge=0)
    weight_decay: float = _f(0.0, ge=0.0)
    betas: tuple[float, ...] = _f((0.9, 0.999))
    grad_clip: float = _f(1.0, ge=0.0, doc="max grad norm; 0 disables clipping")
    clip_low: float = _f(0.2, ge=0.0, lt=1.0)
    clip_high: float = _f(0.28, ge=0.0)
    use_tis: bool = _f(True)
    tis_cap: float = _f(2.0, ge=1.0)
    adv_eps: float = _f(1e-6, gt=0.0)
    dynamic_sampling: bool = _f(False, doc="drop groups whose rewards are all equal")
    max_filtered_in_row: int | None = _f(
        None,
        ge=1,
        doc="with dynamic_sampling: groups filtered in a row that stop the run (the data is "
        f"too easy or too hard, or the reward constant); null: {FILTERED_BATCHES_IN_ROW} x "
        "protocol.batch_size",
    )
    mini_batches: int = _f(1, ge=1, doc="optimizer updates per training step")
    micro_batch_size: int = _f(0, ge=0, doc="samples per forward; 0 = whole mini-batch")
    stream_batch: bool = _f(
        False,
        doc="start on the next batch while it fills: each group that has settled in it gets its "
        "log-probs, forward and backward at once, and the optimizer step follows the last "
        "(the same update; needs mini_batches 1, no FSDP and model.dtype other than float16)",
    )
    overlong: OverlongConfig = attrs.field(factory=OverlongConfig, validator=_validate_field)
    device: Literal["auto", "cpu", "cuda"] = _f("auto")
    fsdp: bool = _f(False, doc="FSDP2 (fully_shard) across torch.distributed ranks")
    num_gpus: int = _f(0, ge=0, doc="GPUs for the trainer actor(s) (FSDP world size)")
    torch_threads: int = _f(0, ge=0, doc="0 = torch default")
    step_delay_s: float = _f(
        0.0,
        ge=0.0,
        le=MAX_STEP_DELAY_S,
        doc="seconds added to every training step before its version is published: a slower "
        "trainer (a stand-in for a larger model) for staleness studies; 0 = none",
    )

    def __attrs_post_init__(self) -> None:
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(
                f"trainer.betas must be two numbers in [0, 1), got {list(self.betas)}",
                key="trainer.betas",
                allowed="[b1, b2] with 0 <= b < 1",
            )
        if self.stream_batch and self.mini_batches != 1:
            raise _err(
                "trainer.stream_batch",
                f"true with trainer.mini_batches {self.mini_batches}: an update before the batch "
                "is complete would change the weights the later groups' old log-probs come from",
                "false, or true with trainer.mini_batches 1",
            )
        if self.stream_batch and self.fsdp:
            raise _err(
                "trainer.stream_batch",
                "true with trainer.fsdp true: a streamed step runs in one process",
                "false, or true with trainer.fsdp false",
            )
        if self.max_filtered_in_row is not None and not self.dynamic_sampling:
            raise _err(
                "trainer.max_filtered_in_row",
                f"{self.max_filtered_in_row}: it stops a run whose groups dynamic sampling "
                "filters, and trainer.dynamic_sampling is false (no group is filtered)",
                "null with trainer.dynamic_sampling false",
            )


@_section("reward")
@attrs.frozen(kw_only=True)
class RewardConfig:
    __section__: ClassVar[str]
    fn: str = _f(
        "staleflow_trainer.reward.default:compute_score",
        nonempty=True,
        doc="dotted path 'pkg.module:function' (or 'pkg.module.function')",
    )
    num_workers: int = _f(1, ge=1)
    retries: int = _f(2, ge=0)
    timeout_s: float = _f(10.0, gt=0.0)
    max_failures_in_row: int = _f(
        100, ge=1, doc="trajectories whose reward failed in a row (after retries) that stop the run"
    )


@_section("param_server")
@attrs.frozen(kw_only=True)
class ParamServerConfig:
    __section__: ClassVar[str]
    num_workers: int = _f(1, ge=1)
    keep_versions: int = _f(2, ge=1)
    replication: int = _f(1, ge=1, doc="workers holding each slice (<= num_workers)")
    push_retry_s: float = _f(
        300.0, ge=0.0, doc="a failed push (e.g. a storage worker down) is retried this long"
    )
    transport: Literal["nixl", "local"] = _f("nixl")
    bind_host: str = _f("127.0.0.1", nonempty=True)
    auth_token: str = _f("", doc="required when bind_host is not loopback")


@_section("ray")
@attrs.frozen(kw_only=True)
class RayConfig:
    __section__: ClassVar[str]
    address: str = _f("", doc="'' = start a local Ray; else a cluster address")
    num_cpus: int | None = _f(None, ge=1)
    num_gpus: int | None = _f(None, ge=0)
    object_store_mb: int = _f(512, ge=64)
    # Placement on a multi-node cluster: each role's actors ask for a sliver of this custom
    # resource, so they land only on nodes started with it (``ray start --resources``).
    control_resource: str = _f(
        "", doc="custom resource of the node(s) for the control actor and the two servers"
    )
    rollout_resource: str = _f("", doc="custom resource of the rollout nodes")
    trainer_resource: str = _f("", doc="custom resource of the trainer node")
    reward_resource: str = _f("", doc="custom resource of the reward worker node(s)")
    trajectory_server_host: str = _f(
        "127.0.0.1",
        nonempty=True,
        doc="address the trajectory server binds and other nodes reach it at (token-checked)",
    )


@_section("metrics.wandb")
@attrs.frozen(kw_only=True)
class WandbConfig:
    __section__: ClassVar[str]
    enabled: bool = _f(False, doc="log every step's metrics to Weights & Biases (pip: wandb)")
    project: str = _f("staleflow", doc="W&B project")
    name: str = _f("", doc="W&B run name; empty = the run directory's name")
    mode: Literal["online", "offline"] | None = _f(
        None,
        doc="online | offline (files under RUN_DIR/wandb, upload later with `wandb sync`); "
        "null = the WANDB_MODE environment variable, else online",
    )


@_section("metrics")
@attrs.frozen(kw_only=True)
class MetricsConfig:
    __section__: ClassVar[str]
    tensorboard: bool = _f(True, doc="write TensorBoard events to RUN_DIR/tensorboard")
    progress_bar: bool = _f(True, doc="a progress bar when stdout is a terminal")
    timeline: bool = _f(True, doc="write RUN_DIR/timeline.jsonl (instance state intervals)")
    log_every: int = _f(
        1,
        ge=0,
        doc="print a line every N steps when there is no progress bar (stdout is not a "
        "terminal, or progress_bar is false); 0 = none",
    )
    wandb: WandbConfig = attrs.field(factory=WandbConfig, validator=_validate_field)


@_section("")
@attrs.frozen(kw_only=True)
class AppConfig:
    __section__: ClassVar[str]
    run: RunConfig = attrs.field(factory=RunConfig, validator=_validate_field)
    model: ModelConfig = attrs.field(factory=ModelConfig, validator=_validate_field)
    data: DataConfig = attrs.field(factory=DataConfig, validator=_validate_field)
    rollout: RolloutConfig = attrs.field(factory=RolloutConfig, validator=_validate_field)
    protocol: ProtocolConfig = attrs.field(factory=ProtocolConfig, validator=_validate_field)
    coordinator: CoordinatorConfig = attrs.field(
        factory=CoordinatorConfig, validator=_validate_field
    )
    trainer: TrainerConfig = attrs.field(factory=TrainerConfig, validator=_validate_field)
    reward: RewardConfig = attrs.field(factory=RewardConfig, validator=_validate_field)
    param_server: ParamServerConfig = attrs.field(
        factory=ParamServerConfig, validator=_validate_field
    )
    ray: RayConfig = attrs.field(factory=RayConfig, validator=_validate_field)
    sim: SimConfig = attrs.field(factory=SimConfig, validator=_validate_field)
    metrics: MetricsConfig = attrs.field(factory=MetricsConfig, validator=_validate_field)

    def __attrs_post_init__(self) -> None:
        validate(self)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.run_dir)

    def evolve(self, *overrides: str) -> AppConfig:
        """A copy with ``key=value`` overrides applied (validated like the CLI's)."""
        from staleflow_trainer.config_io import apply_overrides, from_dict, to_dict

        data = to_dict(self)
        apply_overrides(data, overrides)
        return from_dict(data)


# ---------------------------------------------------------------------------------------------
# cross-field checks


def validate(cfg: AppConfig) -> None:
    """Checks that span sections. Raises ConfigError naming the key to change."""
    p, t, r = cfg.protocol, cfg.trainer, cfg.rollout
    samples = p.batch_size * p.group_size
    if samples % t.mini_batches:
        raise _err(
            "trainer.mini_batches",
            f"batch of {p.batch_size}x{p.group_size}={samples} samples is not divisible into "
            f"{t.mini_batches} mini-batches",
            f"a divisor of {samples}",
        )
    mini = samples // t.mini_batches
    if t.micro_batch_size and mini % t.micro_batch_size:
        raise _err(
            "trainer.micro_batch_size",
            f"mini-batch of {mini} samples is not divisible by micro_batch_size="
            f"{t.micro_batch_size}",
            f"0 or a divisor of {mini}",
        )
    if t.stream_batch and cfg.model.dtype == "float16":
        raise _err(
            "trainer.stream_batch",
            "true with model.dtype float16: a streamed step sums the gradients over the whole "
            "batch before it divides by the token count, beyond float16's range on large batches",
            "false, or true with model.dtype float32 or bfloat16",
        )
    if t.fsdp and t.num_gpus > 1 and samples % t.num_gpus:
        raise _err(
            "trainer.num_gpus",
            f"batch of {samples} samples is not divisible across {t.num_gpus} FSDP ranks",
            f"a divisor of {samples}",
        )
    ps = cfg.param_server
    if ps.replication > ps.num_workers:
        raise _err(
            "param_server.replication",
            f"{ps.replication} copies of each slice need as many storage workers; "
            f"param_server.num_workers={ps.num_workers}",
            f"<= {ps.num_workers}",
        )
    if t.fsdp and t.device == "cpu":
        raise _err("trainer.fsdp", "FSDP2 needs trainer.device cuda or auto", "false with cpu")
    if r.sampling.max_new_tokens >= r.max_model_len:
        raise _err(
            "rollout.sampling.max_new_tokens",
            f"{r.sampling.max_new_tokens} leaves no room for a prompt within "
            f"rollout.max_model_len={r.max_model_len}",
            f"< {r.max_model_len}",
        )
    if cfg.data.max_prompt_len + r.sampling.max_new_tokens > r.max_model_len:
        raise _err(
            "data.max_prompt_len",
            f"{cfg.data.max_prompt_len} + max_new_tokens {r.sampling.max_new_tokens} exceeds "
            f"rollout.max_model_len={r.max_model_len}",
            f"<= {r.max_model_len - r.sampling.max_new_tokens}",
        )
    if t.overlong.enabled and t.overlong.buffer_len > r.sampling.max_new_tokens:
        raise _err(
            "trainer.overlong.buffer_len",
            f"{t.overlong.buffer_len} exceeds rollout.sampling.max_new_tokens="
            f"{r.sampling.max_new_tokens}",
            f"<= {r.sampling.max_new_tokens}",
        )
    check_protocol(cfg)
    if not is_loopback(cfg.param_server.bind_host) and not cfg.param_server.auth_token:
        raise _err(
            "param_server.auth_token",
            f"bind_host {cfg.param_server.bind_host!r} is not loopback; a shared token is required",
            "a non-empty token",
        )
    urls = r.sglang_urls
    if r.backend == "sglang" and len(urls) > r.num_instances:
        raise _err(
            "rollout.num_instances",
            f"{r.num_instances} instances for {len(urls)} servers in rollout.sglang_url: "
            "instance i attaches to server i mod count, so a server would serve no instance",
            f">= {len(urls)} (or list fewer servers)",
        )
    if r.backend == "sim":
        validate_sim(cfg)
    else:
        ray = cfg.ray
        if ray.num_cpus is not None:
            need_cpu = r.num_instances * r.cpus_per_instance
            if need_cpu > ray.num_cpus:
                raise _err(
                    "rollout.num_instances",
                    f"{r.num_instances} instances x {r.cpus_per_instance} CPUs = {need_cpu:g} "
                    f"exceed ray.num_cpus={ray.num_cpus}",
                    f"<= {int(ray.num_cpus // max(r.cpus_per_instance, 1e-9))}",
                )
        if ray.num_gpus is not None:
            need_gpu = r.num_instances * r.gpus_per_instance + t.num_gpus
            if need_gpu > ray.num_gpus:
                raise _err(
                    "rollout.num_instances",
                    f"{r.num_instances} instances x {r.gpus_per_instance} GPUs + "
                    f"trainer.num_gpus {t.num_gpus} = {need_gpu:g} exceed "
                    f"ray.num_gpus={ray.num_gpus}",
                    f"a total <= {ray.num_gpus}",
                )


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


# loading, overrides and dumping live in config_io; importable from here as before
from staleflow_trainer.config_io import (  # noqa: E402
    apply_overrides as apply_overrides,
)
from staleflow_trainer.config_io import dump_config as dump_config  # noqa: E402
from staleflow_trainer.config_io import from_dict as from_dict  # noqa: E402
from staleflow_trainer.config_io import load_config as load_config  # noqa: E402
from staleflow_trainer.config_io import parse_override as parse_override  # noqa: E402
from staleflow_trainer.config_io import to_dict as to_dict  # noqa: E402
