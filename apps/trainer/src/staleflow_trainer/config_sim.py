"""The ``sim`` section of the app's config, and its one translation into the engines' config.

The simulated rollout instances are ``engine_adapters.sim`` engines; their facts come from the
package, never from a second table here:

* **Memory**: ``sim.model`` and ``sim.gpu`` name presets of :mod:`engine_adapters.hardware`;
  the KV capacity is derived from the model's geometry, the GPU's memory,
  ``gpu_memory_utilization``, the per-GPU reserve and tensor parallelism
  (``sim.gpus_per_instance``). ``sim.kv_capacity_tokens`` overrides it, and only when set.
* **Prefill**: chunked under a per-step token budget (``sim.max_num_batched_tokens``; null: the
  context limit ``rollout.max_model_len``, as the published runs set it, and at least 2048,
  vLLM's default; ``off``: one step per
  context), a linear term plus a quadratic attention term derived from the geometry at
  ``prefill_mfu``, re-paid on every interrupt, preemption, migration and sync.
  ``prefill_s_per_token`` / ``prefill_s_per_token_position`` override the derived terms.
* **GPUs**: the simulator runs ``rollout.num_instances`` instances of ``sim.gpus_per_instance``
  GPUs each, as a deployment does, and trains on ``sim.train_gpus``; together they fit in
  ``sim.total_gpus`` (null: just that much; :func:`total_gpus`, :func:`check_split`). A
  colocated policy (:data:`COLOCATED_POLICIES`: ``sync``) rolls out and trains on the same
  GPUs: its instances cover the budget exactly.
* **Decode speed**: the engines' true cost model is ``sim.cost_model`` — ``coordinator`` (the
  default: the model the router ranks by, ``coordinator.cost_model``), a preset, a fitted JSON
  file, or ``custom`` (``k1..k4``, ``b``). It differs from the router's only by what is set
  here: a different model named explicitly, ``cost_model_error`` (each coefficient multiplied by
  ``exp(error · z)``, ``z`` standard normal drawn from ``run.seed``: a fitted model's
  systematic error; the published fits report about 10 % average), and ``speed_spread``
  (per-instance speed factors, lognormal with that log-std and mean 1: a heterogeneous fleet
  the router does not know about).
* **A shared host**: ``sim.host_cores`` (null: every instance and the trainer have their own
  device, as on a cluster) makes the instances and the trainer share that many CPU cores, as
  ``staleflow train`` does on one machine. While the trainer computes, its threads
  (``trainer.torch_threads``, or 1, what Ray gives the trainer) and those of the instances
  with work (``rollout.cpus_per_instance`` each, at least 1) share the cores evenly: each
  thread gets ``min(1, cores / threads)`` of one, so the instances run at that share of their
  pace without the trainer and the trainer's step takes longer by as much, the shares taken
  again whenever an instance gets work or runs out of it (the cost model is
  the instances' speed side by side without the trainer, as ``staleflow profile`` measures it;
  the trainer model, its time alone). ``sim.host_instance_threads`` (null: the engine's threads)
  is what an instance with work keeps runnable when more than its engine computes for it (on
  one machine, its rollout process turns the engine's steps into tokens, log-probabilities
  and statistics), and ``sim.host_load_threads`` (0 by default) what the host's other
  processes keep runnable all the time (the control process, the trajectory server, the
  reward worker), as that many more threads. Each is a thread count on average: on a host
  with cores to spare, the cores they use; on a busy one, more (``/proc/<pid>/task/*/schedstat``
  counts a thread's time on a core and its time waiting for one). The cost model and the
  trainer's time alone are taken as measured with these running, so they change how much each
  slows down when the trainer computes beside the instances. The roofline ideal and the
  latency-aware bound that reports print give each side its own device all the same. Not
  with ``trainer.stream_batch``.

:func:`engine_config` is the only place these become an ``engine_adapters.sim.SimConfig``;
:func:`validate_sim` runs it when the config is loaded, so a bad setting fails there with the
config key named.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar, Literal

import attrs
import numpy as np

from engine_adapters.cost_model import PRESETS as COST_PRESETS
from engine_adapters.cost_model import CostModel
from engine_adapters.errors import InvalidRequest
from engine_adapters.hardware import GIB, GPUS, MODELS
from engine_adapters.sim import SimConfig as EngineSimConfig
from engine_adapters.sim import draw_speed_factors
from engine_adapters.workload import KINDS, WorkloadConfig
from staleflow_trainer.config_schema import check_known
from staleflow_trainer.config_schema import field as _f
from staleflow_trainer.config_schema import section as _section
from staleflow_trainer.config_schema import validate_field as _validate_field
from staleflow_trainer.errors import ConfigError

#: Trainer-step models (``sim.trainer_model``).
TRAINER_MODELS = ("linear", "flops", "megatron")


@_section("sim.workload")
@attrs.frozen(kw_only=True)
class SimWorkloadConfig:
    """Prompt lengths (lognormal), response lengths (``kind``) and synthetic rewards."""

    __section__: ClassVar[str]
    kind: Literal["lognormal", "power_law", "bimodal", "trace", "group_trace"] = _f(
        "lognormal", doc="response lengths: a distribution, or a trace file of lengths / groups"
    )
    trace_path: str = _f("", doc="trace / group_trace: the file (see engine_adapters.workload)")
    prompt_len: int = _f(256, ge=1)
    response_len_median: int = _f(1000, ge=1, doc="lognormal; bimodal: the first mode")
    response_len_sigma: float = _f(1.0, ge=0.0, doc="lognormal sigma: the tail's weight")
    alpha: float | None = _f(None, gt=0.0, doc="power_law tail index (null: 1.5)")
    x_min: float | None = _f(None, gt=0.0, doc="power_law minimum (null: 200)")
    median2: float | None = _f(None, gt=0.0, doc="bimodal: the second mode (null: 15000)")
    sigma2: float | None = _f(None, ge=0.0, doc="bimodal: its sigma (null: 0.3)")
    weight2: float | None = _f(None, ge=0.0, le=1.0, doc="bimodal: its weight (null: 0.1)")
    reward_mean: float = _f(0.5, ge=0.0, le=1.0, doc="P(reward=1) for synthetic rewards")
    prompt_len_sigma: float = _f(0.3, ge=0.0, doc="lognormal sigma of prompt lengths")
    group_correlation: float = _f(0.5, ge=0.0, le=1.0, doc="length correlation in a group")


@_section("sim")
@attrs.frozen(kw_only=True)
class SimConfig:
    __section__: ClassVar[str]
    # --- decode speed
    cost_model: str = _f(
        "coordinator",
        doc="engines' true cost model: coordinator (the router's), a preset, a .json, custom",
    )
    k1: float | None = _f(None, ge=0.0, doc="custom: s per KV token per step")
    k2: float | None = _f(None, ge=0.0, doc="custom: floor of the max term")
    k3: float | None = _f(None, ge=0.0, doc="custom: s per running trajectory")
    k4: float | None = _f(None, ge=0.0, doc="custom: constant")
    b: float | None = _f(None, ge=0.0, doc="custom: intercept inside the max")
    cost_model_error: float = _f(
        0.0, ge=0.0, le=1.0, doc="log-std of the engines' coefficients around the model"
    )
    speed_spread: float = _f(0.0, ge=0.0, le=1.0, doc="log-std of per-instance speed factors")
    host_cores: int | None = _f(
        None, ge=1, doc="CPU cores the instances and the trainer share (null: own devices)"
    )
    host_instance_threads: float | None = _f(
        None, gt=0.0, doc="with host_cores: threads an instance with work keeps runnable"
    )
    host_load_threads: float = _f(
        0.0, ge=0.0, doc="with host_cores: threads the host's other processes keep runnable"
    )
    # --- GPU budget
    total_gpus: int | None = _f(
        None, ge=1, doc="the GPU budget (null: the instances' GPUs + sim.train_gpus)"
    )
    train_gpus: int = _f(1, ge=0, doc="training GPUs of the disaggregated policies")
    gpus_per_instance: int = _f(1, ge=1, doc="tensor parallelism of a rollout instance")
    # --- memory and prefill (engine_adapters.hardware)
    model: str = _f("qwen3-30b-a3b", doc="model geometry preset (engine_adapters.hardware)")
    gpu: str = _f("h20", doc="GPU preset (engine_adapters.hardware)")
    gpu_memory_utilization: float = _f(0.9, gt=0.0, le=1.0)
    memory_reserve_gib: float = _f(4.0, ge=0.0, doc="per GPU: activations, graphs, non-torch")
    kv_capacity_tokens: int | None = _f(None, ge=1, doc="override of the derived KV capacity")
    prefill_mfu: float = _f(0.6, gt=0.0, le=1.0, doc="prefill FLOPs utilisation")
    prefill_s_per_token: float | None = _f(None, ge=0.0, doc="override: linear prefill term")
    prefill_s_per_token_position: float | None = _f(
        None, ge=0.0, doc="override: attention term (s per token per earlier position)"
    )
    max_num_batched_tokens: int | Literal["off"] | None = _f(
        None,
        ge=1,
        doc="chunked-prefill token budget per step (null: rollout.max_model_len, at least 2048 "
        "as vLLM's default)",
    )
    kv_after_weight_load: Literal["recompute", "keep"] = _f(
        "recompute", doc="running work after a weight load: re-prefill (real engines) or keep"
    )
    # --- trainer and transfers
    trainer_model: Literal["linear", "flops", "megatron"] = _f(
        "linear",
        doc="linear: a + b*tokens; flops: 8*active_params*tokens/(gpus*peak*mfu)+c; "
        "megatron: the calibrated Megatron model of sim.trainer_setup",
    )
    trainer_setup: str | None = _f(
        None, doc="megatron: a setup of sim.trainer_model.SETUPS (null: qwen3-30b-a3b)"
    )
    trainer_time_a_s: float | None = _f(None, ge=0.0, doc="linear: s a step (null: 0.5)")
    trainer_time_b_s_per_token: float | None = _f(
        None, ge=0.0, doc="linear: s a trained token (null: 1e-5)"
    )
    active_params: float | None = _f(None, gt=0.0, doc="flops: active parameters (null: 3e9)")
    peak_flops_per_gpu: float | None = _f(
        None, gt=0.0, doc="flops: peak bf16 FLOP/s (null: 148e12)"
    )
    mfu: float | None = _f(None, gt=0.0, le=1.0, doc="flops: FLOPs utilisation (null: 0.3)")
    train_overhead_s: float | None = _f(
        None, ge=0.0, doc="flops: fixed per-step overhead (null: 5)"
    )
    model_bytes: int | None = _f(None, ge=1, doc="weights pushed and pulled (null: the model's)")
    push_bandwidth_gb_s: float = _f(10.0, gt=0.0)
    pull_bandwidth_gb_s: float = _f(10.0, gt=0.0)
    transfer_overhead_s: float = _f(0.01, ge=0.0)
    reward_time_s: float = _f(0.0, ge=0.0)
    # --- the virtual clock and measurement
    snapshot_max_age_s: float = _f(0.0, ge=0.0, doc="re-snapshot unchanged instances after")
    warmup_steps: int | None = _f(
        None,
        ge=0,
        doc="steps excluded from throughput (pipeline fill); null: 2, or trainer.steps - 1 "
        "in a shorter run",
    )
    workload: SimWorkloadConfig = attrs.field(factory=SimWorkloadConfig, validator=_validate_field)

    def __attrs_post_init__(self) -> None:
        if self.cost_model == "custom":
            for k in ("k1", "k2", "k3", "k4"):
                if getattr(self, k) is None:
                    raise ConfigError(
                        f"sim.{k} is required when sim.cost_model is 'custom'",
                        key=f"sim.{k}",
                        allowed="a number >= 0",
                    )
        elif any(getattr(self, k) is not None for k in ("k1", "k2", "k3", "k4", "b")):
            raise ConfigError(
                f"sim.k1..k4 and sim.b apply only with sim.cost_model 'custom', not "
                f"{self.cost_model!r}",
                key="sim.cost_model",
                allowed="custom (or leave sim.k1..k4, b unset)",
            )
        allowed_cost = ["coordinator", "custom", *sorted(COST_PRESETS)]
        check_known(self.cost_model, allowed_cost, "sim.cost_model", "cost model", json_ok=True)
        check_known(self.model, sorted(MODELS), "sim.model", "model geometry")
        check_known(self.gpu, sorted(GPUS), "sim.gpu", "GPU")
        check_modes(self)
        if self.trainer_model == "megatron":
            from staleflow_trainer.sim.trainer_model import SETUPS

            check_known(
                sim_value(self, "trainer_setup"), sorted(SETUPS), "sim.trainer_setup",
                "Megatron setup",
            )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# settings of one mode

#: settings that apply under one value of a mode setting only (``mode key -> value -> {key:
#: default}``; a default of None is the engine package's). Set under another value, a key would
#: change nothing, so :func:`check_modes` refuses it; null takes its value's default.
MODES: dict[str, dict[str, dict[str, Any]]] = {
    "trainer_model": {
        "linear": {"trainer_time_a_s": 0.5, "trainer_time_b_s_per_token": 1e-5},
        "flops": {"active_params": 3e9, "peak_flops_per_gpu": 148e12, "mfu": 0.3,
                  "train_overhead_s": 5.0},
        "megatron": {"trainer_setup": "qwen3-30b-a3b"},
    },
    "workload.kind": {
        "power_law": {"alpha": None, "x_min": None},
        "bimodal": {"median2": None, "sigma2": None, "weight2": None},
        "trace": {"trace_path": None},
        "group_trace": {"trace_path": None},
    },
}  # fmt: skip


def _section_of(sim: Any, mode: str) -> tuple[Any, str]:
    """The section holding ``mode``'s keys (``sim`` or ``sim.workload``) and the mode's value."""
    if mode.startswith("workload."):
        return sim.workload, getattr(sim.workload, mode.split(".", 1)[1])
    return sim, getattr(sim, mode)


def check_modes(sim: Any) -> None:
    """A key of :data:`MODES` set (not null, not empty) under another value of its mode is
    refused, naming the key and the value it applies with."""
    for mode, values in MODES.items():
        section, current = _section_of(sim, mode)
        here = set(values.get(current, {}))
        for keys in values.values():
            for key in keys:
                given = getattr(section, key)
                if key in here or given is None or given == "":
                    continue
                prefix = "sim.workload." if section is not sim else "sim."
                users = sorted(v for v, ks in values.items() if key in ks)
                raise ConfigError(
                    f"{prefix}{key} applies with sim.{mode} {' or '.join(map(repr, users))} "
                    f"only; this config's is {current!r}",
                    key=f"{prefix}{key}",
                    allowed=f"null (or sim.{mode}: {' or '.join(users)})",
                )


def sim_value(sim: Any, key: str) -> Any:
    """A ``sim`` key of :data:`MODES` as the simulator applies it: set, or its mode's default."""
    given = getattr(sim, key)
    if given is not None:
        return given
    return next(ks[key] for values in MODES.values() for ks in values.values() if key in ks)


