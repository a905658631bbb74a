"""The weight schema of a checkpoint, and validation of incoming tensors against it.

Incoming tensors use the Hugging Face checkpoint names (``model.layers.0.self_attn.q_proj
.weight``, what a trainer's ``state_dict()`` yields), not vLLM's fused parameter names. The
schema is read from the safetensors headers of the model directory, so validation needs no
engine round trip and happens before anything is touched.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from engine_adapters.errors import InvalidWeights

_EMBED = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"
_SHOW = 8  # names listed per category in error messages


def _read_safetensors_header(path: Path) -> dict[str, tuple[int, ...]]:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {
        name: tuple(int(d) for d in entry["shape"])
        for name, entry in header.items()
        if name != "__metadata__"
    }


@attrs.frozen(kw_only=True)
class WeightSchema:
    required: Mapping[str, tuple[int, ...]]
    optional: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> WeightSchema:
        model_dir = Path(model_dir)
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors checkpoint in {model_dir}")
        required: dict[str, tuple[int, ...]] = {}
        for file in files:
            required.update(_read_safetensors_header(file))
        optional: dict[str, tuple[int, ...]] = {}
        config_path = model_dir / "config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        # Tied embeddings: checkpoints omit lm_head but a trainer's state_dict() carries it.
        if config.get("tie_word_embeddings") and _LM_HEAD not in required and _EMBED in required:
            optional[_LM_HEAD] = required[_EMBED]
        return cls(required=required, optional=optional)

    def validate(self, named_tensors: Mapping[str, Any]) -> tuple[list[str], list[Any]]:
        """Check names, types and shapes; return (names, CPU contiguous tensors).

        Raises :class:`InvalidWeights` listing every missing, extra, mis-shaped and non-tensor
        entry; nothing is modified.
        """
        import torch

        given = set(named_tensors)
        missing = sorted(set(self.required) - given)
        extra = sorted(given - set(self.required) - set(self.optional))
        mis_shaped: list[str] = []
        bad_type: list[str] = []
        names: list[str] = []
        tensors: list[Any] = []
        for name in sorted(given - set(extra)):
            value = named_tensors[name]
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                bad_type.append(f"{name} ({type(value).__name__})")
                continue
            expected = self.required.get(name, self.optional.get(name))
            if tuple(value.shape) != expected:
                mis_shaped.append(f"{name}: got {tuple(value.shape)}, expected {expected}")
                continue
            names.append(name)
            tensors.append(value.detach().to("cpu").contiguous())
        if missing or extra or mis_shaped or bad_type:
            parts = []
            for label, items in (
                ("missing", missing),
                ("unexpected", extra),
                ("mis-shaped", mis_shaped),
                ("not floating-point tensors", bad_type),
            ):
                if items:
                    more = f" (+{len(items) - _SHOW} more)" if len(items) > _SHOW else ""
                    parts.append(f"{label}: {', '.join(items[:_SHOW])}{more}")
            err = InvalidWeights(
                "weights rejected, engine keeps its current version; " + "; ".join(parts),
                field="named_tensors",
            )
            err.missing = missing  # type: ignore[attr-defined]
            err.unexpected = extra  # type: ignore[attr-defined]
            err.mis_shaped = mis_shaped  # type: ignore[attr-defined]
            err.bad_type = bad_type  # type: ignore[attr-defined]
            raise err
        return names, tensors
