"""One lane of calls per rollout instance: the control shell's calls to one instance run one
after another, in the order they were made, and calls to different instances run at the same
time. The control loop waits for a lane only so long (``ANSWER_WAIT_S``): an instance that does
not answer holds its own lane until its call ends (answered, failed, or hung past its limit:
``coordinator.poll_timeout_s`` for a poll or a route, ``coordinator.call_timeout_s`` for an
interrupt), not the loop and every other instance with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: How long (seconds) a control cycle waits for the instances' answers to its polls and
#: commands before it goes on without the late ones; each late answer is handled when it comes
#: (a later cycle), and no new call is sent to that instance until it has come.
ANSWER_WAIT_S = 2.0


class Lanes:
    """The last call made to each instance (a task), which the next one waits for."""

    def __init__(self) -> None:
        self._tail: dict[str, asyncio.Task[Any]] = {}

    def busy(self, iid: str) -> bool:
        """Whether a call to ``iid`` is still out."""
        t = self._tail.get(iid)
        return t is not None and not t.done()

    def run(self, iid: str, call: Callable[[], Awaitable[T]]) -> asyncio.Task[T]:
        """Start ``call()`` on ``iid``'s lane, once the call before it there has ended (whatever
        its outcome: that is its own caller's to read)."""
        before = self._tail.get(iid)

        async def after() -> T:
            if before is not None and not before.done():
                await asyncio.wait([before])
            return await call()

        task = asyncio.get_running_loop().create_task(after())
        self._tail[iid] = task
        return task

    def forget(self, iid: str) -> None:
        """``iid`` left the run: its next call, if any, waits for nothing."""
        self._tail.pop(iid, None)