# ---------------------------------------------------------------------------------------------
# the one translation


#: engine_adapters.sim.SimConfig field -> the app config key it comes from (error messages).
_ENGINE_KEYS = {
    "cost": "sim.cost_model",
    "max_running": "rollout.max_running",
    "max_model_len": "rollout.sampling.max_new_tokens",
    "model": "sim.model",
    "gpu": "sim.gpu",
    "tensor_parallel_size": "sim.gpus_per_instance",
    "gpu_memory_utilization": "sim.gpu_memory_utilization",
    "memory_reserve_bytes": "sim.memory_reserve_gib",
    "kv_capacity_tokens": "sim.kv_capacity_tokens",
    "prefill_mfu": "sim.prefill_mfu",
    "prefill_s_per_token": "sim.prefill_s_per_token",
    "prefill_s_per_token_position": "sim.prefill_s_per_token_position",
    "max_num_batched_tokens": "sim.max_num_batched_tokens",
    "weight_bandwidth_bytes_per_s": "sim.pull_bandwidth_gb_s",
    "weight_load_constant_s": "sim.transfer_overhead_s",
}

#: engine_adapters.workload.WorkloadConfig field -> app config key.
_WORKLOAD_KEYS = {
    "median": "sim.workload.response_len_median",
    "sigma": "sim.workload.response_len_sigma",
    "max_length": "rollout.sampling.max_new_tokens",
}


