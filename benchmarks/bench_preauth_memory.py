"""What one unauthenticated frame costs each server: peak memory of the server process.

Each server runs in a child process with a token (the trajectory server as
``python -m trajectory_server``, the parameter server with one storage worker). A peer that has
no token connects and sends one frame of ``--frame-mib`` MiB: a msgpack array of empty maps,
the most memory per byte msgpack can ask for (each 1-byte ``0x80`` decodes to a Python dict).
The script reads the server's answer (or its closing the connection) and the server process's
peak resident memory (``VmHWM``) before and after.

Printed side by side for both servers: peak RSS before, after, the growth, and the growth per
byte sent (the amplification). A server that authenticates before it reads a large frame
answers from the 4-byte header alone and grows by nothing measurable. Writes
``bench-results/preauth_memory.json``. ``--smoke`` sends 1 MiB (the test suite runs that).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TOKEN_ENV = "BENCH_PREAUTH_TOKEN"

_PS_CHILD = """
import json, os, sys
import structlog
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
from param_server import ParamServer, ParamServerConfig
with ParamServer(ParamServerConfig(num_workers=1, token=os.environ[sys.argv[1]])) as ps:
    print("ADDRESS", json.dumps(list(ps.address)), flush=True)
    sys.stdin.read()
"""


def _peak_rss(pid: int) -> int:
    """Peak resident bytes of ``pid`` so far (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def hostile_frame(nbytes: int) -> bytes:
    """Length prefix + a msgpack array32 of ``nbytes - 5`` empty maps (``nbytes`` in all)."""
    count = nbytes - 5
    return struct.pack(">I", nbytes) + b"\xdd" + struct.pack(">I", count) + b"\x80" * count


def _send_hostile(address: tuple[str, int], frame: bytes, timeout_s: float) -> tuple[str, float]:
    """Send ``frame`` without authenticating; the server's answer and when it came."""
    t0 = time.monotonic()
    with socket.create_connection(address, timeout=timeout_s) as s:
        # answered and closed before the body was sent: expected once authenticated
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(frame)
        try:
            head = s.recv(4, socket.MSG_WAITALL)
            if len(head) < 4:
                return "closed without an answer", time.monotonic() - t0
            (n,) = struct.unpack(">I", head)
            answer = s.recv(n, socket.MSG_WAITALL)
        except TimeoutError:
            return f"no answer within {timeout_s} s", time.monotonic() - t0
        except ConnectionResetError:
            return "connection reset", time.monotonic() - t0
    import msgpack

    body = msgpack.unpackb(answer, raw=False).get("body")
    return json.dumps(body, default=str)[:200], time.monotonic() - t0


def _start_ts(env: dict[str, str]) -> tuple[subprocess.Popen[str], tuple[str, int]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "trajectory_server", "--token-env", TOKEN_ENV],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    addr = json.loads(proc.stdout.readline())
    return proc, (addr["host"], addr["port"])


def _start_ps(env: dict[str, str]) -> tuple[subprocess.Popen[str], tuple[str, int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _PS_CHILD, TOKEN_ENV],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = ""
    # its storage worker shares this stdout and logs to it: the address may follow a worker's
    # unterminated output on the same line
    while "ADDRESS " not in line:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the parameter server process exited")
    host, port = json.loads(line[line.index("ADDRESS ") + len("ADDRESS ") :])
    return proc, (host, port)


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.stdin is not None:
        proc.stdin.close()
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def measure(frame_bytes: int, timeout_s: float = 120.0) -> dict[str, Any]:
    env = dict(os.environ, **{TOKEN_ENV: secrets.token_hex(16)})
    frame = hostile_frame(frame_bytes)
    out: dict[str, Any] = {"frame_bytes": frame_bytes}
    for name, start in (("trajectory_server", _start_ts), ("param_server", _start_ps)):
        proc, address = start(env)
        try:
            time.sleep(0.5)
            before = _peak_rss(proc.pid)
            answer, seconds = _send_hostile(address, frame, timeout_s)
            time.sleep(0.5)
            after = _peak_rss(proc.pid)
        finally:
            _stop(proc)
        out[name] = {
            "peak_rss_before_mb": before / 1e6,
            "peak_rss_after_mb": after / 1e6,
            "growth_mb": (after - before) / 1e6,
            "growth_per_byte_sent": (after - before) / frame_bytes,
            "answer": answer,
            "answer_s": seconds,
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--frame-mib", type=float, default=16.0)
    p.add_argument("--smoke", action="store_true", help="a 1 MiB frame")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "preauth_memory.json")
    args = p.parse_args(argv)
    mib = 1.0 if args.smoke else args.frame_mib
    result = measure(int(mib * (1 << 20)))
    print(f"one unauthenticated frame of {mib:g} MiB (empty msgpack maps), server peak RSS:")
    print(f"{'server':<18} {'before MB':>10} {'after MB':>10} {'growth MB':>10} {'x bytes':>8}")
    for name in ("trajectory_server", "param_server"):
        r = result[name]
        print(
            f"{name:<18} {r['peak_rss_before_mb']:>10.1f} {r['peak_rss_after_mb']:>10.1f} "
            f"{r['growth_mb']:>10.1f} {r['growth_per_byte_sent']:>8.1f}"
        )
        print(f"{'':<18} answer after {r['answer_s']:.2f} s: {r['answer']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
