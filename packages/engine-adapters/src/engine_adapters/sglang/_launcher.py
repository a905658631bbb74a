"""Start a real ``sglang.launch_server`` process, or attach to a running server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence

import attrs
import httpx
import structlog

from engine_adapters.errors import EngineUnavailable

log = structlog.get_logger(__name__)


@attrs.frozen(kw_only=True)
class SglangLaunchConfig:
    """How to start ``python -m sglang.launch_server`` (GPU machines with SGLang installed)."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    context_length: int | None = None
    max_running_requests: int | None = None
    mem_fraction_static: float | None = None
    extra_args: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    python: str = sys.executable
    startup_timeout_s: float = 600.0

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            self.python, "-m", "sglang.launch_server",
            "--model-path", self.model_path,
            "--host", self.host,
            "--port", str(self.port),
            "--tp-size", str(self.tp_size),
            "--enable-metrics",  # the snapshot reads /metrics
        ]  # fmt: skip
        if self.context_length is not None:
            cmd += ["--context-length", str(self.context_length)]
        if self.max_running_requests is not None:
            cmd += ["--max-running-requests", str(self.max_running_requests)]
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction_static)]
        return [*cmd, *self.extra_args]


class SglangProcess:
    """A launched SGLang server process (terminated by :meth:`stop`)."""

    def __init__(self, config: SglangLaunchConfig) -> None:
        self.config = config
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> str:
        cmd = self.config.command()
        log.info("sglang_launch", command=" ".join(cmd))
        self.proc = subprocess.Popen(cmd, env=os.environ.copy())
        wait_healthy(self.config.base_url, self.config.startup_timeout_s, proc=self.proc)
        return self.config.base_url

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout_s)


def wait_healthy(
    base_url: str, timeout_s: float, *, proc: subprocess.Popen[bytes] | None = None,
    paths: Sequence[str] = ("/health",),
) -> None:  # fmt: skip
    """Poll ``GET /health`` until 200; raise :class:`EngineUnavailable` on timeout or exit."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise EngineUnavailable(f"sglang server exited with code {proc.returncode}")
        try:
            if all(httpx.get(base_url + p, timeout=5).status_code == 200 for p in paths):
                return
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.2)
    raise EngineUnavailable(f"sglang server at {base_url} not healthy after {timeout_s}s ({last})")