def base_cost_model(cfg: Any) -> CostModel:
    """The model the engines' true speed is drawn around (``sim.cost_model``)."""
    sim = cfg.sim
    try:
        if sim.cost_model == "coordinator":
            return CostModel.resolve(cfg.coordinator.cost_model)
        if sim.cost_model == "custom":
            return CostModel(k1=sim.k1, k2=sim.k2, k3=sim.k3, k4=sim.k4, b=sim.b or 0.0)
        return CostModel.resolve(sim.cost_model)
    except (InvalidRequest, ValueError) as e:
        key = "coordinator.cost_model" if sim.cost_model == "coordinator" else "sim.cost_model"
        raise ConfigError(f"{key}: {e}", key=key, allowed="a preset or a readable .json") from None


def engine_cost_model(cfg: Any) -> CostModel:
    """The engines' true cost model: :func:`base_cost_model` times the error factors."""
    base = base_cost_model(cfg)
    err = cfg.sim.cost_model_error
    if err == 0:
        return base
    z = np.random.default_rng([cfg.run.seed, 0xC057]).standard_normal(5)
    factors = {
        c: math.exp(err * float(x)) for c, x in zip(("k1", "k2", "k3", "k4", "b"), z, strict=True)
    }
    return base.with_errors(factors, name=f"{base.name}+error{err:g}")


