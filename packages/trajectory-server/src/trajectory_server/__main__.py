"""Run the trajectory server as its own process.

    python -m trajectory_server [--host 127.0.0.1] [--port 0] [--token-env NAME]
                                [--allow-remote] [--checkpoint PATH] [--restore]

The token is read from the environment variable named by ``--token-env`` (never from the
command line, which other users can see). Once listening, one JSON line
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
from trajectory_server._service import DEFAULT_HOST, TrajectoryService
from trajectory_server.errors import ConfigError


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trajectory_server", description=__doc__)
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--token-env", default=None, help="environment variable holding the token")
    p.add_argument("--allow-remote", action="store_true")
    p.add_argument("--checkpoint", default=None, help="checkpoint path (save on request/exit)")
    p.add_argument("--restore", action="store_true", help="load --checkpoint if it exists")
    p.add_argument("--max-message-bytes", type=int, default=None)
    return p.parse_args(argv)


async def _run(args: argparse.Namespace) -> None:
    token = None
    if args.token_env is not None:
        token = os.environ.get(args.token_env)
        if not token:
            raise ConfigError(f"environment variable {args.token_env} is empty", field="token_env")
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
    asyncio.run(_run(_parse(argv)))


if __name__ == "__main__":
    main()
