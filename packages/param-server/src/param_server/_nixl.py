"""Thin transport over NIXL agents (UCX backend).

The same code path serves DRAM here and VRAM on GPU machines: the memory type of a local buffer
is chosen from the tensor's device (``cpu`` -> ``DRAM``, ``cuda:i`` -> ``VRAM`` with device id
``i``). Storage workers always hold DRAM.

Where UCX listens: by default UCX opens a TCP endpoint on every network device it finds (here
eth0 and lo), even for a run whose peers are all on this machine. ``Transport(net_devices="lo")``
keeps a local run on loopback: UCX reads ``UCX_NET_DEVICES`` when NIXL creates its UCX backend,
so the variable is set for that moment only (NIXL 1.5's ``ucx_devices`` backend parameter does
not restrict the TCP listener). :func:`local_net_devices` picks ``"lo"`` for a loopback control
address. Shared-memory transports are not network devices and are unaffected.

Metadata crosses processes through the service's own msgpack messages: agent metadata bytes
(``get_agent_metadata``) and ``(addr, nbytes, dev)`` triples. NIXL's
``get_serialized_descs``/``deserialize_descs`` pickle, so they are never used here; descriptor
lists are rebuilt on the receiving side from the triples.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog

from .errors import TransferFailed

if TYPE_CHECKING:
    import torch

log = structlog.get_logger("param_server.nixl")

Triple = tuple[int, int, int]  # addr, nbytes, device id
LOOPBACK_DEVICE = "lo"
_ENV_LOCK = threading.Lock()  # UCX_NET_DEVICES is process-wide while a backend is created


def local_net_devices(host: str) -> str | None:
    """``"lo"`` when the control endpoint is on loopback (every peer is on this machine), else
    None (UCX uses every device). An explicit ``UCX_NET_DEVICES`` wins: None then too."""
    from ._wire import is_loopback

    if os.environ.get("UCX_NET_DEVICES"):
        return None
    return LOOPBACK_DEVICE if is_loopback(host) else None


def load_nixl() -> tuple[Any, Any]:
    """``(nixl_agent, nixl_agent_config)`` from whichever NIXL wheel is installed."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        try:
            from nixl_cu12._api import (  # type: ignore[import-not-found,unused-ignore]
                nixl_agent,
                nixl_agent_config,
            )
        except ImportError as exc:
            raise ImportError(
                "param-server needs NIXL for transfers: install the 'nixl' extra "
                "(pip install 'param-server[nixl]')"
            ) from exc
    return nixl_agent, nixl_agent_config


def tensor_mem(tensor: torch.Tensor) -> tuple[str, int]:
    """(NIXL memory type, device id) of a tensor's storage."""
    if tensor.device.type == "cpu":
        return "DRAM", 0
    if tensor.device.type == "cuda":
        return "VRAM", int(tensor.device.index or 0)
    raise TransferFailed(f"tensors on {tensor.device} cannot be transferred; use cpu or cuda")


class Pending:
    """A posted transfer; ``Transport.wait`` completes it."""

    __slots__ = ("handle", "nbytes", "op", "remote")

    def __init__(self, handle: Any, remote: str, op: str, nbytes: int) -> None:
        self.handle = handle
        self.remote = remote
        self.op = op
        self.nbytes = nbytes