def speed_factors(cfg: Any, count: int) -> tuple[float, ...]:
    """Per-instance speed factors (``sim.speed_spread``; all 1 when it is 0)."""
    if cfg.sim.speed_spread == 0:
        return (1.0,) * count
    return draw_speed_factors(count, spread=cfg.sim.speed_spread, seed=cfg.run.seed)


def engine_config(cfg: Any, *, cost: CostModel | None = None) -> EngineSimConfig:
    """The sim engines' config (speed factor 1; see :func:`speed_factors`)."""
    sim = cfg.sim
    budget = sim.max_num_batched_tokens
    try:
        return EngineSimConfig(
            cost=engine_cost_model(cfg) if cost is None else cost,
            max_running=cfg.rollout.max_running,
            max_model_len=cfg.data.max_prompt_len + cfg.rollout.sampling.max_new_tokens,
            model=sim.model,
            gpu=sim.gpu,
            tensor_parallel_size=sim.gpus_per_instance,
            gpu_memory_utilization=sim.gpu_memory_utilization,
            memory_reserve_bytes=round(sim.memory_reserve_gib * GIB),
            kv_capacity_tokens=sim.kv_capacity_tokens,
            prefill_mfu=sim.prefill_mfu,
            prefill_s_per_token=sim.prefill_s_per_token,
            prefill_s_per_token_position=sim.prefill_s_per_token_position,
            max_num_batched_tokens=(
                None
                if budget == "off"
                else (max(cfg.rollout.max_model_len, 2048) if budget is None else budget)
            ),
            kv_after_weight_load=sim.kv_after_weight_load,
            weight_bandwidth_bytes_per_s=sim.pull_bandwidth_gb_s * 1e9,
            weight_load_constant_s=sim.transfer_overhead_s,
            seed=cfg.run.seed,
        )
    except InvalidRequest as e:
        key = _ENGINE_KEYS.get(str(e.field), f"sim.{e.field}")
        raise ConfigError(f"{key}: {e}", key=key, allowed="see the message") from None


