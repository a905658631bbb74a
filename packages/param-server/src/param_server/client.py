"""Clients of the parameter server: ``push`` on trainer ranks, ``pull`` on rollout instances.

Both directions are client-initiated one-sided NIXL transfers: a push WRITEs the trainer's
tensors straight into the storage workers' regions (the client registers its tensors, no staging
copy); a pull READs slices from the workers the server's plan picked into one client-side
registered buffer. Workers never spend CPU on a pull.

Checksums: the pushing client computes a CRC-32 per slice while its WRITE is in flight; the
workers recompute it before the version is published (``verify_on_push``); the pulling client
recomputes it after its READ (``verify=True``). A slice whose bytes fail the check is reported
to the server (``pull_repair``), which re-hashes that copy where it lies, drops it if it is
corrupt there, and names another holder to read the slice from; the client reads it again and
checks it again. Only when no good copy is left does the pull raise ``ChecksumMismatch``: it
never returns bytes that differ from what was pushed.

The control connection authenticates with a ``hello`` when it opens. When the server closes
idle connections, the client reconnects before using one that has been quiet for half the
server's idle timeout.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import structlog
import torch

from . import _checksum
from . import errors as _errors
from ._nixl import Pending, Transport, Triple, local_net_devices, tensor_mem
from ._records import DTYPE_SIZES
from ._wire import Channel
from .errors import (
    ChecksumMismatch,
    ParamServerError,
    ProtocolError,
    RemoteError,
    TransferFailed,
    UsageError,
)

log = structlog.get_logger("param_server.client")

_ALIGN = 64
CHUNK_BYTES = 64 << 20
REPAIR_ROUNDS = 3
"""Times one pull asks for other copies of slices whose checksum failed before it gives up."""


@attrs.frozen(kw_only=True)
class PushResult:
    version: int
    #: True once every rank committed and the version is visible to pulls
    complete: bool
    nbytes: int


def _dtype_name(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise UsageError(
            f"dtype {t.dtype} not supported; allowed: {sorted(DTYPE_SIZES)}", field="dtype"
        )
    return name


def _raise_remote(body: dict[str, Any]) -> None:
    kind, message, ctx = body["kind"], body["message"], body["context"]
    cls = getattr(_errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, ParamServerError)):
        raise RemoteError(kind, message)
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    for key, val in ctx.items():
        setattr(
            exc,
            key,
            tuple(tuple(v) if isinstance(v, list) else v for v in val)
            if isinstance(val, list)
            else val,
        )
    raise exc


class ParamServerClient:
    """A connection to a ``ParamServer``; one per process (trainer rank or rollout instance).

    Thread-safe: calls are serialized. ``pull`` returns tensors that are views of a buffer the
    client reuses: they stay valid until the next ``pull`` (``clone()`` them to keep them).
    ``ucx_devices``: network devices this client's NIXL/UCX endpoint may listen on; ``None``
    means loopback when ``address`` is a loopback address (see ``ParamServerConfig``).
    """

    def __init__(
        self,
        address: tuple[str, int],
        *,
        token: str | None = None,
        name: str | None = None,
        device: str | torch.device = "cpu",
        ucx_devices: str | None = None,
    ) -> None:
        self.name = name or f"ps-client-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.device = torch.device(device)
        self._address: tuple[str, int] = (str(address[0]), int(address[1]))
        self._token = token
        self._net_devices = (
            ucx_devices if ucx_devices is not None else local_net_devices(self._address[0])
        )
        self._chan = Channel.connect(self._address, token)
        self._last_io = time.monotonic()
        self._lock = threading.Lock()
        self._transport: Transport | None = None
        self._buf: torch.Tensor | None = None
        self._buf_reg: Any = None
        self._unacked = 0

    # ------------------------------------------------------------------ plumbing
    def _drain_acks(self) -> None:
        """Read the replies to messages sent without waiting (``pull_end``)."""
        while self._unacked:
            self._unacked -= 1
            try:
                rkind, rbody = self._chan.recv()
            except (ConnectionError, OSError) as exc:
                raise _errors.WorkerLost("server", f"control channel broken: {exc}") from exc
            if rkind == "error":
                log.warning("deferred_reply_error", kind=rbody["kind"], message=rbody["message"])

    def _fresh(self) -> None:
        """Reconnect if the server may be about to close this connection for idleness."""
        idle = self._chan.idle_timeout_s
        if idle is not None and time.monotonic() - self._last_io > idle / 2:
            self._drain_acks()
            self._chan.close()
            try:
                self._chan = Channel.connect(self._address, self._token)
            except (ConnectionError, OSError) as exc:
                raise _errors.WorkerLost("server", f"cannot reconnect: {exc}") from exc
            log.debug("reconnected_after_idle", idle_timeout_s=idle)
        self._last_io = time.monotonic()

    def _send_nowait(self, kind: str, body: Mapping[str, Any]) -> None:
        """Send a message whose reply only needs reading later: saves a round trip per pull."""
        self._fresh()
        try:
            self._chan.send(kind, body)
        except (ConnectionError, OSError) as exc:
            raise _errors.WorkerLost("server", f"control channel broken: {exc}") from exc
        self._unacked += 1

    def _call(self, kind: str, body: Mapping[str, Any], expect: str) -> dict[str, Any]:
        self._drain_acks()
        self._fresh()
        try:
            rkind, rbody = self._chan.call(kind, body)
        except (ConnectionError, OSError) as exc:
            raise _errors.WorkerLost("server", f"control channel broken: {exc}") from exc
        self._last_io = time.monotonic()
        if rkind == "error":
            _raise_remote(rbody)
        if rkind != expect:
            raise ProtocolError(
                f"expected {expect!r} reply to {kind!r}, got {rkind!r}", field="kind"
            )
        return rbody

    def _nixl(self) -> Transport:
        if self._transport is None:
            self._transport = Transport(self.name, net_devices=self._net_devices)
        return self._transport

    def status(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._call("status", {}, "status_reply")["status"])

    def close(self) -> None:
        with self._lock:
            try:
                self._drain_acks()
            except ParamServerError:
                log.debug("close_drain_failed")
            if self._buf_reg is not None and self._transport is not None:
                self._transport.deregister(self._buf_reg)
                self._buf_reg = None
            self._buf = None
            self._chan.close()

    def __enter__(self) -> ParamServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ push
    def push(
        self,
        version: int,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        rank: int = 0,
        world_size: int = 1,
    ) -> PushResult:
        """Write this rank's tensors as part of ``version``; see the README for the rules."""
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        tensors: dict[str, torch.Tensor] = {}
        for name, t in items:
            if not isinstance(t, torch.Tensor):
                raise UsageError(f"{name!r} is not a tensor", field="named_tensors")
            t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            tensors[name] = t
        specs = [
            [n, _dtype_name(t), list(t.shape), t.numel() * t.element_size()]
            for n, t in tensors.items()
        ]
        with self._lock:
            ticket = self._call(
                "push_begin",
                {"version": version, "rank": rank, "world_size": world_size, "tensors": specs},
                "push_ticket",
            )
            try:
                checksums = self._write(ticket, tensors)
            except BaseException:
                try:
                    self._call("push_abort", {"version": ticket["version"]}, "ok")
                except ParamServerError:
                    log.warning("push_abort_failed", version=ticket["version"])
                raise
            done = self._call(
                "push_commit", {"push_id": ticket["push_id"], "checksums": checksums}, "push_done"
            )
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        log.info(
            "pushed", version=done["version"], rank=rank, complete=done["complete"], nbytes=nbytes
        )
        return PushResult(version=done["version"], complete=done["complete"], nbytes=nbytes)

    def _write(self, ticket: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[list[Any]]:
        nx = self._nixl()
        for agent, md in ticket["agents"].items():
            nx.ensure_remote(agent, md)
        # Register each underlying storage once: tied weights and views share memory, and
        # registering overlapping ranges twice crashes UCX.
        storages: dict[str, dict[int, Triple]] = {}
        for t in tensors.values():
            if t.numel():
                mem, dev = tensor_mem(t)
                st = t.untyped_storage()
                storages.setdefault(mem, {})[st.data_ptr()] = (st.data_ptr(), st.nbytes(), dev)
        handles = [nx.register(list(by_ptr.values()), mem) for mem, by_ptr in storages.items()]
        try:
            per_agent: dict[tuple[str, str], tuple[list[Triple], list[Triple]]] = {}
            slices: dict[tuple[str, int], tuple[int, int]] = {}
            for name, index, start, end, agent, addr, dev, _ in ticket["writes"]:
                slices[(name, index)] = (start, end)
                if end == start:
                    continue
                t = tensors[name]
                mem, tdev = tensor_mem(t)
                local, remote = per_agent.setdefault((agent, mem), ([], []))
                local.append((t.data_ptr() + start, end - start, tdev))
                remote.append((addr, end - start, dev))
            pending: list[Pending] = [
                nx.post("WRITE", local, mem, remote, agent)
                for (agent, mem), (local, remote) in per_agent.items()
            ]
            # Checksum on the pool while this thread drives the WRITEs.
            views = {n: _host_bytes(t) for n, t in tensors.items()}
            futures = {k: _checksum.submit(views[k[0]], s, e) for k, (s, e) in slices.items()}
            try:
                nx.wait(pending)
            finally:
                sums = [[n, i, f.result()] for (n, i), f in futures.items()]
        finally:
            for h in handles:
                nx.deregister(h)
        return sums

    # ------------------------------------------------------------------ pull
    def pull(
        self,
        names: Iterable[str] | None = None,
        *,
        version: int | None = None,
        verify: bool = True,
        retries: int = 1,
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """Fetch the latest complete version (or ``version``); returns ``(version, tensors)``.

        The result is one whole version or an exception: never a half-received or mixed one.
        A transfer that fails because a worker died is retried ``retries`` times on a fresh plan
        (replicas elsewhere, when ``replication`` > 1).
        """
        name_list = None if names is None else list(names)
        with self._lock:
            attempt = 0
            while True:
                try:
                    return self._pull_once(name_list, version, verify)
                except TransferFailed as exc:
                    if attempt >= retries:
                        raise
                    attempt += 1
                    log.warning("pull_retry", worker=exc.worker, attempt=attempt)

    def _pull_once(
        self, names: list[str] | None, version: int | None, verify: bool
    ) -> tuple[int, dict[str, torch.Tensor]]:
        ticket = self._call(
            "pull_begin", {"receiver": self.name, "names": names, "version": version}, "pull_ticket"
        )
        failed: str | None = None
        try:
            nx = self._nixl()
            for agent, md in ticket["agents"].items():
                nx.ensure_remote(agent, md)
            offsets: dict[str, int] = {}
            total = 0
            for name, _dtype, _shape, nbytes in ticket["tensors"]:
                offsets[name] = total
                total += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
            buf = self._buffer(total)
            mem, dev = tensor_mem(buf)
            base = buf.data_ptr()
            order, holders = _chunk_reads(ticket["reads"], offsets, base, dev)
            # Host buffers hash while later chunks land; device buffers once, after all landed.
            host = _host_bytes(buf) if verify and buf.device.type == "cpu" else None
            checks: list[tuple[list[Any], Any]] = []
            window = max(2, holders)
            inflight: collections.deque[tuple[Pending | None, list[list[Any]]]] = (
                collections.deque()
            )

            def land(p: Pending | None, members: list[list[Any]]) -> None:
                if p is not None:
                    nx.wait([p])
                if host is not None:
                    for r in members:
                        off = offsets[r[0]]
                        checks.append((r, _checksum.submit(host, off + r[2], off + r[3])))

            try:
                for agent, lo, re, members in order:
                    inflight.append((nx.post("READ", lo, mem, re, agent) if lo else None, members))
                    if len(inflight) >= window:
                        land(*inflight.popleft())
                while inflight:
                    land(*inflight.popleft())
                if verify and host is None:
                    host = _host_bytes(buf)
                    for _agent, _lo, _re, members in order:
                        land(None, members)
            except TransferFailed as exc:
                failed = exc.worker
                for p, _members in inflight:
                    if p is not None:
                        nx.release(p)
                raise
            bad = [(r, actual) for r, fut in checks if (actual := fut.result()) != r[7]]
            try:
                self._repair(ticket, bad, buf, offsets)
            except TransferFailed as exc:
                failed = exc.worker
                raise
            out: dict[str, torch.Tensor] = {}
            for name, dtype, shape, nbytes in ticket["tensors"]:
                off = offsets[name]
                out[name] = buf[off : off + nbytes].view(getattr(torch, dtype)).view(tuple(shape))
        finally:
            if failed is None:
                self._send_nowait("pull_end", {"pull_id": ticket["pull_id"], "failed_worker": None})
            else:  # wait: the server must check the worker before this client retries
                self._call(
                    "pull_end", {"pull_id": ticket["pull_id"], "failed_worker": failed}, "ok"
                )
        return ticket["version"], out

    def _repair(
        self,
        ticket: dict[str, Any],
        bad: list[tuple[list[Any], int]],
        buf: torch.Tensor,
        offsets: dict[str, int],
    ) -> None:
        """Read the slices whose checksum failed again, from the holders the server names after
        checking (and dropping) the bad copies, until each verifies; ``ChecksumMismatch`` when
        some slice has no good copy left."""
        nx = self._nixl()
        mem, dev = tensor_mem(buf)
        for _ in range(REPAIR_ROUNDS):
            if not bad:
                return
            log.warning(
                "pull_checksum_mismatch",
                version=ticket["version"],
                slices=[(r[0], r[1], r[4]) for r, _a in bad],
            )
            repair = self._call(
                "pull_repair",
                {"pull_id": ticket["pull_id"], "bad": [[r[0], r[1], r[4]] for r, _a in bad]},
                "pull_repair_ticket",
            )
            reads = {(r[0], r[1]): r for r in repair["reads"]}
            left = [(r, a) for r, a in bad if (r[0], r[1]) not in reads]
            if left:
                bad = left
                break
            for agent, md in repair["agents"].items():
                nx.ensure_remote(agent, md)
            per_agent: dict[str, tuple[list[Triple], list[Triple]]] = {}
            for name, _index, start, end, agent, addr, rdev, _crc in reads.values():
                if end > start:
                    local, remote = per_agent.setdefault(agent, ([], []))
                    local.append((buf.data_ptr() + offsets[name] + start, end - start, dev))
                    remote.append((addr, end - start, rdev))
            posted: list[Pending] = []
            try:
                for agent, (local, remote) in per_agent.items():
                    posted.append(nx.post("READ", local, mem, remote, agent))
            except TransferFailed:
                for p in posted:
                    nx.release(p)
                raise
            nx.wait(posted)
            bad = []
            for r in reads.values():
                off = offsets[r[0]]
                got = _checksum.crc(_host_bytes(buf[off + r[2] : off + r[3]]), 0, r[3] - r[2])
                if got != r[7]:
                    bad.append((r, got))
        if bad:
            r, actual = bad[0]
            raise ChecksumMismatch(
                name=r[0],
                slice_index=r[1],
                version=ticket["version"],
                expected=r[7],
                actual=actual,
                where=f"client {self.name} on pull, no good copy left",
            )

    def _buffer(self, nbytes: int) -> torch.Tensor:
        nbytes = max(nbytes, _ALIGN)
        if self._buf is None or self._buf.numel() < nbytes:
            nx = self._nixl()
            if self._buf_reg is not None:
                nx.deregister(self._buf_reg)
                self._buf_reg = None
            self._buf = None
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._buf_reg = nx.register_tensors([buf])
            self._buf = buf
        return self._buf


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as a host memoryview (GPU tensors are copied to host to hash them;
    a device-side hash is future work)."""
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.reshape(-1).view(torch.uint8)
    return flat.numpy().data


#: one chunk of reads from one holder: (agent, local triples, remote triples, the reads)
Chunk = tuple[str, list[Triple], list[Triple], list[list[Any]]]


def _chunk_reads(
    reads: list[list[Any]], offsets: dict[str, int], base: int, dev: int
) -> tuple[list[Chunk], int]:
    """The ticket's reads as per-holder chunks of about ``CHUNK_BYTES`` (so verification of
    landed chunks overlaps the transfer of the rest), in round-robin order over the holders (on
    RDMA several holders stream at once; on shared memory, where UCX copies inside the post, the
    pool hashes landed chunks while the caller copies the next ones); and how many holders."""
    chunks: list[Chunk] = []
    open_chunk: dict[str, tuple[list[Triple], list[Triple], list[list[Any]], list[int]]] = {}
    for read in reads:
        name, _index, start, end, agent, addr, rdev, _crc = read
        local, remote, members, size = open_chunk.setdefault(agent, ([], [], [], [0]))
        members.append(read)
        if end > start:
            local.append((base + offsets[name] + start, end - start, dev))
            remote.append((addr, end - start, rdev))
            size[0] += end - start
        if size[0] >= CHUNK_BYTES:
            chunks.append((agent, local, remote, members))
            del open_chunk[agent]
    chunks.extend((a, lo, re, me) for a, (lo, re, me, _) in open_chunk.items())
    by_agent: dict[str, list[Chunk]] = {}
    for c in chunks:
        by_agent.setdefault(c[0], []).append(c)
    order = [c for group in itertools.zip_longest(*by_agent.values()) for c in group if c]
    return order, len(by_agent)