class Transport:
    """One NIXL agent plus the remote agents it has loaded."""

    def __init__(
        self, name: str, *, progress_thread: bool = False, net_devices: str | None = None
    ) -> None:
        agent_cls, config_cls = load_nixl()
        self.name = name
        # NIXL's progress thread busy-polls a whole core even when idle (its delay is fixed at
        # 0 by the Python API). Transfers here are one-sided and initiator-driven, and
        # ``wait`` progresses them, so the default is no progress thread.
        self.agent = agent_cls(name, config_cls(enable_prog_thread=progress_thread, backends=[]))
        with _ENV_LOCK:
            if net_devices is None or os.environ.get("UCX_NET_DEVICES"):
                self.agent.create_backend("UCX")
            else:
                os.environ["UCX_NET_DEVICES"] = net_devices
                try:
                    self.agent.create_backend("UCX")
                finally:
                    del os.environ["UCX_NET_DEVICES"]
        self.net_devices = net_devices
        self._remote_md: dict[str, bytes] = {}

    # ------------------------------------------------------------------ metadata
    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def ensure_remote(self, name: str, metadata: bytes) -> None:
        """Load (or reload, after the peer registered more memory) a remote agent's metadata."""
        digest = hashlib.blake2b(metadata, digest_size=16).digest()
        if self._remote_md.get(name) == digest:
            return
        loaded = self.agent.add_remote_agent(metadata)
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            raise TransferFailed(
                f"metadata announced for agent {name!r} belongs to {loaded!r}", worker=name
            )
        self._remote_md[name] = digest

    def forget_remote(self, name: str) -> None:
        if self._remote_md.pop(name, None) is not None:
            try:
                self.agent.remove_remote_agent(name)
            except Exception:  # already disconnected peers may refuse
                log.debug("remove_remote_agent_failed", remote=name)

    # ------------------------------------------------------------------ memory
    def register(self, triples: Sequence[Triple], mem_type: str) -> Any:
        return self.agent.register_memory([(a, n, d, "") for a, n, d in triples], mem_type)

    def register_tensors(self, tensors: Sequence[torch.Tensor]) -> Any:
        return self.agent.register_memory(list(tensors))

    def deregister(self, reg: Any) -> None:
        self.agent.deregister_memory(reg)

    # ------------------------------------------------------------------ transfers
    def post(
        self,
        op: str,
        local: Sequence[Triple],
        local_mem: str,
        remote: Sequence[Triple],
        remote_agent: str,
    ) -> Pending:
        """Post one READ (remote -> local) or WRITE (local -> remote) of paired descriptors."""
        import numpy as np

        if len(local) != len(remote):
            raise TransferFailed("local and remote descriptor counts differ", op=op)
        ldesc = self.agent.get_xfer_descs(
            np.asarray(local, dtype=np.uint64).reshape(-1, 3), local_mem
        )
        rdesc = self.agent.get_xfer_descs(
            np.asarray(remote, dtype=np.uint64).reshape(-1, 3), "DRAM"
        )
        nbytes = sum(n for _, n, _ in local)
        try:
            handle = self.agent.initialize_xfer(op, ldesc, rdesc, remote_agent)
            state = self.agent.transfer(handle)
        except Exception as exc:
            raise TransferFailed(
                f"NIXL {op} to {remote_agent!r} could not start: {exc}", worker=remote_agent, op=op
            ) from exc
        if state == "ERR":
            self._release(handle)
            raise TransferFailed(
                f"NIXL {op} to {remote_agent!r} failed to post", worker=remote_agent, op=op
            )
        return Pending(handle, remote_agent, op, nbytes)

    def wait(self, pending: Sequence[Pending], timeout_s: float = 120.0) -> None:
        """Wait for every transfer; on the first error release the rest and raise."""
        deadline = time.monotonic() + timeout_s
        todo = list(pending)
        spins = 0
        try:
            while todo:
                still = []
                for p in todo:
                    state = self.agent.check_xfer_state(p.handle)
                    if state == "DONE":
                        self._release(p.handle)
                    elif state == "PROC":
                        still.append(p)
                    else:
                        raise TransferFailed(
                            f"NIXL {p.op} with {p.remote!r} failed", worker=p.remote, op=p.op
                        )
                todo = still
                if todo:
                    if time.monotonic() > deadline:
                        raise TransferFailed(
                            f"NIXL {todo[0].op} with {todo[0].remote!r} timed out after {timeout_s}s",
                            worker=todo[0].remote,
                            op=todo[0].op,
                        )
                    spins += 1
                    # Short busy phase for small transfers, then yield the (scarce) CPU.
                    time.sleep(0 if spins < 50 else 0.0002)
        except BaseException:
            for p in todo:
                self._release(p.handle)
            raise

    def release(self, pending: Pending) -> None:
        """Abandon a posted transfer (after another one failed)."""
        self._release(pending.handle)

    def _release(self, handle: Any) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:
            log.debug("release_xfer_handle_failed")
