"""Seconds per training step of a Megatron trainer, from the tokens of the step and its setup.

Theory of operation
-------------------
A step of the RL trainer on Megatron (the way verl runs it) has four parts:

1. **Log-prob pass** — one forward over the batch with the trainer's weights (the "old" /
   proximal log-probs the loss needs), when ``logprob_pass`` is on.
2. **Update** — forward and backward of every micro-batch, one optimizer step. With
   ``full_recompute`` the backward recomputes each layer's forward (one more forward).
3. **Pipeline bubble** — with ``pipeline_parallel = p > 1`` and ``m`` micro-batches per
   pipeline, a 1F1B schedule idles ``(p − 1)/m`` of the time (Narayanan et al., "Efficient
   Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21): both passes
   take ``(m + p − 1)/m`` times as long. ``m`` is the tokens per data-parallel rank over
   ``max_tokens_per_microbatch`` (dynamic batching packs micro-batches up to that many tokens).
4. **Offload and fixed costs** — with parameter offload the weights (bf16, 2 B) are loaded to
   the GPU before the step and written back after it, and the fp32 gradients (4 B) are written
   out: 8 B per parameter a GPU holds, over PCIe. With optimizer offload the Adam step runs on
   the CPU over the parameters whose optimizer state the GPU's process owns (the distributed
   optimizer shards it: ``total_params / num_gpus`` each). Plus a fixed per-step cost (batch
   collation, advantages, launching, logging).

The FLOPs are counted exactly as verl's ``flops_counter`` counts them, because its measured MFU
is the calibration::

    F_update = 6 · N · tokens + 12 · Σ seq_len² · head_dim · q_heads · layers

with ``N`` the active parameters, embeddings and output head included
(:attr:`~engine_adapters.hardware.ModelSpec.active_params`). The update takes
``F_update × (4/3 with full recompute) × bubble / (num_gpus × peak × update_mfu)``; the
log-prob pass ``F_update / 3 × bubble / (num_gpus × peak × update_mfu × logprob_efficiency)``.

Numbers and their sources
-------------------------
* **Qwen3-30B-A3B update MFU 0.31** on 32 H20 (96 GB) with Megatron TP 1, PP 1, EP 8,
  parameter, gradient and optimizer offload — verl's documentation, "Training DeepSeek 671b /
  Qwen3-30B-A3B MOE" (docs/perf/dpsk.md: 0.40 on 8 GPUs, 0.37 on 16, 0.31 on 32), measured with
  its recipe ``examples/grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh``, which sets no
  activation recompute; the MFU is verl's (the formula above over the update's time).
* **Dense 7B / 14B update MFU 0.40** — an assumption (no published H20 Megatron figure was
  found): between verl's 8-GPU MoE figure (0.40) and Megatron-Core's dense H100 figures (up to
  0.47, NVIDIA's Megatron-Core performance summary), lowered for offload. ±25 %.
* **logprob_efficiency 0.63** — in verl's fully-async recipe README (recipe/fully_async_policy,
  Qwen2.5-Math-7B on 32 H20, colocated, FSDP2 with gradient checkpointing) the update took
  269.8 s and the log-prob pass 107.7 s per step: a ratio of 2.5 where equal efficiency gives 4
  (3 for forward + backward, 4/3 for the recompute), so the forward-only pass runs at 2.5/4 of
  the update's efficiency.
* **PCIe 25 GB/s per GPU** — PCIe Gen5 x16 (64 GB/s per direction nominal) at the pinned-copy
  rate typically reached by offload engines; **CPU Adam 0.5 G parameters/s per GPU** — an
  assumption for a node's CPU shared by 8 processes (±50 %); **fixed 5 s** — an assumption.
* Peak 148 TFLOP/s dense bf16 per H20 (NVIDIA); model geometry from
  :mod:`engine_adapters.hardware`.
* The paper's 30B-A3B run: 4 training nodes × 8 H20 with Megatron TP/PP/EP, parameter and
  optimizer offload, full activation recompute and a log-prob recompute pass
  (:data:`SETUPS` ``qwen3-30b-a3b``: the parallel sizes of verl's 32-GPU recommendation,
  TP 1 / PP 1 / EP 8). The 7B / 14B setups use the same 32 training GPUs with TP 1 and TP 2
  (assumptions: the paper's splits for them are not stated here).

What it leaves out: communication not hidden by the measured MFU (the MFU includes the EP
all-to-all of the setup it was measured on), the weight export for the rollout (the caller
models the push), stragglers in dynamic batching, and any change of MFU with sequence length.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from engine_adapters.hardware import GpuSpec, ModelSpec, gpu_spec, model_spec
from staleflow_trainer.errors import ConfigError


def _positive(inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v > 0):
        raise ConfigError(
            f"trainer model: {a.name} must be a finite number > 0, got {v!r}",
            key=f"trainer_model.{a.name}",
            allowed="> 0",
        )


def _non_negative(inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v >= 0):
        raise ConfigError(
            f"trainer model: {a.name} must be a finite number >= 0, got {v!r}",
            key=f"trainer_model.{a.name}",
            allowed=">= 0",
        )


def _unit(inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= 1:
        raise ConfigError(
            f"trainer model: {a.name} must be in (0, 1], got {v!r}",
            key=f"trainer_model.{a.name}",
            allowed="(0, 1]",
        )


def _count(inst: Any, a: attrs.Attribute[Any], v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(
            f"trainer model: {a.name} must be an integer >= 1, got {v!r}",
            key=f"trainer_model.{a.name}",
            allowed="an integer >= 1",
        )


@attrs.frozen(kw_only=True)
class StepBreakdown:
    """Where one step's seconds go (see :class:`MegatronSetup`)."""

    update_s: float
    logprob_s: float
    offload_s: float
    optimizer_s: float
    fixed_s: float
    bubble_factor: float

    @property
    def total_s(self) -> float:
        return self.update_s + self.logprob_s + self.offload_s + self.optimizer_s + self.fixed_s


