"""Storage worker process: holds version regions in NIXL-registered DRAM.

Started by ``ParamServer`` as ``python -m param_server._worker <worker-name>`` with the server
address and token in the environment (never on the command line, where ``ps`` shows it). The
worker connects back to the server, says hello with its NIXL agent metadata and then serves
requests one at a time: allocate/free a region, verify checksums of written slices, ping.
Clients read and write region bytes directly over NIXL; the worker never touches a pull.

Each incarnation uses a fresh agent name (``ps-<worker>-<pid>``), so a client can never confuse
a restarted worker's memory with its predecessor's.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import numpy as np
import structlog

from . import _checksum
from ._nixl import Transport
from ._wire import Channel
from .errors import ParamServerError, ProtocolError

ENV_ADDR = "PARAM_SERVER_ADDR"
ENV_TOKEN = "PARAM_SERVER_TOKEN"
ENV_FAULTS = "PARAM_SERVER_FAULT_INJECTION"
ENV_POOL = "PARAM_SERVER_POOL_BYTES"
ENV_NET_DEVICES = "PARAM_SERVER_UCX_DEVICES"  # empty: every device UCX finds
PROGRESS_TICK_S = 0.005

log = structlog.get_logger("param_server.worker")


class _Regions:
    """Region id -> registered buffer. Freed buffers go to a small pool and are reused for later
    versions of similar size: no re-registration, no first-touch page faults, and the agent
    metadata clients cached stays valid."""

    def __init__(self, transport: Transport, pool_bytes: int) -> None:
        self.transport = transport
        self.pool_bytes = pool_bytes
        self.buffers: dict[int, np.ndarray] = {}
        self.regs: dict[int, Any] = {}
        self.pool: list[tuple[np.ndarray, Any]] = []

    def alloc(self, region: int, nbytes: int) -> tuple[int, bool]:
        """Returns (address, whether a new registration happened)."""
        if region in self.buffers:
            raise ProtocolError(f"region {region} already allocated", field="region")
        if nbytes <= 0:
            raise ProtocolError(f"region size must be > 0, got {nbytes}", field="nbytes")
        fits = [i for i, (b, _) in enumerate(self.pool) if nbytes <= b.nbytes <= 2 * nbytes]
        if fits:
            i = min(fits, key=lambda j: self.pool[j][0].nbytes)
            buf, reg = self.pool.pop(i)
            fresh = False
        else:
            buf = np.empty(nbytes, dtype=np.uint8)
            # Fault every page in now: a peer's first WRITE would otherwise take each page
            # fault inside its cross-process copy, several times slower.
            buf[::4096] = 0
            reg = self.transport.register([(int(buf.ctypes.data), nbytes, 0)], "DRAM")
            fresh = True
        self.buffers[region] = buf
        self.regs[region] = reg
        return int(buf.ctypes.data), fresh

    def free(self, region: int) -> None:
        buf = self.buffers.pop(region, None)
        reg = self.regs.pop(region, None)
        if buf is None:
            return
        self.pool.append((buf, reg))
        # Keep the newest buffers up to pool_bytes; deregister the rest.
        while self.pool and sum(b.nbytes for b, _ in self.pool) > self.pool_bytes:
            _old, old_reg = self.pool.pop(0)
            self.transport.deregister(old_reg)

    def get(self, region: int) -> np.ndarray:
        buf = self.buffers.get(region)
        if buf is None:
            raise ProtocolError(f"unknown region {region}", field="region")
        return buf


def _progress_loop(transport: Transport, lock: threading.Lock, stop: threading.Event) -> None:
    """Drive UCX progress for connection set-up by peers (wire-up needs the target to answer);
    the data movement itself is one-sided. Ticks every ``PROGRESS_TICK_S`` instead of NIXL's
    own progress thread, which spins a whole core even when idle."""
    while not stop.wait(PROGRESS_TICK_S):
        with lock:
            transport.agent.get_new_notifs()


def serve(
    worker: str,
    address: tuple[str, int],
    token: str | None,
    faults: bool,
    pool_bytes: int,
    net_devices: str | None = None,
) -> None:
    transport = Transport(f"ps-{worker}-{os.getpid()}", net_devices=net_devices)
    lock = threading.Lock()
    stop = threading.Event()
    threading.Thread(
        target=_progress_loop, args=(transport, lock, stop), name="ps-progress", daemon=True
    ).start()
    try:
        _serve(worker, transport, lock, address, token, faults, pool_bytes)
    finally:
        stop.set()


def _serve(
    worker: str,
    transport: Transport,
    lock: threading.Lock,
    address: tuple[str, int],
    token: str | None,
    faults: bool,
    pool_bytes: int,
) -> None:
    regions = _Regions(transport, pool_bytes)
    chan = Channel.connect(address, token, worker=worker)
    chan.send(
        "worker_hello",
        {
            "worker": worker,
            "agent": transport.name,
            "metadata": transport.metadata(),
            "pid": os.getpid(),
        },
    )
    log.info("worker_ready", worker=worker, agent=transport.name)
    while True:
        try:
            kind, body = chan.recv()
        except (ConnectionError, OSError):
            log.info("worker_channel_closed", worker=worker)
            return
        try:
            if kind == "alloc":
                with lock:
                    addr, _fresh = regions.alloc(body["region"], body["nbytes"])
                    metadata = transport.metadata()
                chan.send(
                    "allocated", {"region": body["region"], "addr": addr, "metadata": metadata}
                )
            elif kind == "free":
                with lock:
                    regions.free(body["region"])
                chan.send("ok", {})
            elif kind == "verify":
                mv = regions.get(body["region"]).data
                checks = body["checks"]
                got = _checksum.many(mv, [(off, off + n) for off, n, _ in checks])
                bad = [[off, a] for (off, _n, crc), a in zip(checks, got, strict=True) if a != crc]
                chan.send("verified", {"bad": bad})
            elif kind == "corrupt" and faults:
                regions.get(body["region"])[body["offset"]] ^= 0xFF
                chan.send("ok", {})
            elif kind == "ping":
                chan.send("ok", {})
            elif kind == "shutdown":
                chan.send("ok", {})
                return
            else:
                raise ProtocolError(f"worker does not serve {kind!r}", field="kind")
        except ProtocolError as exc:
            chan.send("error", {"kind": "ProtocolError", "message": str(exc), "context": {}})
        except MemoryError:
            chan.send(
                "error",
                {
                    "kind": "MemoryError",
                    "message": f"cannot allocate {body.get('nbytes')} bytes",
                    "context": {},
                },
            )


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m param_server._worker <worker-name>", file=sys.stderr)
        return 2
    host, _, port = os.environ[ENV_ADDR].rpartition(":")
    token = os.environ.get(ENV_TOKEN) or None
    faults = os.environ.get(ENV_FAULTS) == "1"
    try:
        pool_bytes = int(os.environ.get(ENV_POOL, "0"))
        devices = os.environ.get(ENV_NET_DEVICES) or None
        serve(argv[1], (host.strip("[]"), int(port)), token, faults, pool_bytes, devices)
    except (OSError, ConnectionError, ParamServerError) as exc:
        log.warning("worker_exit", worker=argv[1], error=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
