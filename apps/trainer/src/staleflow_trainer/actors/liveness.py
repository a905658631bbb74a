"""Whether a peer is still there, and when to try it again: Ray's "this actor is gone" errors,
a call that does not return in time, a process check on this node, this process's children, the
backoff between failed syncs, and a wait on an event with a timeout."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def is_actor_death(e: BaseException) -> bool:
    """True for Ray's "this actor is gone" errors (killed, crashed, its node died)."""
    try:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    except ImportError:  # pragma: no cover - the shell only runs under Ray
        return False
    return isinstance(e, (RayActorError, ActorDiedError, ActorUnavailableError))


def process_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this node."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists: another user's
        return True
    return True


class CallHung(Exception):
    """A call to a peer did not return within the limit that the setting ``setting`` sets."""

    def __init__(self, what: str, setting: str, limit_s: float) -> None:
        self.why = f"did not return within {setting}={limit_s:g}"
        super().__init__(f"{what} {self.why}")


async def answer_within(call: Awaitable[T], limit_s: float, what: str, setting: str) -> T:
    """``call``'s answer; :class:`CallHung` if it has none after ``limit_s`` (``what`` and
    ``setting`` name the call and the setting of the limit in the error)."""
    limit = asyncio.timeout(limit_s)
    try:
        async with limit:
            return await call
    except TimeoutError:
        if limit.expired():
            raise CallHung(what, setting, limit_s) from None
        raise


def kill_actor(handle: Any) -> None:
    """End the Ray actor behind ``handle`` for good (no restart)."""
    import ray

    ray.kill(handle, no_restart=True)


def unresponsive_actors(
    handles: dict[str, Any], limit_s: float, setting: str = "coordinator.call_timeout_s"
) -> dict[str, str]:
    """Ask every actor in ``handles`` for its ``stats`` at once, wait up to ``limit_s`` (the
    value of ``setting``) in all, and kill (no restart) each one that failed or did not answer
    in time; returns ``{name: why}`` for those. Left running, such an actor would hold its
    resources, and its later writes would race the instance that replaces it."""
    import ray

    if not handles:
        return {}
    refs = {h.stats.remote(): name for name, h in handles.items()}
    ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=limit_s)
    gone: dict[str, str] = {}
    for ref in ready:
        try:
            ray.get(ref)
        except Exception as e:  # died, or its stats call failed: either way not usable
            gone[refs[ref]] = repr(e)[:200]
    for ref in late:
        gone[refs[ref]] = f"no answer within {setting}={limit_s:g} s"
    for name in gone:
        with contextlib.suppress(Exception):  # one already dead needs no kill
            kill_actor(handles[name])
    return gone


def sync_retry_delay(failures_in_row: int, backoff_s: float) -> float:
    """Seconds to wait before a sync after ``failures_in_row`` failed ones: 0 for the first
    try, then ``backoff_s`` doubling per failure, capped at 30 s."""
    if failures_in_row <= 0 or backoff_s <= 0:
        return 0.0
    return float(min(30.0, backoff_s * 2 ** (failures_in_row - 1)))


async def wait_or_timeout(event: asyncio.Event, timeout_s: float) -> bool:
    """Return when ``event`` is set or after ``timeout_s`` (at once if it is not positive):
    True if it was set (it may have been cleared since), False if the time ran out."""
    if timeout_s <= 0:
        return event.is_set()
    try:  # not wait_for, which on Python 3.11 can swallow a cancel of the caller
        async with asyncio.timeout(timeout_s):
            return await event.wait()
    except TimeoutError:
        return False


def child_processes() -> list[tuple[int, str]]:
    """``(pid, command line)`` of this process's children (Linux ``/proc``)."""
    me, out = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it exited meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:  # the field after the state: ppid
            out.append((int(entry.name), cmd))
    return out
