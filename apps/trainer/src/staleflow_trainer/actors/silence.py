"""Silent instances: a call to an instance that misses its cycle (``ANSWER_WAIT_S``) makes
the instance *silent* until its calls are answered again. The control core then leaves it out
of every cycle (:class:`~staleflow_trainer.control.events.InstanceSilent`) and routes the work
held for its sync elsewhere, and the routes to it that were still queued behind the overdue
call are taken back instead of sent: the core returns them to the queue and routes them to
instances that answer.

Without it, a silent instance looked free to the router (its last answer said so), so the work
of the next batch went there and waited (for its sync, or behind the overdue call) until the
instance was lost (``coordinator.poll_timeout_s`` or ``call_timeout_s`` later), while the
trainer waited for that batch and the other instances idled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from staleflow_trainer.control import effects as fx
from staleflow_trainer.control.events import InstanceSilent


class Silence:
    """The routes queued in each instance's lane and not yet sent, and the silent instances."""

    def __init__(self) -> None:
        self._unsent: dict[str, list[fx.Route]] = {}
        self._taken_back: list[fx.Route] = []  # queued in a lane, then taken back: not sent
        self._silent: set[str] = set()
        self._events: list[tuple[str, bool, tuple[str, ...]]] = []  # (iid, silent, withdrawn)

    def queue(self, iid: str, effects: Sequence[fx.Effect]) -> list[fx.Effect]:
        """The effects of ``iid`` to queue in its lane: routes are kept until they are sent
        (:meth:`sending`); to a silent instance they are taken back at once."""
        routes = [e for e in effects if isinstance(e, fx.Route)]
        if iid in self._silent and routes:
            self._take_back(iid, routes)
            return [e for e in effects if not isinstance(e, fx.Route)]
        self._unsent.setdefault(iid, []).extend(routes)
        return list(effects)

    def sending(self, e: fx.Route) -> bool:
        """Whether the route ``e`` is to be sent now (False: it was taken back)."""
        for kept in (self._unsent.get(e.instance_id, []), self._taken_back):
            for i, r in enumerate(kept):
                if r is e:
                    del kept[i]
                    return kept is not self._taken_back
        return True  # (not queued here: carried at once)

    def overdue(self, iid: str) -> None:
        """A call to ``iid`` missed its cycle: it is silent, and its unsent routes come back."""
        if iid not in self._silent:
            self._silent.add(iid)
            self._events.append((iid, True, ()))
        unsent = self._unsent.pop(iid, [])
        self._taken_back += unsent  # they still wait in its lane
        self._take_back(iid, unsent)

    def _take_back(self, iid: str, routes: Sequence[fx.Route]) -> None:
        ids = tuple(t for r in routes for t in r.trajectory_ids)
        if ids:
            self._events.append((iid, True, ids))

    def answered(self, busy: Callable[[str], bool]) -> None:
        """The silent instances with no call out any more answer again."""
        for iid in sorted(self._silent):
            if not busy(iid):
                self._silent.discard(iid)
                self._events.append((iid, False, ()))

    def forget(self, iid: str) -> None:
        """``iid`` left the run (the core requeues what it held, unsent routes included)."""
        self._unsent.pop(iid, None)
        self._taken_back = [r for r in self._taken_back if r.instance_id != iid]
        self._silent.discard(iid)

    def take_events(self, at: float) -> list[InstanceSilent]:
        """What the core is to be told, in order, as events at ``at``."""
        out, self._events = self._events, []
        return [InstanceSilent(at=at, instance_id=i, silent=s, withdrawn=w) for i, s, w in out]
