"""Configuration of one simulated rollout instance."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from engine_adapters.errors import InvalidRequest
from engine_adapters.sim.cost import PRESETS, CostModel, preset


def _to_cost(value: CostModel | str | Mapping[str, Any]) -> CostModel:
    if isinstance(value, CostModel):
        return value
    if isinstance(value, str):
        return preset(value)
    if isinstance(value, Mapping):
        return CostModel(**value)
    raise InvalidRequest(
        f"cost must be a CostModel, a preset name {sorted(PRESETS)} or a mapping, got {value!r}",
        field="cost",
    )


def _to_weight_shapes(
    value: Mapping[str, Sequence[int]] | Sequence[tuple[str, Sequence[int]]] | None,
) -> tuple[tuple[str, tuple[int, ...]], ...] | None:
    if value is None:
        return None
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), tuple(int(d) for d in shape)) for k, shape in items))


def _positive(inst: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise InvalidRequest(
            f"SimConfig.{attribute.name} must be finite and > 0, got {value!r}",
            field=attribute.name,
        )


def _non_negative(inst: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (value >= 0 and math.isfinite(value)):
        raise InvalidRequest(
            f"SimConfig.{attribute.name} must be finite and >= 0, got {value!r}",
            field=attribute.name,
        )


@attrs.frozen(kw_only=True)
class SimConfig:
    """One simulated instance: batching limits, cost model, weight loading, token synthesis.

    ``kv_capacity_tokens`` must hold at least one full-length trajectory (``max_model_len``), so
    a lone trajectory can always finish. Token ids below ``num_special_tokens`` are never
    sampled at random; ``eos_token_id`` (special) is emitted at a trajectory's natural end
    (``GenerateRequest.target_length``) and stops it only if it is in the request's
    ``stop_token_ids``.
    """

    cost: CostModel = attrs.field(
        default=attrs.Factory(lambda: preset("qwen3-30b-a3b-h20")), converter=_to_cost
    )
    max_running: int = attrs.field(default=256, validator=_positive)
    kv_capacity_tokens: int = attrs.field(default=1_000_000, validator=_positive)
    max_model_len: int = attrs.field(default=32_768, validator=_positive)
    prefill_s_per_token: float = attrs.field(default=5e-5, validator=_non_negative)
    weight_bandwidth_bytes_per_s: float = attrs.field(default=10e9, validator=_positive)
    weight_load_constant_s: float = attrs.field(default=0.5, validator=_non_negative)
    weight_dtype_bytes: int = attrs.field(default=2, validator=_positive)
    weight_shapes: tuple[tuple[str, tuple[int, ...]], ...] | None = attrs.field(
        default=None, converter=_to_weight_shapes
    )
    vocab_size: int = attrs.field(default=32_000, validator=_positive)
    num_special_tokens: int = attrs.field(default=16, validator=_positive)
    eos_token_id: int = attrs.field(default=2, validator=_non_negative)
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if self.max_model_len > self.kv_capacity_tokens:
            raise InvalidRequest(
                f"SimConfig.max_model_len={self.max_model_len} exceeds kv_capacity_tokens="
                f"{self.kv_capacity_tokens}; one full trajectory must fit in the KV cache",
                field="max_model_len",
            )
        if not self.eos_token_id < self.num_special_tokens < self.vocab_size:
            raise InvalidRequest(
                "SimConfig needs eos_token_id < num_special_tokens < vocab_size, got "
                f"{self.eos_token_id}, {self.num_special_tokens}, {self.vocab_size}",
                field="num_special_tokens",
            )

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
