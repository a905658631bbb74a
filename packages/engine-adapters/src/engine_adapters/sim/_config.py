"""Configuration of one simulated rollout instance.

The instance is a model (:class:`~engine_adapters.hardware.ModelSpec`) served on
``tensor_parallel_size`` GPUs (:class:`~engine_adapters.hardware.GpuSpec`); by default
Qwen3-30B-A3B on one H20, the published cost-model fit's setting. From those facts come:

* the KV capacity (:func:`~engine_adapters.hardware.kv_capacity_tokens`) — a hand-set
  ``kv_capacity_tokens`` overrides it;
* the prefill coefficients (:func:`~engine_adapters.hardware.prefill_coefficients` at
  ``prefill_mfu``) — ``prefill_s_per_token`` and ``prefill_s_per_token_position`` override
  them; setting either one makes the other 0 unless it is set too, so an explicit linear
  prefill means exactly that.

``max_num_batched_tokens`` is the per-step token budget of chunked prefill (vLLM's name; None:
no chunking, a whole context is prefilled in one step). ``speed_factor`` makes the instance
uniformly faster (> 1) or slower (< 1) than its cost model and prefill coefficients say;
:func:`draw_speed_factors` draws a heterogeneous fleet. ``kv_after_weight_load`` says what a
weight load does to trajectories that are still running: ``recompute`` (real engines: the
cache is flushed with the old weights, so each running trajectory re-prefills its whole
context on the new version) or ``keep`` (an idealised engine that keeps the old cache).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import numpy as np

from engine_adapters.cost_model import CostModel, preset
from engine_adapters.errors import CostModelError, InvalidRequest
from engine_adapters.hardware import (
    GIB,
    GpuSpec,
    ModelSpec,
    gpu_spec,
    kv_capacity_tokens,
    model_spec,
    prefill_coefficients,
)

KvAfterLoad = Literal["recompute", "keep"]


def _to_cost(value: CostModel | str | Mapping[str, Any]) -> CostModel:
    try:
        return CostModel.resolve(value)
    except CostModelError as exc:
        raise InvalidRequest(f"SimConfig.cost: {exc}", field="cost") from None


def _to_model(value: ModelSpec | str) -> ModelSpec:
    return model_spec(value)


def _to_gpu(value: GpuSpec | str) -> GpuSpec:
    return gpu_spec(value)


def _to_weight_shapes(
    value: Mapping[str, Sequence[int]] | Sequence[tuple[str, Sequence[int]]] | None,
) -> tuple[tuple[str, tuple[int, ...]], ...] | None:
    if value is None:
        return None
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), tuple(int(d) for d in shape)) for k, shape in items))


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not (_number(value) and value > 0):
        raise InvalidRequest(
            f"SimConfig.{attribute.name} must be finite and > 0, got {value!r}",
            field=attribute.name,
        )


def _non_negative(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not (_number(value) and value >= 0):
        raise InvalidRequest(
            f"SimConfig.{attribute.name} must be finite and >= 0, got {value!r}",
            field=attribute.name,
        )


def _optional(check: Any) -> Any:
    def validate(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None:
            check(inst, attribute, value)

    return validate


def _unit(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not (_number(value) and 0 < value <= 1):
        raise InvalidRequest(
            f"SimConfig.{attribute.name} must be in (0, 1], got {value!r}", field=attribute.name
        )


def _kv_after_load(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in ("recompute", "keep"):
        raise InvalidRequest(
            f"SimConfig.kv_after_weight_load must be 'recompute' or 'keep', got {value!r}",
            field=attribute.name,
        )


@attrs.frozen(kw_only=True)
class SimConfig:
    """One simulated instance: batching limits, cost model, memory, prefill, weights, tokens.

    The KV capacity must hold at least one full-length trajectory (``max_model_len``), so a
    lone trajectory can always finish. Token ids below ``num_special_tokens`` are never sampled
    at random; ``eos_token_id`` (special) is emitted at a trajectory's natural end
    (``GenerateRequest.target_length``) and stops it only if it is in the request's
    ``stop_token_ids``.
    """

    cost: CostModel = attrs.field(
        default=attrs.Factory(lambda: preset("qwen3-30b-a3b-h20")), converter=_to_cost
    )
    max_running: int = attrs.field(default=256, validator=_positive)
    max_model_len: int = attrs.field(default=32_768, validator=_positive)

    # --- memory: the KV capacity comes from these unless kv_capacity_tokens overrides it
    model: ModelSpec = attrs.field(
        default=attrs.Factory(lambda: model_spec("qwen3-30b-a3b")), converter=_to_model
    )
    gpu: GpuSpec = attrs.field(default=attrs.Factory(lambda: gpu_spec("h20")), converter=_to_gpu)
    tensor_parallel_size: int = attrs.field(default=1, validator=_positive)
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=_unit)
    #: Per GPU: activation peak, CUDA graphs, allocations outside PyTorch.
    memory_reserve_bytes: int = attrs.field(default=4 * GIB, validator=_non_negative)
    kv_capacity_tokens: int | None = attrs.field(default=None, validator=_optional(_positive))

    # --- prefill
    prefill_mfu: float = attrs.field(default=0.6, validator=_unit)
    prefill_s_per_token: float | None = attrs.field(
        default=None, validator=_optional(_non_negative)
    )
    prefill_s_per_token_position: float | None = attrs.field(
        default=None, validator=_optional(_non_negative)
    )
    max_num_batched_tokens: int | None = attrs.field(default=None, validator=_optional(_positive))

    # --- behaviour
    speed_factor: float = attrs.field(default=1.0, validator=_positive)
    kv_after_weight_load: KvAfterLoad = attrs.field(default="recompute", validator=_kv_after_load)

    # --- weight loading
    weight_bandwidth_bytes_per_s: float = attrs.field(default=10e9, validator=_positive)
    weight_load_constant_s: float = attrs.field(default=0.5, validator=_non_negative)
    weight_dtype_bytes: int = attrs.field(default=2, validator=_positive)
    weight_shapes: tuple[tuple[str, tuple[int, ...]], ...] | None = attrs.field(
        default=None, converter=_to_weight_shapes
    )

    # --- token synthesis
    vocab_size: int = attrs.field(default=32_000, validator=_positive)
    num_special_tokens: int = attrs.field(default=16, validator=_positive)
    eos_token_id: int = attrs.field(default=2, validator=_non_negative)
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if self.max_model_len > self.kv_capacity:
            raise InvalidRequest(
                f"SimConfig.max_model_len={self.max_model_len} exceeds the KV capacity "
                f"{self.kv_capacity} tokens; one full trajectory must fit in the KV cache",
                field="max_model_len",
            )
        budget = self.max_num_batched_tokens
        if budget is not None and budget <= self.max_running:
            raise InvalidRequest(
                f"SimConfig.max_num_batched_tokens={budget} must exceed max_running="
                f"{self.max_running}: every decoding trajectory takes one token of the budget "
                "and prefill needs the rest",
                field="max_num_batched_tokens",
            )
        if not self.eos_token_id < self.num_special_tokens < self.vocab_size:
            raise InvalidRequest(
                "SimConfig needs eos_token_id < num_special_tokens < vocab_size, got "
                f"{self.eos_token_id}, {self.num_special_tokens}, {self.vocab_size}",
                field="num_special_tokens",
            )

    @functools.cached_property
    def kv_capacity(self) -> int:
        """KV tokens the instance holds: the override, else derived from model and GPU."""
        if self.kv_capacity_tokens is not None:
            return self.kv_capacity_tokens
        return kv_capacity_tokens(
            self.model,
            self.gpu,
            gpu_memory_utilization=self.gpu_memory_utilization,
            tensor_parallel_size=self.tensor_parallel_size,
            reserve_bytes=self.memory_reserve_bytes,
        )

    @functools.cached_property
    def prefill(self) -> tuple[float, float]:
        """``(s_per_token, s_per_token_position)`` at speed 1 (see the module docstring)."""
        lin, quad = self.prefill_s_per_token, self.prefill_s_per_token_position
        if lin is None and quad is None:
            return prefill_coefficients(
                self.model,
                self.gpu,
                mfu=self.prefill_mfu,
                tensor_parallel_size=self.tensor_parallel_size,
            )
        return (lin or 0.0, quad or 0.0)

    def prefill_seconds(self, start: int, count: int) -> float:
        """Seconds to prefill ``count`` context tokens at positions ``[start, start+count)``."""
        lin, quad = self.prefill
        return (lin * count + quad * (count * start + count * (count - 1) / 2)) / self.speed_factor

    @property
    def weight_shape_map(self) -> dict[str, tuple[int, ...]] | None:
        return None if self.weight_shapes is None else dict(self.weight_shapes)

    def weight_load_seconds(self, nbytes: int) -> float:
        """Time to load ``nbytes`` of weights: ``nbytes / bandwidth + constant``."""
        return nbytes / self.weight_bandwidth_bytes_per_s + self.weight_load_constant_s

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> SimConfig:
        allowed = {a.name for a in attrs.fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise InvalidRequest(
                f"unknown SimConfig field(s) {unknown}; allowed: {sorted(allowed)}",
                field=unknown[0],
            )
        return cls(**data)


def draw_speed_factors(count: int, *, spread: float, seed: int = 0) -> tuple[float, ...]:
    """``count`` instance speed factors: lognormal with log-std ``spread``, mean exactly 1.

    ``spread = 0`` gives a homogeneous fleet. Deterministic under ``seed``.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InvalidRequest(f"count must be an integer >= 1, got {count!r}", field="count")
    if not (_number(spread) and spread >= 0):
        raise InvalidRequest(f"spread must be finite and >= 0, got {spread!r}", field="spread")
    raw = np.random.default_rng([seed, 0x5EED]).lognormal(0.0, spread, size=count)
    return tuple(float(x) for x in raw / raw.mean())
