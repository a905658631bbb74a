"""What the trajectory server (TS) holds of trajectories the control core believes run on an
instance, when the instance cannot tell: it died before its report reached the control actor,
or the TS refused to route them there.

The TS is the truth for each trajectory's place. Between an instance's writing its output to
the TS and its report reaching the control core, the two disagree: the core still has the
trajectory running there. If the instance dies in that window, or the core routes a
trajectory the TS no longer holds in its queue, the core must learn what the TS holds —
otherwise it puts the trajectory back in its queue, routes it, the TS refuses, and so on
forever. :func:`in_store` asks the TS (``locate``, then ``history`` for the finished ones:
ids and lengths, never payloads) and sorts the trajectories:

* ``finished``: an :class:`~staleflow_trainer.control.events.Outcome` with the response length
  and finish reason the TS holds — the core scores it as if the report had arrived;
* ``queued``: back in (or never out of) the TS queue, with the response length it holds;
* ``dropped``: dropped in the TS, unknown to it, or running on another instance there — each
  with the reason; the core drops it and its group (the TS would refuse its output);
* ``running``: running on the instance asked about (nothing to settle).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from staleflow_trainer.control.events import Outcome
from trajectory_server import EventKind, Location, LocationState
from trajectory_server.errors import UnknownTrajectory

#: longest reason passed on (the TS and the protocol take it as an id)
_REASON_CHARS = 200
_QUEUED = LocationState.QUEUED


@attrs.frozen(kw_only=True)
class InStore:
    """The trajectories asked about, sorted by what the TS holds of them."""

    finished: tuple[Outcome, ...] = ()
    queued: tuple[tuple[str, int], ...] = ()
    dropped: tuple[tuple[str, str], ...] = ()
    running: tuple[str, ...] = ()


async def in_store(ts: Any, ids: Sequence[str], instance_id: str) -> InStore:
    """Where the TS holds each of ``ids`` (see the module docstring); ``instance_id``: the
    instance the core believes runs them."""
    ids = list(dict.fromkeys(ids))
    if not ids:
        return InStore()
    locs = await _locate(ts, ids)
    queued_ids = {t for t, loc in locs.items() if loc is not None and loc.state is _QUEUED}
    lengths = await queued_lengths(ts, queued_ids)
    finished: list[Outcome] = []
    queued: list[tuple[str, int]] = []
    dropped: list[tuple[str, str]] = []
    running: list[str] = []
    for tid in ids:
        loc = locs[tid]
        if loc is None:
            dropped.append((tid, "unknown to the trajectory store"))
        elif loc.state is LocationState.FINISHED:
            finished.append(await _finished(ts, tid))
        elif loc.state is LocationState.DROPPED:
            dropped.append((tid, f"dropped in the trajectory store: {loc.reason}"[:_REASON_CHARS]))
        elif loc.state is _QUEUED:
            queued.append((tid, lengths[tid]))
        elif loc.instance_id == instance_id:
            running.append(tid)
        else:
            why = f"running on {loc.instance_id} in the trajectory store, not {instance_id}"
            dropped.append((tid, why[:_REASON_CHARS]))
    return InStore(finished=tuple(finished), queued=tuple(queued), dropped=tuple(dropped),
                   running=tuple(running))  # fmt: skip


async def queued_lengths(ts: Any, ids: set[str] | Sequence[str]) -> dict[str, int]:
    """Response lengths the TS holds for queued trajectories (every queue level: a requeued
    partial keeps its V_traj)."""
    want = set(ids)
    if not want:
        return {}
    entries = await ts.queue_view(None)
    return {e.trajectory_id: int(e.generated_len) for e in entries if e.trajectory_id in want}


async def _locate(ts: Any, ids: list[str]) -> dict[str, Location | None]:
    try:
        return dict(zip(ids, await ts.locate(ids), strict=True))
    except UnknownTrajectory:  # all or nothing: one by one, None for the unknown ones
        out: dict[str, Location | None] = {}
        for tid in ids:
            try:
                out[tid] = (await ts.locate([tid]))[0]
            except UnknownTrajectory:
                out[tid] = None
        return out


async def _finished(ts: Any, tid: str) -> Outcome:
    """The response length and finish reason the TS recorded when ``tid`` finished."""
    last = next(e for e in reversed(await ts.history(tid)) if e.kind is EventKind.FINISHED)
    return Outcome(trajectory_id=tid, generated=int(last.generated_len), finish=str(last.reason))