def length_workload(cfg: Any) -> WorkloadConfig:
    """The response-length distribution (``sim.workload``) as the engine package's config."""
    w = cfg.sim.workload
    extra = {
        k: getattr(w, k)
        for k in ("alpha", "x_min", "median2", "sigma2", "weight2")
        if getattr(w, k) is not None
    }
    try:
        return WorkloadConfig(
            kind=w.kind,
            median=float(w.response_len_median),
            sigma=w.response_len_sigma,
            max_length=cfg.rollout.sampling.max_new_tokens,
            group_correlation=w.group_correlation,
            trace_path=w.trace_path or None,
            seed=cfg.run.seed,
            **extra,
        )
    except InvalidRequest as e:
        key = _WORKLOAD_KEYS.get(str(e.field), f"sim.workload.{e.field}")
        raise ConfigError(f"{key}: {e}", key=key, allowed="see the message") from None


def model_bytes(cfg: Any) -> int:
    """Bytes pushed after each step and pulled by each sync: set, or the model's weights."""
    sim = cfg.sim
    return int(sim.model_bytes) if sim.model_bytes is not None else MODELS[sim.model].weight_bytes


#: Policies the simulator runs colocated: rollout and training take turns on the same GPUs (as
#: verl's synchronous trainer does), so their instances cover the whole budget.
COLOCATED_POLICIES = ("sync",)


