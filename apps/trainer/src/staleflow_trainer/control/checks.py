"""Ledger checks: nothing admitted is lost or counted twice, and the bound held.

:func:`ledger_problems` compares the core's ledger with the protocol's own and returns what
disagrees (empty when all is well); tests and the end of every run call it.
"""

from __future__ import annotations

from typing import Any

from staleflow_trainer.control.ledger import Where
from staleness_protocol import TrajectoryState

_LIVE = {
    Where.QUEUED: (TrajectoryState.IN_FLIGHT,),
    Where.RUNNING: (TrajectoryState.IN_FLIGHT,),
    # rewarded members are finished in the protocol only once their group's n are in
    Where.FINISHED: (TrajectoryState.IN_FLIGHT, TrajectoryState.FINISHED, TrajectoryState.OCCUPIED),
    # retired by the protocol (consumed at once, ended ones after its tombstone window)
    Where.CONSUMED: (TrajectoryState.CONSUMED, None),
    Where.DROPPED: (TrajectoryState.DROPPED, TrajectoryState.ABORTED, None),
}


def ledger_problems(core: Any) -> list[str]:
    """Every disagreement between the core's ledger and its protocol (empty when consistent):
    each live admitted trajectory is where the protocol says, the totals balance (admitted =
    consumed + dropped + in flight), every group the feed counts as fresh is open and none of
    its members ran, and no consumed sample is staler than η."""
    problems: list[str] = []
    proto = core.protocol
    admitted_live = 0
    for e in core.ledger.live():
        if e.v_traj is None:
            continue
        admitted_live += 1
        state = core.trajectory_state(e.tid)
        if state not in _LIVE[e.where]:
            problems.append(f"{e.tid}: {e.where.value} in the ledger, {state} in the protocol")
    counts = core.ledger.counts()
    settled = core.ledger.settled
    stats = proto.stats()
    by_state = stats.trajectories_by_state
    admitted = sum(by_state.values())
    if admitted != admitted_live + settled["consumed"] + settled["dropped"]:
        problems.append(
            f"admitted {admitted} in the protocol, {admitted_live} live + {settled['consumed']} "
            f"consumed + {settled['dropped']} dropped in the ledger"
        )
    if by_state.get("consumed", 0) != counts["consumed"]:
        problems.append(f"consumed {by_state.get('consumed', 0)} vs {counts['consumed']}")
    # a fresh group (the feed counts it as stock until a member is routed) is open and none
    # of its members has run: one that is not would hold the feed's place for ever
    for gid in core._fresh:
        g = core.ledger.groups.get(gid)
        if g is None or g.closed:
            problems.append(
                f"{gid}: fresh in the feed's stock, {'closed' if g else 'gone'} in the ledger"
            )
            continue
        ran = [t for t in g.members if (e := core.ledger.entries.get(t)) is not None
               and e.where not in (Where.QUEUED, Where.DROPPED)]  # fmt: skip
        if ran:
            problems.append(f"{gid}: fresh in the feed's stock, but {ran[0]} ran")
    eta = proto.config.eta
    if eta is not None and stats.staleness_histogram and max(stats.staleness_histogram) > eta:
        problems.append(f"consumed staleness {max(stats.staleness_histogram)} > eta {eta}")
    return problems
