"""Model geometry and GPU facts, and what they imply for a rollout engine: KV capacity, prefill.

Theory of operation
-------------------
**KV capacity.** A decoder layer stores one key and one value vector per KV head for every
token it has seen, so one token costs ``layers × kv_heads × head_dim × 2 × dtype_bytes`` bytes
of cache (Qwen3-30B-A3B: 48 × 4 × 128 × 2 × 2 = 96 KiB). An engine such as vLLM claims
``gpu_memory_utilization`` of the GPU's memory, loads the weights, sets aside the peak
activation of a profiling forward pass, CUDA-graph pools and allocations outside PyTorch, and
gives the rest to the cache::

    capacity = (memory × gpu_memory_utilization × tp − weight_bytes − reserve × tp)
               / (kv_bytes_per_token)

with tensor parallelism ``tp`` spreading weights and KV heads over ``tp`` GPUs (the per-token
cost is per instance, so the formula divides the instance's total). ``reserve`` (per GPU,
default 4 GiB) stands for the activation peak, CUDA graphs and non-PyTorch memory. For
Qwen3-30B-A3B (30.53 B parameters in bf16: 61.1 GB) on one 96 GB H20 (97,871 MiB reported by
the driver) at 0.9 this gives about 275 K tokens; with the nominal 96 × 10⁹ bytes and no
reserve it is 258 K, so the published range 218–283 K tokens brackets both conventions.

**Prefill.** Computing the cache of a context is compute-bound: every token costs the matrix
multiplications of the active non-embedding parameters (2 FLOPs per parameter) plus causal
attention, whose cost grows with the position ``p`` of the token (``QKᵀ`` and ``AV``: 4 FLOPs
per query head, head dimension and earlier position per layer). A chunk of ``x`` tokens at
positions ``[a, a + x)`` therefore takes::

    x · s_per_token + s_per_token_position · (x·a + x(x − 1)/2)

seconds, where ``s_per_token = matmul_flops_per_token / (peak_flops · mfu · tp)`` and
``s_per_token_position = attention_flops_per_token_position / (peak_flops · mfu · tp)``.
The default ``mfu`` 0.6 is the H20 utilisation the InferSim kernel benchmarks report
(Alibaba, github.com/alibaba/InferSim); it puts a 4 K-token Qwen3-30B-A3B prompt at about
13 K tokens/s, against 16.6 K tokens/s measured with SGLang on one H20 in the same source.

Sources: model geometry from the models' published ``config.json`` (Qwen3-30B-A3B: 48 layers,
32 query heads, 4 KV heads, head dim 128, hidden 2048, 128 experts of width 768, 8 active,
vocabulary 151,936, untied embeddings: 28.99 B parameters in experts; Qwen2.5-7B: 28 layers,
28 / 4 heads, hidden 3584, FFN 18,944; Qwen2.5-14B: 48 layers, 40 / 8 heads, hidden 5120, FFN
13,824; both vocabulary 152,064, untied); parameter counts from the model cards (30.5 B total / 3.3 B active, 7.61 B, 14.7 B).
H20: 96 GB HBM3 at 4.0 TB/s, 148 TFLOP/s dense bf16 (NVIDIA's published figures).
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from engine_adapters.errors import InvalidRequest

GIB = 1 << 30


def _positive(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        raise InvalidRequest(
            f"{type(inst).__name__}.{attribute.name} must be a finite number > 0, got {value!r}",
            field=attribute.name,
        )


@attrs.frozen(kw_only=True)
class ModelSpec:
    """The geometry of a decoder-only transformer, enough for KV, prefill and training FLOPs.

    ``active_params`` counts the parameters one token passes through, embeddings and output
    head included (for a dense model it equals ``total_params``); ``expert_params`` the
    parameters of the routed experts (0 for a dense model), which expert parallelism shards.
    """

    name: str
    num_layers: int = attrs.field(validator=_positive)
    num_q_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    vocab_size: int = attrs.field(validator=_positive)
    total_params: float = attrs.field(validator=_positive)
    active_params: float = attrs.field(validator=_positive)
    expert_params: float = 0.0
    tied_embeddings: bool = False
    dtype_bytes: int = attrs.field(default=2, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if not 0.0 <= self.expert_params < self.total_params:
            raise InvalidRequest(
                f"ModelSpec.expert_params ({self.expert_params:g}) must be in [0, total_params)",
                field="expert_params",
            )
        if self.active_params > self.total_params:
            raise InvalidRequest(
                f"ModelSpec.active_params ({self.active_params:g}) exceeds total_params "
                f"({self.total_params:g})",
                field="active_params",
            )
        if self.num_q_heads % self.num_kv_heads:
            raise InvalidRequest(
                f"ModelSpec.num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})",
                field="num_kv_heads",
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token costs: layers × KV heads × head dim × 2 (K, V) × dtype."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        return round(self.total_params * self.dtype_bytes)

    @property
    def embedding_params(self) -> int:
        """Input embedding table (a lookup, no FLOPs)."""
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Output projection to the vocabulary (a matmul for every position it is run on)."""
        return self.vocab_size * self.hidden_size

    @property
    def body_params_active(self) -> float:
        """Active parameters without the embedding table and the output head."""
        head = 0 if self.tied_embeddings else self.lm_head_params
        return self.active_params - self.embedding_params - head

    @property
    def matmul_flops_per_token(self) -> float:
        """Forward matmul FLOPs per token of the body (2 per active parameter), no LM head."""
        return 2.0 * self.body_params_active

    @property
    def attention_flops_per_token_position(self) -> float:
        """Forward attention FLOPs of one token per earlier position: 4 · layers · heads · dim."""
        return 4.0 * self.num_layers * self.num_q_heads * self.head_dim