def colocated(policy: str) -> bool:
    """Does the simulator run ``policy`` colocated (:data:`COLOCATED_POLICIES`)?"""
    return policy in COLOCATED_POLICIES


def rollout_gpus(cfg: Any) -> int:
    """The simulated rollout GPUs: ``rollout.num_instances`` x ``sim.gpus_per_instance``."""
    return int(cfg.rollout.num_instances * cfg.sim.gpus_per_instance)


def total_gpus(cfg: Any, *, colocated: bool = False) -> int:
    """The GPU budget: ``sim.total_gpus``, or (null) the GPUs the run uses: the instances',
    plus ``sim.train_gpus`` unless ``colocated``."""
    sim = cfg.sim
    if sim.total_gpus is not None:
        return int(sim.total_gpus)
    return rollout_gpus(cfg) + (0 if colocated else int(sim.train_gpus))


def over_budget(rollout: int, train: int, total: int, gpi: int) -> ConfigError | None:
    """The error for ``rollout`` GPUs of instances (``gpi`` GPUs each) and ``train`` training
    GPUs beyond a budget of ``total``, or None where they fit."""
    if rollout + train <= total:
        return None
    return ConfigError(
        f"rollout.num_instances: {rollout // gpi} instances x {gpi} GPUs = {rollout} rollout "
        f"GPUs + sim.train_gpus={train} exceed sim.total_gpus={total}",
        key="rollout.num_instances",
        allowed=f"<= {(total - train) // gpi} (or raise sim.total_gpus)",
    )


def check_split(cfg: Any) -> None:
    """The instances and the trainer fit in the budget (:func:`total_gpus`); a colocated policy's
    instances cover the budget exactly, so no GPU of it is left out."""
    sim, n = cfg.sim, cfg.rollout.num_instances
    gpi, used = sim.gpus_per_instance, rollout_gpus(cfg)
    coloc = colocated(cfg.coordinator.policy)
    total = total_gpus(cfg, colocated=coloc)
    if coloc and used != total:
        raise ConfigError(
            f"rollout.num_instances: the colocated sync policy rolls out and trains on all "
            f"sim.total_gpus={total}; {n} instances x {gpi} GPUs = {used}",
            key="rollout.num_instances",
            allowed=f"{total // gpi} (sim.total_gpus / sim.gpus_per_instance)"
            + ("" if total % gpi == 0 else ", with sim.total_gpus a multiple of it"),
        )
    error = None if coloc else over_budget(used, sim.train_gpus, total, gpi)
    if error is not None:
        raise error


