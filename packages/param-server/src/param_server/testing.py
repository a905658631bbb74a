"""Helpers for tests that need pull clients in other processes.

They live in the package (not in a test module) because ``multiprocessing`` spawn children
re-import the target function by module name, and test modules are not importable packages.
"""

from __future__ import annotations

from typing import Any


def tensor_bytes(tensors: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """``name -> (dtype, shape, raw bytes)``: a picklable, exact fingerprint of tensors."""
    import torch

    return {
        k: (
            str(v.dtype),
            tuple(v.shape),
            v.contiguous().view(-1).view(torch.uint8).numpy().tobytes(),
        )
        for k, v in tensors.items()
    }


def pull_after_barrier(address: tuple[str, int], ready: Any, out: Any) -> None:
    """Child-process body: start a NIXL agent, wait at ``ready``, pull, put the result on ``out``."""
    from param_server.client import ParamServerClient

    with ParamServerClient(address) as c:
        c._nixl()  # agent up before the barrier, so concurrent pulls really overlap
        ready.wait(timeout=90)
        version, tensors = c.pull()
        out.put((version, tensor_bytes(tensors)))
