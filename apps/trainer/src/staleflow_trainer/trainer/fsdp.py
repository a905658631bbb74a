"""FSDP2 (``torch.distributed.fsdp.fully_shard``) path for multi-GPU training.

The plan (which modules get their own shard group) and the per-rank batch slicing are pure
functions so they can be unit-tested without GPUs; :func:`shard_model` applies the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar, cast

import torch

from staleflow_trainer.errors import TrainerError

T = TypeVar("T")


def shard_plan(model: torch.nn.Module) -> list[str]:
    """Names of the modules to wrap with ``fully_shard``: every decoder layer, then the root.

    Works for HF decoder-only models whose layers live in a ``ModuleList`` named ``layers``
    (Qwen2/Qwen3/Llama). The root (``""``) comes last so it owns embeddings and the head.
    """
    names = [
        name
        for name, mod in model.named_modules()
        if isinstance(mod, torch.nn.ModuleList) and name.split(".")[-1] == "layers"
    ]
    if not names:
        raise TrainerError(
            f"{type(model).__name__} has no '*.layers' ModuleList to shard", field="model"
        )
    plan: list[str] = []
    for list_name in names:
        layers = cast(torch.nn.ModuleList, model.get_submodule(list_name))
        plan.extend(f"{list_name}.{i}" for i in range(len(layers)))
    plan.append("")
    return plan


def local_slice(items: Sequence[T], *, rank: int, world_size: int) -> list[T]:
    """The contiguous share of ``items`` that ``rank`` trains on (equal shares required)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise TrainerError(f"bad rank {rank} for world_size {world_size}", field="rank")
    if len(items) % world_size:
        raise TrainerError(
            f"batch of {len(items)} samples does not split across {world_size} ranks",
            field="batch",
        )
    per = len(items) // world_size
    return list(items[rank * per : (rank + 1) * per])


def shard_model(model: torch.nn.Module, *, mesh: Any = None) -> torch.nn.Module:
    """Apply ``fully_shard`` per :func:`shard_plan` (torch.distributed must be initialised)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise TrainerError("FSDP2 needs torch.distributed to be initialised", field="fsdp")
    for name in shard_plan(model):
        fully_shard(model.get_submodule(name) if name else model, mesh=mesh)
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gather a full, CPU state dict from a (possibly) FSDP2-sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return cast(dict[str, torch.Tensor], state)
