"""The parameter-server service: owns the core, its storage worker processes and the control
endpoint clients talk to.

Threads, not asyncio: each control connection gets a thread (requests on one connection are
served in order), once it has authenticated (:mod:`param_server._listener`); a single lock
guards the core; each worker link has its own lock so region
allocation and checksum verification run on all workers in parallel. A monitor thread pings
workers and notices dead processes, so a worker's death is reported even when nobody is
pushing or pulling.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from ._config import ParamServerConfig
from ._core import ParamServerCore
from ._links import WorkerLink, WorkerRefused, error_body
from ._listener import Listener
from ._plan import LinkFn
from ._records import CoreConfig, RegionAlloc, SliceRead, TensorSpec
from ._wire import Channel
from ._worker import ENV_ADDR, ENV_FAULTS, ENV_NET_DEVICES, ENV_POOL, ENV_TOKEN
from .errors import (
    ChecksumMismatch,
    ConfigError,
    ParamServerError,
    ProtocolError,
    PushFailed,
    WorkerLost,
)

log = structlog.get_logger("param_server.service")


def _stderr_fd() -> int:
    """The file descriptor of this process's stderr (2 if ``sys.stderr`` has none, as under
    some capturing test runners)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return 2


class ParamServer:
    """Versioned weights on storage worker processes; see the package README.

    ``ParamServer(config)`` starts the control endpoint and ``num_workers`` worker processes and
    returns when all of them said hello. ``address`` is what clients connect to.
    """

    def __init__(self, config: ParamServerConfig | None = None, link: LinkFn | None = None) -> None:
        self.config = config or ParamServerConfig()
        cfg = self.config
        self.core = ParamServerCore(
            CoreConfig(
                workers=cfg.worker_names(),
                replication=cfg.replication,
                keep_versions=cfg.keep_versions,
                max_slice_bytes=cfg.max_slice_bytes,
            ),
            link,
        )
        self._lock = threading.RLock()
        self._links: dict[str, WorkerLink] = {}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._joined = threading.Condition(self._lock)
        self._closed = threading.Event()
        self._pool = ThreadPoolExecutor(
            max_workers=max(2, cfg.num_workers), thread_name_prefix="ps-w"
        )
        sock = socket.create_server((cfg.host, cfg.port), backlog=64)
        self.address: tuple[str, int] = sock.getsockname()[:2]
        self._listener = Listener(sock, cfg.token, cfg.connection_limits, self._serve)
        threading.Thread(target=self._monitor_loop, name="ps-monitor", daemon=True).start()
        try:
            for w in cfg.worker_names():
                self._spawn(w)
            self._wait_joined(cfg.worker_names(), cfg.worker_start_timeout_s)
        except BaseException:
            self.close()
            raise
        log.info("param_server_started", address=self.address, workers=cfg.num_workers)

    # ------------------------------------------------------------------ lifecycle
    def _spawn(self, worker: str) -> None:
        env = dict(os.environ)
        env[ENV_ADDR] = f"{self.address[0]}:{self.address[1]}"
        if self.config.token:
            env[ENV_TOKEN] = self.config.token
        else:
            env.pop(ENV_TOKEN, None)
        env[ENV_FAULTS] = "1" if self.config.fault_injection else "0"
        env[ENV_POOL] = str(self.config.worker_pool_bytes)
        env[ENV_NET_DEVICES] = self.config.net_devices() or ""
        # the worker's output (its log lines, the transport's warnings) goes to this process's
        # stderr: its stdout belongs to whoever embeds the server
        self._procs[worker] = subprocess.Popen(
            [sys.executable, "-m", "param_server._worker", worker], env=env, stdout=_stderr_fd()
        )

    def _wait_joined(self, workers: Sequence[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._joined:
            while not all(w in self._links and w in self.core.alive_workers() for w in workers):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [w for w in workers if w not in self._links]
                    raise WorkerLost(",".join(missing), f"did not start within {timeout_s}s")
                self._joined.wait(min(left, 0.5))

    def restart_worker(self, worker: str, timeout_s: float | None = None) -> None:
        """Start a fresh process for ``worker`` (after it died) and wait until it rejoined."""
        if worker not in self.config.worker_names():
            raise ConfigError("worker", worker, f"one of {list(self.config.worker_names())}")
        proc = self._procs.get(worker)
        if proc is not None and proc.poll() is None:
            self.kill_worker(worker)
        with self._lock:
            self._mark_lost(worker, "restarting")
        self._spawn(worker)
        self._wait_joined([worker], timeout_s or self.config.worker_start_timeout_s)

    def kill_worker(self, worker: str) -> None:
        """Kill a worker process (fault tests, operators); its death is handled as a loss."""
        proc = self._procs.get(worker)
        if proc is None:
            raise ConfigError("worker", worker, f"one of {list(self._procs)}")
        proc.kill()
        proc.wait(timeout=30)
        with self._lock:
            self._mark_lost(worker, "killed")

    def worker_pids(self) -> dict[str, int]:
        return {w: p.pid for w, p in self._procs.items() if p.poll() is None}

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._listener.close()
        for w, link in list(self._links.items()):
            try:
                link.call("shutdown", {})
            except ParamServerError:
                log.debug("worker_shutdown_failed", worker=w)
            link.chan.close()
        for proc in self._procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._pool.shutdown(wait=False)

    def __enter__(self) -> ParamServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "latest": self.core.latest,
                "versions": list(self.core.versions()),
                "staged": self.core.staged_version,
                "alive": list(self.core.alive_workers()),
                "dead": list(self.core.dead_workers()),
                "unavailable": [list(u) for u in self.core.unavailable_slices()],
                "dropped_copies": [list(d) for d in self.core.dropped_copies()],
                "active_pulls": len(self.core.active_pulls()),
                "connections": self._listener.counts(),
            }

    def corrupt(
        self,
        version: int,
        name: str,
        slice_index: int = 0,
        offset: int = 0,
        workers: Sequence[str] | None = None,
    ) -> None:
        """Flip a byte of a stored slice on every holder, or on ``workers`` only (tests of
        checksum detection only)."""
        if not self.config.fault_injection:
            raise ConfigError("fault_injection", False, "True to corrupt stored bytes")
        with self._lock:
            s = self.core.slice_map(version)[name][slice_index]
            for loc in s.locations:
                if workers is not None and loc.worker not in workers:
                    continue
                self._links[loc.worker].call(
                    "corrupt", {"region": loc.region, "offset": loc.offset + offset}
                )

    # ------------------------------------------------------------------ workers
    def _mark_lost(self, worker: str, why: str) -> None:
        """Caller holds the lock."""
        link = self._links.pop(worker, None)
        if link is not None:
            link.chan.close()
        if worker in self.core.alive_workers():
            report = self.core.worker_lost(worker)
            log.warning(
                "worker_lost",
                worker=worker,
                why=why,
                aborted_version=report.aborted_version,
                unavailable=len(report.unavailable),
            )
            self._free(report.free_regions)

    def _free(self, regions: Sequence[RegionAlloc]) -> None:
        for r in regions:
            link = self._links.get(r.worker)
            if link is None:
                continue
            link.addrs.pop(r.region, None)
            try:
                link.call("free", {"region": r.region})
            except (WorkerLost, WorkerRefused):
                log.warning("free_failed", worker=r.worker, region=r.region)

    def _monitor_loop(self) -> None:
        while not self._closed.wait(self.config.monitor_interval_s):
            for w in self.config.worker_names():
                proc = self._procs.get(w)
                link = self._links.get(w)
                dead = proc is not None and proc.poll() is not None and link is not None
                if not dead and link is not None and not link.lock.locked():
                    try:
                        link.call("ping", {})
                    except WorkerLost:
                        dead = True
                if dead:
                    with self._lock:
                        if self._links.get(w) is link:
                            self._mark_lost(w, "process exited or channel broken")

    def _worker_joined(self, chan: Channel, body: dict[str, Any]) -> bool:
        """Adopt a worker's channel as its link; False (channel to close) for unknown names."""
        w = body["worker"]
        if w not in self.config.worker_names():
            with contextlib.suppress(OSError):
                chan.send(
                    "error",
                    {"kind": "ConfigError", "message": f"unknown worker {w!r}", "context": {}},
                )
            return False
        with self._joined:
            if w in self._links:
                self._mark_lost(w, "replaced by a new incarnation")
            self._links[w] = WorkerLink(w, chan, body["agent"], body["metadata"], body["pid"])
            self._free(self.core.worker_joined(w))
            self._joined.notify_all()
        log.info("worker_joined", worker=w, agent=body["agent"], pid=body["pid"])
        return True

    # ------------------------------------------------------------------ control endpoint
    def _serve(self, chan: Channel) -> bool:
        """Serve one authenticated connection in order; True if it became a worker's link."""
        handlers: dict[str, Callable[[dict[str, Any]], tuple[str, dict[str, Any]]]] = {
            "push_begin": self._push_begin,
            "push_commit": self._push_commit,
            "push_abort": self._push_abort,
            "pull_begin": self._pull_begin,
            "pull_repair": self._pull_repair,
            "pull_end": self._pull_end,
            "status": lambda _b: ("status_reply", {"status": self.status()}),
            "ping": lambda _b: ("ok", {}),
        }
        while not self._closed.is_set():
            try:
                kind, body = chan.recv()
            except ProtocolError as exc:
                log.warning("bad_message", error=str(exc), field=exc.field)
                with contextlib.suppress(OSError):
                    chan.send(
                        "error",
                        {
                            "kind": "ProtocolError",
                            "message": str(exc),
                            "context": {"field": exc.field},
                        },
                    )
                return False
            except TimeoutError:
                log.info(
                    "idle_connection_closed", timeout_s=self.config.connection_limits.idle_timeout_s
                )
                return False
            except (ConnectionError, OSError):
                return False
            if kind == "worker_hello":
                chan.sock.settimeout(None)  # the server's own link: never idle-closed
                return self._worker_joined(chan, body)
            handler = handlers.get(kind)
            try:
                if handler is None:
                    raise ProtocolError(f"server does not serve {kind!r}", field="kind")
                rkind, rbody = handler(body)
            except ParamServerError as exc:
                rkind, rbody = "error", error_body(exc)
            try:
                chan.send(rkind, rbody)
            except (ConnectionError, OSError):
                return False
        return False

    # ------------------------------------------------------------------ push
    def _push_begin(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        specs = [
            TensorSpec(name=n, dtype=d, shape=tuple(s), nbytes=b) for n, d, s, b in body["tensors"]
        ]
        with self._lock:
            ticket = self.core.begin_push(
                version=body["version"],
                rank=body["rank"],
                world_size=body["world_size"],
                tensors=specs,
            )
            links = {r.worker: self._links[r.worker] for r in ticket.regions}

        def alloc(r: RegionAlloc) -> tuple[RegionAlloc, dict[str, Any]]:
            return r, links[r.worker].call("alloc", {"region": r.region, "nbytes": r.nbytes})

        futures = [self._pool.submit(alloc, r) for r in ticket.regions]
        results, failure = [], None
        for f in futures:
            try:
                results.append(f.result())
            except (WorkerLost, WorkerRefused) as exc:
                failure = failure or exc
        if failure is not None:
            with self._lock:
                if isinstance(failure, WorkerLost):
                    self._mark_lost(failure.worker, "allocation failed")
                if self.core.staged_version == ticket.version:
                    # Give back what the other workers allocated; the push is retried whole.
                    for r, _res in results:
                        self._links[r.worker].addrs.pop(r.region, None)
                    self._free(self.core.abort_push(ticket.version))
            raise PushFailed(
                str(failure), version=ticket.version, rank=ticket.rank, workers=[failure.worker]
            ) from failure
        with self._lock:
            for r, res in results:
                link = links[r.worker]
                link.addrs[r.region] = res["addr"]
                link.metadata = res["metadata"]
        writes = []
        for s in ticket.slices:
            for loc in s.locations:
                link = links[loc.worker]
                writes.append(
                    [
                        s.name,
                        s.index,
                        s.byte_start,
                        s.byte_end,
                        link.agent,
                        link.addrs[loc.region] + loc.offset,
                        0,
                        None,
                    ]
                )
        agents = {links[w].agent: links[w].metadata for w in links}
        log.info("push_begin", version=ticket.version, rank=ticket.rank, slices=len(ticket.slices))
        return "push_ticket", {
            "push_id": ticket.push_id,
            "version": ticket.version,
            "writes": writes,
            "agents": agents,
        }

    def _push_commit(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        checksums = {(n, i): c for n, i, c in body["checksums"]}
        with self._lock:
            ticket = self.core.push_ticket(body["push_id"])
            links = {r.worker: self._links.get(r.worker) for r in ticket.regions}
        lost = [w for w, link in links.items() if link is None]
        if lost:
            raise PushFailed(
                "storage worker died during the push",
                version=ticket.version,
                rank=ticket.rank,
                workers=lost,
            )
        if self.config.verify_on_push:
            checks: dict[tuple[str, int], list[list[int]]] = {}
            owner: dict[tuple[int, int], tuple[str, int]] = {}
            for s in ticket.slices:
                crc = checksums.get((s.name, s.index))
                if crc is None:
                    continue  # the core rejects incomplete checksum sets below
                for loc in s.locations:
                    if s.nbytes:
                        checks.setdefault((loc.worker, loc.region), []).append(
                            [loc.offset, s.nbytes, crc]
                        )
                        owner[(loc.region, loc.offset)] = (s.name, s.index)

            def verify(key: tuple[str, int]) -> tuple[str, int, list[list[int]]]:
                w, region = key
                link = links[w]
                assert link is not None
                return (
                    w,
                    region,
                    link.call("verify", {"region": region, "checks": checks[key]})["bad"],
                )

            try:
                results = list(self._pool.map(verify, list(checks)))
            except (WorkerLost, WorkerRefused) as exc:
                with self._lock:
                    if isinstance(exc, WorkerLost):
                        self._mark_lost(exc.worker, "verification failed")
                    elif self.core.staged_version == ticket.version:
                        self._free(self.core.abort_push(ticket.version))
                raise PushFailed(
                    str(exc), version=ticket.version, rank=ticket.rank, workers=[exc.worker]
                ) from exc
            for w, region, bad in results:
                if bad:
                    off, actual = bad[0]
                    name, index = owner[(region, off)]
                    with self._lock:
                        self._free(self.core.abort_push(ticket.version))
                    raise ChecksumMismatch(
                        name=name,
                        slice_index=index,
                        version=ticket.version,
                        expected=checksums[(name, index)],
                        actual=actual,
                        where=f"worker {w} on push",
                    )
        with self._lock:
            res = self.core.commit_push(body["push_id"], checksums)
            self._free(res.free_regions)
        if res.complete:
            log.info("version_published", version=res.version)
        return "push_done", {"version": res.version, "complete": res.complete}

    def _push_abort(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        with self._lock:
            self._free(self.core.abort_push(body["version"]))
        return "ok", {}

    # ------------------------------------------------------------------ pull
    def _xfers(self, reads: Sequence[SliceRead]) -> tuple[list[list[Any]], dict[str, bytes]]:
        """Planned reads as wire descriptors, and the agents they read from. Lock held."""
        xfers = []
        agents: dict[str, bytes] = {}
        for r in reads:
            link = self._links[r.worker]
            agents[link.agent] = link.metadata
            addr = link.addrs[r.region] + r.offset
            xfers.append(
                [r.name, r.index, r.byte_start, r.byte_end, link.agent, addr, 0, r.checksum]
            )
        return xfers, agents

    def _pull_begin(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        with self._lock:
            t = self.core.begin_pull(
                receiver=body["receiver"], names=body["names"], version=body["version"]
            )
            try:
                reads, agents = self._xfers(t.reads)
            except KeyError:
                self.core.end_pull(t.pull_id)
                raise
        tensors = [[s.name, s.dtype, list(s.shape), s.nbytes] for s in t.tensors]
        return "pull_ticket", {
            "pull_id": t.pull_id,
            "version": t.version,
            "tensors": tensors,
            "reads": reads,
            "agents": agents,
        }

    def _pull_repair(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """A pull's bytes of some slices failed their checksum: check each copy on its worker,
        drop the ones bad at rest, and say where to read those slices again."""
        pull_id = body["pull_id"]
        with self._lock:
            version = self.core.pull_version(pull_id)
            by_agent = {link.agent: w for w, link in self._links.items()}
        avoid: dict[tuple[str, int], str] = {}
        for name, index, agent in body["bad"]:
            w = by_agent.get(agent)
            if w is None:
                continue  # that worker is gone; its copies are no longer live
            avoid[(name, index)] = w
            self._check_copy(version, name, index, w)
        with self._lock:
            reads = self.core.reread(pull_id, [(n, i) for n, i, _ in body["bad"]], avoid)
            xfers, agents = self._xfers(reads)
        return "pull_repair_ticket", {"reads": xfers, "agents": agents}

    def _check_copy(self, version: int, name: str, index: int, worker: str) -> None:
        """Re-hash ``worker``'s copy of one slice where it lies; drop it if it is corrupt."""
        with self._lock:
            s = self.core.live_copy(version, name, index, worker)
            link = self._links.get(worker)
        if s is None or link is None or s.checksum is None:
            return
        loc = s.locations[0]
        try:
            bad = link.call(
                "verify", {"region": loc.region, "checks": [[loc.offset, s.nbytes, s.checksum]]}
            )["bad"]
        except WorkerLost:
            with self._lock:
                self._mark_lost(worker, "verification of a copy failed")
            return
        except WorkerRefused:
            bad = [[loc.offset, 0]]  # a worker that cannot vouch for the copy: do not trust it
        if bad:
            with self._lock:
                self.core.drop_copy(version, name, index, worker)
            log.warning(
                "corrupt_copy_dropped",
                version=version,
                name=name,
                slice_index=index,
                worker=worker,
                expected=s.checksum,
                actual=bad[0][1],
            )
        else:
            log.warning(
                "pull_checksum_mismatch_not_at_rest",
                version=version,
                name=name,
                slice_index=index,
                worker=worker,
            )

    def _pull_end(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        failed = body["failed_worker"]
        with self._lock:
            self._free(self.core.end_pull(body["pull_id"]))
        if failed is not None:
            # The client saw a transfer error from this worker's agent: check it now.
            w = next((n for n, link in self._links.items() if link.agent == failed), None)
            if w is not None:
                try:
                    self._links[w].call("ping", {})
                except (WorkerLost, WorkerRefused, KeyError):
                    with self._lock:
                        self._mark_lost(w, "client transfer failed and ping failed")
        return "ok", {}


def new_token() -> str:
    """A random shared token for non-loopback deployments."""
    return secrets.token_urlsafe(32)