#: ``sim.warmup_steps`` where it is null (a shorter run measures its last step)
DEFAULT_WARMUP_STEPS = 2


def warmup_steps(cfg: Any) -> int:
    """The steps a simulated run leaves out of its throughput: ``sim.warmup_steps``, or where it
    is null :data:`DEFAULT_WARMUP_STEPS`, fewer in a run too short to measure a step after
    them."""
    given = cfg.sim.warmup_steps
    return min(DEFAULT_WARMUP_STEPS, cfg.trainer.steps - 1) if given is None else int(given)


def check_shared_host(
    host_cores: int | None,
    stream_batch: bool,
    load_threads: float = 0.0,
    instance_threads: float | None = None,
) -> None:
    """Refuse a shared host (``sim.host_cores``) for a trainer that streams its batch in: the
    streamed parts' work is not modelled on it; and the threads of a shared host
    (``sim.host_load_threads``, ``sim.host_instance_threads``) set without one. (Their ranges
    are the fields' own checks.)"""
    given = (("sim.host_load_threads", load_threads, bool(load_threads), "0"),
             ("sim.host_instance_threads", instance_threads, instance_threads is not None,
              "null"))  # fmt: skip
    for key, value, is_set, unset in given:
        if is_set and host_cores is None:
            raise ConfigError(
                f"{key} is {value}, but the simulation has no shared host (sim.host_cores is "
                "null: every instance and the trainer have their own device)",
                key=key,
                allowed=f"{unset} while sim.host_cores is null, or set sim.host_cores",
            )
    if host_cores is not None and stream_batch:
        raise ConfigError(
            "sim.host_cores is set, but the shared host is not modelled for "
            "trainer.stream_batch (its streamed parts would share the cores too)",
            key="sim.host_cores",
            allowed="null (unset) with trainer.stream_batch: true, or trainer.stream_batch: false",
        )


def validate_sim(cfg: Any) -> None:
    """Cross-section checks of a sim-backend config (the split, the warm-up, the engines and
    the workload build)."""
    check_split(cfg)
    from staleflow_trainer.control.config import streams

    sim = cfg.sim
    check_shared_host(
        sim.host_cores, streams(cfg), sim.host_load_threads, sim.host_instance_threads
    )
    given, steps = cfg.sim.warmup_steps, cfg.trainer.steps
    if given is not None and given >= steps:
        raise ConfigError(
            f"sim.warmup_steps ({given}) leaves no step of trainer.steps ({steps}) to measure",
            key="sim.warmup_steps",
            allowed=f"< {steps} (trainer.steps), or null ({DEFAULT_WARMUP_STEPS}, fewer in a "
            "shorter run)",
        )
    w = cfg.sim.workload
    if w.kind in ("trace", "group_trace"):
        if not w.trace_path:
            raise ConfigError(
                f"sim.workload.trace_path is required with sim.workload.kind {w.kind!r}",
                key="sim.workload.trace_path",
                allowed="a readable trace file",
            )
        if not Path(w.trace_path).is_file():
            raise ConfigError(
                f"sim.workload.trace_path {w.trace_path!r} does not exist",
                key="sim.workload.trace_path",
                allowed="a readable trace file",
            )
    elif w.kind not in KINDS:  # pragma: no cover - the Literal type rejects it first
        raise ConfigError(f"sim.workload.kind {w.kind!r}", key="sim.workload.kind", allowed="")
    length_workload(cfg)
    engine_config(cfg)  # reads a fitted .json cost model now: a bad file fails at load
