"""Run the trajectory server as its own process.

    python -m trajectory_server --token-env NAME [--host 127.0.0.1] [--port 0]
                                [--allow-remote] [--checkpoint PATH] [--restore]
                                [--max-connections N] [--idle-timeout-s S]

The token is read from the environment variable named by ``--token-env`` (never from the
command line, which other users can see). Without a token any local user could read and change
the store, so the server refuses to start unless ``--insecure-no-token`` says that is intended
(a single-user machine). Once listening, one JSON line
``{"host": ..., "port": ...}`` is printed to stdout so a parent process can connect.
SIGTERM/SIGINT stop the server; with ``--checkpoint`` it checkpoints before exiting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

import structlog

from trajectory_server._core import TrajectoryStore
from trajectory_server._handshake import ConnectionLimits
from trajectory_server._service import DEFAULT_HOST, TrajectoryService
from trajectory_server.errors import ConfigError

_DEFAULTS = ConnectionLimits()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m trajectory_server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--token-env", default=None, help="environment variable holding the token")
    p.add_argument(
        "--insecure-no-token",
        action="store_true",
        help="serve without a token: every local user can read and change the store",
    )
    p.add_argument("--allow-remote", action="store_true")
    p.add_argument("--checkpoint", default=None, help="checkpoint path (save on request/exit)")
    p.add_argument("--restore", action="store_true", help="load --checkpoint if it exists")
    p.add_argument("--max-message-bytes", type=int, default=None)
    p.add_argument(
        "--max-connections",
        type=int,
        default=_DEFAULTS.max_connections,
        help="authenticated connections served at once (default %(default)s)",
    )
    p.add_argument(
        "--max-unauthenticated",
        type=int,
        default=_DEFAULTS.max_unauthenticated,
        help="connections waiting for their hello; more close the oldest (default %(default)s)",
    )
    p.add_argument(
        "--handshake-timeout-s",
        type=float,
        default=_DEFAULTS.handshake_timeout_s,
        help="seconds a new connection has to authenticate (default %(default)s)",
    )
    p.add_argument(
        "--idle-timeout-s",
        type=float,
        default=_DEFAULTS.idle_timeout_s,
        help="close an authenticated connection silent this long; 0 never (default %(default)s)",
    )
    return p.parse_args(argv)


async def _run(args: argparse.Namespace) -> None:
    token = None
    if args.token_env is not None:
        token = os.environ.get(args.token_env)
        if not token:
            raise ConfigError(f"environment variable {args.token_env} is empty", field="token_env")
    elif not args.insecure_no_token:
        raise ConfigError(
            "refusing to serve without a token: put one in an environment variable and pass "
            "--token-env NAME, or pass --insecure-no-token on a single-user machine",
            field="token_env",
        )
    limits = ConnectionLimits(
        max_connections=args.max_connections,
        max_unauthenticated=args.max_unauthenticated,
        handshake_timeout_s=args.handshake_timeout_s,
        idle_timeout_s=args.idle_timeout_s or None,
    )
    store = TrajectoryStore()
    if args.restore and args.checkpoint and os.path.exists(args.checkpoint):
        store = TrajectoryStore.load_checkpoint(args.checkpoint)
    kwargs = {} if args.max_message_bytes is None else {"max_message_bytes": args.max_message_bytes}
    service = TrajectoryService(
        store,
        host=args.host,
        port=args.port,
        token=token,
        allow_remote=args.allow_remote,
        checkpoint_path=args.checkpoint,
        limits=limits,
        **kwargs,
    )
    host, port = await service.start()
    sys.stdout.write(json.dumps({"host": host, "port": port}) + "\n")
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await service.stop()
    if args.checkpoint:
        service.dispatcher.save_checkpoint()


def main(argv: list[str] | None = None) -> None:
    # stdout carries the address line; logs go to stderr
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    args = _parse(argv)
    try:
        asyncio.run(_run(args))
    except ConfigError as exc:
        sys.stderr.write(f"python -m trajectory_server: error: {exc.message}\n")
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