@attrs.frozen(kw_only=True)
class GpuSpec:
    """One accelerator: memory the driver reports, dense bf16 peak, HBM bandwidth."""

    name: str
    memory_bytes: int = attrs.field(validator=_positive)
    bf16_flops: float = attrs.field(validator=_positive)
    hbm_bytes_per_s: float = attrs.field(validator=_positive)


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec(
            name="qwen3-30b-a3b",
            num_layers=48,
            num_q_heads=32,
            num_kv_heads=4,
            head_dim=128,
            hidden_size=2048,
            vocab_size=151_936,
            total_params=30.53e9,
            active_params=3.35e9,
            expert_params=128 * 3 * 2048 * 768 * 48,  # 28.99 B
        ),
        ModelSpec(
            name="qwen2.5-7b",
            num_layers=28,
            num_q_heads=28,
            num_kv_heads=4,
            head_dim=128,
            hidden_size=3584,
            vocab_size=152_064,
            total_params=7.61e9,
            active_params=7.61e9,
        ),
        ModelSpec(
            name="qwen2.5-14b",
            num_layers=48,
            num_q_heads=40,
            num_kv_heads=8,
            head_dim=128,
            hidden_size=5120,
            vocab_size=152_064,
            total_params=14.7e9,
            active_params=14.7e9,
        ),
    )
}

GPUS: dict[str, GpuSpec] = {
    "h20": GpuSpec(
        name="h20", memory_bytes=97_871 * (1 << 20), bf16_flops=148e12, hbm_bytes_per_s=4.0e12
    ),
}


def model_spec(value: ModelSpec | str) -> ModelSpec:
    """A :class:`ModelSpec`, or the preset of that name (see :data:`MODELS`)."""
    if isinstance(value, ModelSpec):
        return value
    try:
        return MODELS[value]
    except (KeyError, TypeError):
        raise InvalidRequest(
            f"unknown model {value!r}; allowed: {sorted(MODELS)} or a ModelSpec", field="model"
        ) from None


def gpu_spec(value: GpuSpec | str) -> GpuSpec:
    """A :class:`GpuSpec`, or the preset of that name (see :data:`GPUS`)."""
    if isinstance(value, GpuSpec):
        return value
    try:
        return GPUS[value]
    except (KeyError, TypeError):
        raise InvalidRequest(
            f"unknown gpu {value!r}; allowed: {sorted(GPUS)} or a GpuSpec", field="gpu"
        ) from None


def kv_capacity_tokens(
    model: ModelSpec | str,
    gpu: GpuSpec | str,
    *,
    gpu_memory_utilization: float = 0.9,
    tensor_parallel_size: int = 1,
    reserve_bytes: int = 4 * GIB,
) -> int:
    """KV-cache tokens one instance holds (see the module docstring for the formula).

    Raises :class:`InvalidRequest` naming the field when the inputs are out of range or the
    weights and reserve leave no room for a cache.
    """
    m, g = model_spec(model), gpu_spec(gpu)
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise InvalidRequest(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}",
            field="gpu_memory_utilization",
        )
    if isinstance(tensor_parallel_size, bool) or tensor_parallel_size < 1:
        raise InvalidRequest(
            f"tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}",
            field="tensor_parallel_size",
        )
    if reserve_bytes < 0:
        raise InvalidRequest(
            f"reserve_bytes must be >= 0, got {reserve_bytes!r}", field="reserve_bytes"
        )
    tp = tensor_parallel_size
    free = g.memory_bytes * gpu_memory_utilization * tp - m.weight_bytes - reserve_bytes * tp
    tokens = int(free // m.kv_bytes_per_token)
    if tokens <= 0:
        raise InvalidRequest(
            f"{m.name} ({m.weight_bytes / 1e9:.1f} GB of weights) leaves no KV cache on "
            f"{tp} x {g.name} at gpu_memory_utilization {gpu_memory_utilization} with "
            f"{reserve_bytes / GIB:.1f} GiB reserved per GPU",
            field="gpu_memory_utilization",
        )
    return tokens


def prefill_coefficients(
    model: ModelSpec | str, gpu: GpuSpec | str, *, mfu: float = 0.6, tensor_parallel_size: int = 1
) -> tuple[float, float]:
    """``(s_per_token, s_per_token_position)`` of prefill (see the module docstring)."""
    m, g = model_spec(model), gpu_spec(gpu)
    if not (isinstance(mfu, int | float) and 0.0 < mfu <= 1.0):
        raise InvalidRequest(f"prefill mfu must be in (0, 1], got {mfu!r}", field="prefill_mfu")
    rate = g.bf16_flops * mfu * tensor_parallel_size
    return m.matmul_flops_per_token / rate, m.attention_flops_per_token_position / rate
