"""The first poll after a route waits until the engine holds the routed work.

A route starts one ``generate`` call per trajectory and answers at once; the engine takes the
work into its batch at its next scheduling step. The control shell polls an instance after
every command to it, and a poll that came before that step would find the routed work neither
running nor counted yet: the control side would see an instance emptier than it is, and the
instance would ask for another poll a moment later, as the work starts
(``SnapshotEncoder.due``): one request and answer more per route for work that outlives a poll.
So the poll first calls :func:`admitted`, which returns once every routed trajectory still
generating runs, or the engine has taken a decode step since they were all queued (those
still waiting wait for room, which the poll reports), or ``ADMIT_WAIT_S`` passed. An engine
whose step counter reads 0 (it keeps none, as SGLang's adapter, or has not stepped yet) is
waited for only until the work is queued. The route itself does not wait: the control cycle
waits for its answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection

from engine_adapters import EngineSnapshot

#: The longest a poll waits for the engine to take the routed work (seconds).
ADMIT_WAIT_S = 0.25
#: How often it looks meanwhile (seconds).
ADMIT_CHECK_S = 0.002


async def admitted(
    snapshot: Callable[[], Awaitable[EngineSnapshot]],
    ids: Collection[str],
    generating: Callable[[str], bool],
    wait_s: float = ADMIT_WAIT_S,
) -> bool:
    """Wait until the engine holds ``ids`` (see the module docstring); True if every one of
    them that is still ``generating`` runs (or none is left), False if some wait for room or
    the time ran out."""
    if not ids:
        return True
    deadline = time.monotonic() + wait_s
    queued_at: int | None = None  # the step counter once every pending id was queued
    while True:
        snap = await snapshot()
        running = {r.trajectory_id for r in snap.running}
        pending = sum(1 for t in ids if generating(t) and t not in running)
        if not pending:
            return True
        if queued_at is None:
            if snap.waiting >= pending:
                if not snap.decode_steps:  # no step counter (or no step yet): queued will do
                    return False
                queued_at = snap.decode_steps
        elif snap.decode_steps > queued_at:
            return False
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(ADMIT_CHECK_S)