@attrs.frozen(kw_only=True)
class MegatronSetup:
    """A Megatron training setup; :meth:`step_seconds` is the model (module docstring)."""

    name: str
    model: ModelSpec = attrs.field(converter=model_spec)
    gpu: GpuSpec = attrs.field(converter=gpu_spec)
    num_gpus: int = attrs.field(validator=_count)
    tensor_parallel: int = attrs.field(default=1, validator=_count)
    pipeline_parallel: int = attrs.field(default=1, validator=_count)
    expert_parallel: int = attrs.field(default=1, validator=_count)
    max_tokens_per_microbatch: int = attrs.field(default=22_528, validator=_count)
    full_recompute: bool = True
    param_offload: bool = True
    optimizer_offload: bool = True
    logprob_pass: bool = True
    update_mfu: float = attrs.field(validator=_unit)
    logprob_efficiency: float = attrs.field(default=0.63, validator=_unit)
    pcie_bytes_per_s: float = attrs.field(default=25e9, validator=_positive)
    cpu_adam_params_per_s: float = attrs.field(default=0.5e9, validator=_positive)
    fixed_s: float = attrs.field(default=5.0, validator=_non_negative)
    #: Sequence length assumed for the attention term when the caller gives only tokens.
    assumed_seq_len: int = attrs.field(default=4096, validator=_count)

    def __attrs_post_init__(self) -> None:
        model_shards = self.tensor_parallel * self.pipeline_parallel
        if self.num_gpus % model_shards:
            raise ConfigError(
                f"trainer model: num_gpus={self.num_gpus} is not a multiple of tensor_parallel x "
                f"pipeline_parallel = {model_shards}",
                key="trainer_model.num_gpus",
                allowed=f"a multiple of {model_shards}",
            )
        if self.num_gpus % (self.expert_parallel * self.pipeline_parallel):
            raise ConfigError(
                f"trainer model: num_gpus={self.num_gpus} is not a multiple of expert_parallel x "
                f"pipeline_parallel = {self.expert_parallel * self.pipeline_parallel}",
                key="trainer_model.expert_parallel",
                allowed="a divisor of num_gpus / pipeline_parallel",
            )
        if self.model.expert_params == 0 and self.expert_parallel > 1:
            raise ConfigError(
                f"trainer model: expert_parallel={self.expert_parallel} for the dense model "
                f"{self.model.name}",
                key="trainer_model.expert_parallel",
                allowed="1 for a dense model",
            )

    @property
    def data_parallel(self) -> int:
        return self.num_gpus // (self.tensor_parallel * self.pipeline_parallel)

    @property
    def params_per_gpu(self) -> float:
        """Parameters one GPU holds: dense ones split by TP x PP, experts by EP x PP."""
        m = self.model
        dense = m.total_params - m.expert_params
        return dense / (self.tensor_parallel * self.pipeline_parallel) + m.expert_params / (
            self.expert_parallel * self.pipeline_parallel
        )

    def update_flops(self, tokens: float, seq_sq_sum: float) -> float:
        """verl's count: ``6·N·tokens + 12·Σs²·head_dim·heads·layers`` (forward + backward)."""
        m = self.model
        return 6.0 * m.active_params * tokens + 3.0 * m.attention_flops_per_token_position * (
            seq_sq_sum
        )

    def breakdown(self, tokens: float, seq_sq_sum: float | None = None) -> StepBreakdown:
        """The step's parts for ``tokens`` (prompt + response) in sequences whose squared
        lengths sum to ``seq_sq_sum`` (default: sequences of ``assumed_seq_len``)."""
        tokens = float(tokens)
        if not (math.isfinite(tokens) and tokens >= 0):
            raise ConfigError(
                f"trainer model: tokens must be a finite number >= 0, got {tokens!r}",
                key="tokens",
                allowed=">= 0",
            )
        sq = tokens * self.assumed_seq_len if seq_sq_sum is None else float(seq_sq_sum)
        flops = self.update_flops(tokens, sq)
        rate = self.num_gpus * self.gpu.bf16_flops * self.update_mfu
        p = self.pipeline_parallel
        micro = max(1, math.ceil(tokens / (self.data_parallel * self.max_tokens_per_microbatch)))
        bubble = (micro + p - 1) / micro
        update = flops * (4.0 / 3.0 if self.full_recompute else 1.0) * bubble / rate
        logprob = flops / 3.0 * bubble / (rate * self.logprob_efficiency)
        return StepBreakdown(
            update_s=update,
            logprob_s=logprob if self.logprob_pass else 0.0,
            offload_s=8.0 * self.params_per_gpu / self.pcie_bytes_per_s
            if self.param_offload
            else 0.0,
            optimizer_s=self.model.total_params / self.num_gpus / self.cpu_adam_params_per_s
            if self.optimizer_offload
            else 0.0,
            fixed_s=self.fixed_s,
            bubble_factor=bubble,
        )

    def step_seconds(self, tokens: float, seq_sq_sum: float | None = None) -> float:
        """Seconds of one training step (see :meth:`breakdown`)."""
        return self.breakdown(tokens, seq_sq_sum).total_s


#: The paper's settings (module docstring): 4 training nodes of 8 H20.
SETUPS: dict[str, MegatronSetup] = {
    s.name: s
    for s in (
        MegatronSetup(
            name="qwen3-30b-a3b",
            model="qwen3-30b-a3b",
            gpu="h20",
            num_gpus=32,
            expert_parallel=8,
            update_mfu=0.31,
        ),
        MegatronSetup(
            name="qwen2.5-7b", model="qwen2.5-7b", gpu="h20", num_gpus=32, update_mfu=0.40
        ),
        MegatronSetup(
            name="qwen2.5-14b",
            model="qwen2.5-14b",
            gpu="h20",
            num_gpus=32,
            tensor_parallel=2,
            update_mfu=0.40,
        ),
    )
}


def setup(name: str) -> MegatronSetup:
    """A setup of :data:`SETUPS` by name."""
    try:
        return SETUPS[name]
    except KeyError:
        raise ConfigError(
            f"unknown trainer setup {name!r}",
            key="trainer_model.setup",
            allowed=f"one of {sorted(SETUPS)}",
        ) from None
