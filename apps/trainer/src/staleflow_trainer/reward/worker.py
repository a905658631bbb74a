"""A reward plug-in in a process of its own: a call that hangs is ended by killing the process.

Python cannot stop a thread, so a plug-in that hangs would pin a thread (and whatever it holds)
for as long as it hangs. :class:`RewardWorker` runs the plug-in in one child process
(a fresh Python interpreter), started lazily and reused call after call; a
call that exceeds its timeout kills the child's whole process group, and the next call starts
a fresh child. A runner therefore holds at most one child process and no extra thread, however
many calls hang.

The child imports the plug-in by its dotted path (with the parent's ``sys.path``) and answers
``ready`` or the import error; it scores each call with
:func:`~staleflow_trainer.reward.runner.normalise_result`, so only a plain float and the
result's extra keys come back. Parent and child talk over a private socket pair with
``multiprocessing.connection`` framing (pickle): both ends are this process tree running the
configured plug-in, never a network peer. The child exits when the parent goes away.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import structlog

from staleflow_trainer.errors import RewardError

log = structlog.get_logger(__name__)

#: What the child runs (``-c``): not ``-m``, as the package imports this module itself.
_CHILD = (
    "import sys; from staleflow_trainer.reward.worker import _child_main; "
    "_child_main(int(sys.argv[1]))"
)

#: How long a child may take to import the plug-in and say it is ready.
START_TIMEOUT_S = 60.0


class RewardWorker:
    """The child process that runs the plug-in ``fn`` (a dotted path)."""

    def __init__(self, fn: str, *, start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.fn = fn
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        #: children started and children killed (after a timeout or a death) so far
        self.started = 0
        self.killed = 0

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Start the child unless it runs; RewardError when the plug-in cannot be loaded."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self.kill()
        parent, child = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(child.fileno())],
                pass_fds=(child.fileno(),),
                start_new_session=True,  # its own process group: killed as a whole
            )
        finally:
            child.close()
        conn = Connection(parent.detach())
        self._proc, self._conn = proc, conn
        self.started += 1
        try:
            conn.send(("init", self.fn, list(sys.path)))
            if not conn.poll(self.start_timeout_s):
                self.kill()
                raise RewardError(
                    f"reward plug-in {self.fn!r} did not load within {self.start_timeout_s:g} s",
                    fn=self.fn,
                )
            msg = conn.recv()
        except (EOFError, OSError) as e:
            code = self.kill()
            raise RewardError(
                f"reward worker for {self.fn!r} exited while loading (exit code {code}): {e!r}",
                fn=self.fn,
            ) from None
        if msg[0] != "ready":
            self.kill()
            raise RewardError(str(msg[1]), fn=self.fn)

    def call(self, args: tuple[Any, ...], *, timeout_s: float) -> tuple[float, dict[str, Any]]:
        """``fn(*args)`` normalised to ``(score, extra)``. TimeoutError (the child is killed)
        after ``timeout_s``; RewardError when the plug-in raised, returned a non-score, or the
        child died."""
        self.start()
        assert self._conn is not None
        try:
            self._conn.send(("call", args))
            answered = self._conn.poll(timeout_s)
            msg = self._conn.recv() if answered else None
        except (EOFError, OSError) as e:
            code = self.kill()
            raise RewardError(
                f"reward worker process died (exit code {code}): {e!r}", fn=self.fn
            ) from None
        if msg is None:
            self.kill()
            raise TimeoutError(f"reward call exceeded timeout_s={timeout_s}")
        if msg[0] == "ok":
            return float(msg[1]), dict(msg[2])
        raise RewardError(str(msg[1]), fn=self.fn)

    def kill(self) -> int | None:
        """End the child and its process group now; returns its exit code (None if none)."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            conn.close()
        if proc is None:
            return None
        if proc.poll() is None:
            self.killed += 1
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()

    close = kill


# ---------------------------------------------------------------------------------- the child


def _exit_with_parent(parent: int) -> None:
    """A hanging plug-in never returns to read EOF: leave when the parent is gone."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


def _child_main(fd: int) -> None:
    from staleflow_trainer.reward.plugin import load_reward_fn
    from staleflow_trainer.reward.runner import normalise_result

    conn = Connection(fd)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    _, path, sys_path = conn.recv()
    sys.path[:] = list(sys_path)
    try:
        fn = load_reward_fn(path)
    except RewardError as e:
        conn.send(("load_error", str(e)))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] != "call":
            return
        try:
            score, extra = normalise_result(fn(*msg[1]))
            conn.send(("ok", score, extra))
        except BaseException as e:  # the plug-in's failure is data here, not a crash
            try:
                conn.send(("error", f"{type(e).__name__}: {e}"))
            except (EOFError, OSError):
                return
