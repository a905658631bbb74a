"""Worker-side half of the weight load; runs inside vLLM's worker process.

``AsyncLLM`` always runs its EngineCore in a child process, so ``collective_rpc`` arguments
cross vLLM's utility-call msgpack, where tensors arrive as nested lists and tuples as lists;
with a multiprocess executor (tensor parallelism) they also cross a pickled broadcast that
cannot carry tensors at all (``cannot pickle memoryview objects``). So tensors travel as
(dtype, shape, raw bytes) (:func:`encode_tensors`) and this extension (mixed into the worker
class through ``worker_extension_cls``) rebuilds the ``(name, tensor)`` pairs.

``reload_weights`` (not ``model.load_weights``) is required: it re-runs the CPU kernels'
weight repacking (oneDNN / sgl-gemm) that a plain ``load_weights`` would skip.
"""

from __future__ import annotations

from typing import Any


def encode_tensors(tensors: list[Any]) -> tuple[list[str], list[list[int]], list[bytes]]:
    """Tensors → (dtype names, shapes, raw bytes) that survive pickling."""
    import torch

    dtypes, shapes, buffers = [], [], []
    for t in tensors:
        dtypes.append(str(t.dtype).removeprefix("torch."))
        shapes.append(list(t.shape))
        buffers.append(t.contiguous().view(torch.uint8).numpy().tobytes())
    return dtypes, shapes, buffers


def decode_tensors(dtypes: list[str], shapes: list[list[int]], buffers: list[bytes]) -> list[Any]:
    import torch

    return [
        torch.frombuffer(bytearray(buf), dtype=torch.uint8).view(getattr(torch, dt)).reshape(shape)
        for dt, shape, buf in zip(dtypes, shapes, buffers, strict=True)
    ]


class WeightLoadExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def staleflow_reload_weights(self, names: list[str], tensors: list[Any]) -> int:
        if len(names) != len(tensors):
            raise ValueError(f"{len(names)} names but {len(tensors)} tensors")
        self.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=list(zip(names, tensors, strict=True)), is_checkpoint_format=True
        )
        return len(names)

    def staleflow_reload_weights_bytes(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], buffers: list[bytes]
    ) -> int:
        return self.staleflow_reload_weights(names, decode_tensors(dtypes, shapes, buffers))
