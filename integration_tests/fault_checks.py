"""What the fault tests check after a fault: the control loop lost an instance (waited for from
the test's driver), the ledger balances, and what a lost instance held went back to the queue
and ran elsewhere; and the watchdog that stops a faulted run that does not complete
(:func:`run_watched` runs one under it)."""

from __future__ import annotations

import threading
from typing import Any

from waiting import wait_for

from trajectory_server import routes_out_of_queue


def watchdog(dep: Any, out: dict[str, Any], timeout_s: float) -> threading.Event:
    """Stop ``dep``'s run (``out["stopped_by_watchdog"] = True``) unless the event returned is
    set within ``timeout_s``."""
    import ray

    finished = threading.Event()

    def watch() -> None:
        if not finished.wait(timeout_s):
            out["stopped_by_watchdog"] = True
            ray.get(dep.coordinator.stop.remote())

    threading.Thread(target=watch, daemon=True).start()
    return finished


def run_watched(
    dep: Any, out: dict[str, Any], timeout_s: float, on_record: Any = None
) -> dict[str, Any]:
    """``dep.run(on_record=...)`` under :func:`watchdog` (``timeout_s``): its summary, or what
    it raises. The watchdog is off once the run has ended either way."""
    finished = watchdog(dep, out, timeout_s)
    try:
        return dict(dep.run(on_record=on_record))
    finally:
        finished.set()


def lost_record(dep: Any, iid: str, what: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """The record of ``iid`` in the control loop's lost instances (``ShellIO.lost``), once
    there; an AssertionError naming ``what`` after ``timeout_s``."""
    import ray

    def found() -> list[dict[str, Any]]:
        return [x for x in ray.get(dep.coordinator.lost_instances.remote())
                if x["instance_id"] == iid]  # fmt: skip

    return dict(wait_for(found, timeout_s, what, every_s=0.05)[0])


def assert_ledger_balances(
    ledger: dict[str, Any], per_step: int, *, crashed_mid_step: bool = False
) -> None:
    """Every admitted trajectory is consumed, in flight, waiting to be consumed or dropped with
    a reason; each trained step consumed ``per_step`` once. ``crashed_mid_step``: the trainer
    died holding a consumed batch (the checkpoint the app resumes from predates it, so that
    batch is generated again after the resume)."""
    assert ledger["problems"] == []
    assert (
        ledger["consumed"] + ledger["in_flight"] + ledger["waiting_consume"] + ledger["dropped"]
        == ledger["trajectories"]
    )
    allowed = {ledger["steps_done"] * per_step}  # none counted twice
    if crashed_mid_step:
        allowed.add((ledger["steps_done"] + 1) * per_step)
    assert ledger["consumed"] in allowed
    assert all(reason and reason != "?" for reason in ledger["dropped_reasons"])


def assert_routes_stopped(hist: dict[str, list[list[Any]]], rec: dict[str, Any]) -> None:
    """What the lost instance of ``rec`` (its lost record) held went back to the queue and was
    routed elsewhere (or dropped with its group); no route reached it after; every route came
    from the queue (``hist``: the trajectory server's histories)."""
    iid = rec["instance_id"]
    for tid in rec["requeued"]:
        events = hist[tid]
        at = max(i for i, e in enumerate(events) if e[0] == "lost" and e[1] == iid)
        after = events[at + 1 :]
        assert all(e[1] != iid for e in after if e[0] == "routed"), (tid, events)
        assert any(e[0] in ("routed", "dropped") for e in after), (tid, events)
    assert routes_out_of_queue(hist) == []
