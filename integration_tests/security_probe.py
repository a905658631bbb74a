"""What a hostile local peer meets on a running deployment (used by the fault tests): both
services refuse a peer without the token, refuse an oversized frame before authenticating,
survive a flood of silent connections, and nothing listens beyond loopback."""

from __future__ import annotations

import json
import time
from typing import Any


def own_listeners() -> set[tuple[str, int]]:
    import psutil

    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


def probe_security(dep: Any, before: set[tuple[str, int]]) -> dict[str, Any]:
    """What a hostile local peer meets: both services refuse a peer without the token; a
    16 MiB frame sent before authenticating is refused from its 4-byte header (nothing read or
    decoded); 200 silent connections neither lock out a real client nor stay open; and every
    process of the run (Ray, actors, engines, PS storage workers and their NIXL/UCX endpoints)
    listens on loopback only. Listeners this test process had before the deployment started
    (left by earlier tests in the same process, e.g. a torch TCPStore) are not the run's: they
    are reported apart."""
    import asyncio
    import ipaddress
    import socket
    import struct

    import msgpack
    import psutil

    from param_server import ParamServerClient
    from trajectory_server.client import TrajectoryClient

    out: dict[str, Any] = {"ts": tuple(dep._ts_addr), "ps": tuple(dep._ps_addr)}

    async def ts_no_token() -> str:
        try:
            c = await TrajectoryClient.connect(*dep._ts_addr, token=None)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        try:
            await c.ping()
            return "accepted"
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        finally:
            await c.close()

    out["ts_without_token"] = asyncio.run(ts_no_token())
    try:
        with ParamServerClient(tuple(dep._ps_addr), token="wrong", name="intruder") as c:
            c.status()
        out["ps_wrong_token"] = "accepted"
    except Exception as e:
        out["ps_wrong_token"] = f"{type(e).__name__}: {e}"

    def hostile_frame(address: tuple[str, int]) -> str:
        """Announce 16 MiB without a token and send only 1 KiB of it: the answer, if any."""
        with socket.create_connection(address, timeout=5) as s:
            s.sendall(struct.pack(">I", 16 << 20) + b"\x80" * 1024)
            try:
                (n,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
                reply = msgpack.unpackb(s.recv(n, socket.MSG_WAITALL))
            except (TimeoutError, struct.error, ConnectionError) as e:
                return f"no answer ({type(e).__name__}): the server waits for the body"
        return json.dumps(reply.get("body"), default=str)

    out["ts_hostile_frame"] = hostile_frame(tuple(dep._ts_addr))
    out["ps_hostile_frame"] = hostile_frame(tuple(dep._ps_addr))

    async def ts_ping() -> bool:
        c = await TrajectoryClient.connect(*dep._ts_addr, token=dep._ts_token, timeout_s=10)
        try:
            return bool(await c.ping())
        finally:
            await c.close()

    def ps_status() -> bool:
        with ParamServerClient(tuple(dep._ps_addr), token=dep._ps_token, name="probe") as c:
            return bool(c.status()["alive"])

    for key, address, served in (
        ("ts_flood", tuple(dep._ts_addr), lambda: asyncio.run(ts_ping())),
        ("ps_flood", tuple(dep._ps_addr), ps_status),
    ):
        silent = [socket.create_connection(address, timeout=5) for _ in range(200)]
        try:
            time.sleep(0.5)
            try:
                ok: Any = served()
            except Exception as e:
                ok = f"{type(e).__name__}: {e}"
            closed = 0
            for s in silent:
                s.settimeout(0.05)
                try:
                    closed += s.recv(1) == b""
                except TimeoutError:
                    pass
                except ConnectionError:
                    closed += 1
            out[key] = {"served": ok, "closed_by_server": closed}
        finally:
            for s in silent:
                s.close()

    def scan() -> tuple[list[str], list[str], int]:
        found, preexisting = [], []
        procs = [psutil.Process(), *psutil.Process().children(recursive=True)]
        for proc in procs:
            try:
                conns = proc.net_connections(kind="inet")
            except psutil.Error:
                continue
            for conn in conns:
                if conn.status != psutil.CONN_LISTEN:
                    continue
                ip = conn.laddr.ip.removeprefix("::ffff:")
                if ipaddress.ip_address(ip).is_loopback:
                    continue
                where = f"{proc.name()} ({proc.pid}) on {ip}:{conn.laddr.port}"
                own = proc.pid == psutil.Process().pid
                if own and (conn.laddr.ip, conn.laddr.port) in before:
                    preexisting.append(where)
                else:
                    found.append(where)
        return found, preexisting, len(procs)

    listeners, preexisting, nprocs = scan()
    out["listening_processes"] = nprocs
    out["non_loopback_listeners"] = listeners
    out["preexisting_listeners"] = preexisting
    # the scan is live: a listener on all interfaces opened now is reported
    with socket.create_server(("0.0.0.0", 0)) as canary:
        port = canary.getsockname()[1]
        out["canary"] = [w for w in scan()[0] if w.endswith(f" on 0.0.0.0:{port}")]
    return out
