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
import zlib
from typing import Any

import numpy as np
import structlog

from ._nixl import Transport
from ._wire import Channel
from .errors import ProtocolError

ENV_ADDR = "PARAM_SERVER_ADDR"
ENV_TOKEN = "PARAM_SERVER_TOKEN"
ENV_FAULTS = "PARAM_SERVER_FAULT_INJECTION"

log = structlog.get_logger("param_server.worker")


class _Regions:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.buffers: dict[int, np.ndarray] = {}
        self.regs: dict[int, Any] = {}

    def alloc(self, region: int, nbytes: int) -> int:
        if region in self.buffers:
            raise ProtocolError(f"region {region} already allocated", field="region")
        if nbytes <= 0:
            raise ProtocolError(f"region size must be > 0, got {nbytes}", field="nbytes")
        buf = np.empty(nbytes, dtype=np.uint8)
        addr = int(buf.ctypes.data)
        self.regs[region] = self.transport.register([(addr, nbytes, 0)], "DRAM")
        self.buffers[region] = buf
        return addr

    def free(self, region: int) -> None:
        reg = self.regs.pop(region, None)
        if reg is not None:
            self.transport.deregister(reg)
        self.buffers.pop(region, None)

    def get(self, region: int) -> np.ndarray:
        buf = self.buffers.get(region)
        if buf is None:
            raise ProtocolError(f"unknown region {region}", field="region")
        return buf


def serve(worker: str, address: tuple[str, int], token: str | None, faults: bool) -> None:
    transport = Transport(f"ps-{worker}-{os.getpid()}")
    regions = _Regions(transport)
    chan = Channel.connect(address, token)
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
                addr = regions.alloc(body["region"], body["nbytes"])
                chan.send(
                    "allocated",
                    {"region": body["region"], "addr": addr, "metadata": transport.metadata()},
                )
            elif kind == "free":
                regions.free(body["region"])
                chan.send("ok", {})
            elif kind == "verify":
                mv = memoryview(regions.get(body["region"]))
                bad = []
                for off, length, crc in body["checks"]:
                    actual = zlib.crc32(mv[off : off + length])
                    if actual != crc:
                        bad.append([off, actual])
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


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m param_server._worker <worker-name>", file=sys.stderr)
        return 2
    host, _, port = os.environ[ENV_ADDR].rpartition(":")
    token = os.environ.get(ENV_TOKEN) or None
    faults = os.environ.get(ENV_FAULTS) == "1"
    try:
        serve(argv[1], (host.strip("[]"), int(port)), token, faults)
    except (OSError, ConnectionError) as exc:
        log.warning("worker_exit", worker=argv[1], error=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
