"""Small simulator configs for tests and benchmarks, from flat keyword settings.

``sim_config(steps=8, batch_size=8, kv_capacity_tokens=24_000, ...)`` builds a validated
``AppConfig`` for the simulator: each keyword names one setting and is written to the config
key it belongs to (:data:`KEYS`; ``cost_model`` sets the router's model, which the engines run
too), so a test states a workload in one flat list and still goes through the config every
user goes through.
"""

from __future__ import annotations

from typing import Any

from staleflow_trainer.config import STRATEGY_FIELDS
from staleflow_trainer.config_sim import colocated

#: Flat setting → app config key.
KEYS = {
    "policy": "coordinator.policy",
    "profile": "coordinator.profile",
    "eta": "protocol.eta",
    "steps": "trainer.steps",
    "seed": "run.seed",
    "batch_size": "protocol.batch_size",
    "group_size": "protocol.group_size",
    "stuck_threshold": "protocol.stuck_threshold",
    "stuck_after_s": "protocol.stuck_after_s",
    "batch_redundancy": "protocol.batch_redundancy",
    "group_redundancy": "protocol.group_redundancy",
    "unbounded_inflight_batches": "protocol.unbounded_inflight_batches",
    "dynamic_sampling": "trainer.dynamic_sampling",
    "max_running": "rollout.max_running",
    "num_instances": "rollout.num_instances",
    "max_response_len": "rollout.sampling.max_new_tokens",
    "prompt_len_max": "data.max_prompt_len",
    "prompt_len": "sim.workload.prompt_len",
    "prompt_len_sigma": "sim.workload.prompt_len_sigma",
    "response_len_median": "sim.workload.response_len_median",
    "response_len_sigma": "sim.workload.response_len_sigma",
    "group_correlation": "sim.workload.group_correlation",
    "reward_mean": "sim.workload.reward_mean",
    "cycle_period_s": "coordinator.snapshot_interval_s",
    "workload_kind": "sim.workload.kind",
    "trace_path": "sim.workload.trace_path",
    **{k: f"coordinator.{k}" for k in STRATEGY_FIELDS},
    **{
        k: f"sim.{k}"
        for k in (
            "k1", "k2", "k3", "k4", "total_gpus", "train_gpus",
            "gpus_per_instance", "kv_capacity_tokens", "prefill_s_per_token",
            "prefill_s_per_token_position", "prefill_mfu", "max_num_batched_tokens", "model",
            "gpu", "gpu_memory_utilization", "memory_reserve_gib", "speed_spread",
            "cost_model_error", "kv_after_weight_load", "trainer_model", "trainer_setup",
            "trainer_time_a_s", "trainer_time_b_s_per_token", "active_params",
            "peak_flops_per_gpu", "mfu", "train_overhead_s", "model_bytes", "push_bandwidth_gb_s",
            "pull_bandwidth_gb_s", "transfer_overhead_s", "reward_time_s",
            "snapshot_max_age_s", "warmup_steps",
        )
    },
}  # fmt: skip

_DEFAULTS = {"cost_model": "qwen-7b-h20", "stuck_threshold": 0, "cycle_period_s": 0.1}


def sim_config(**fields: Any) -> Any:
    """An ``AppConfig`` running the simulator with these settings (see :data:`KEYS`;
    ``rollout_gpus`` sets ``num_instances`` to it over ``gpus_per_instance``)."""
    from staleflow_trainer.config import load_config

    f = {**_DEFAULTS, **fields}
    cost = f.pop("cost_model")
    # rollout_gpus (SimSpec's name) stands for num_instances x gpus_per_instance; the colocated
    # sync policy's instances cover total_gpus (as ``with_policy`` gives them)
    gpi = int(f.get("gpus_per_instance", 1))
    if colocated(str(f.get("policy", ""))):
        f.setdefault("num_instances", int(f.get("total_gpus", 2)) // gpi)
        f.pop("rollout_gpus", None)
    elif "rollout_gpus" in f:
        f.setdefault("num_instances", max(int(f.pop("rollout_gpus")) // gpi, 1))
    f.setdefault("num_instances", 1)
    unknown = sorted(set(f) - set(KEYS))
    if unknown:
        raise KeyError(
            f"unknown simulator setting(s) {unknown}; known: {sorted([*KEYS, 'rollout_gpus'])}"
        )
    over = [f"{KEYS[k]}={v}" for k, v in f.items()]
    prompt = int(f.get("prompt_len_max", 64))
    response = int(f.get("max_response_len", 64))
    base = [
        "rollout.backend=sim",
        f"rollout.max_model_len={prompt + response}",
        # the router's model; the engines run it too unless ``cost_model="custom"`` (k1..k4)
        f"coordinator.cost_model={cost if cost != 'custom' else 'qwen-7b-h20'}",
        f"sim.cost_model={'custom' if cost == 'custom' else 'coordinator'}",
        "metrics.tensorboard=false",
        "metrics.progress_bar=false",
    ]
    return load_config(None, [*base, *over])
