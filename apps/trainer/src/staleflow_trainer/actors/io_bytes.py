"""The bytes that cross the control process, per peer kind and per call: for a Ray call the
pickled size of its arguments and of its answer, for the trajectory server the bytes on its
socket as its client counts them (the data-path benchmark shows they do not grow with response
length)."""

from __future__ import annotations

import pickle
from typing import Any

from staleflow_trainer.actors.rollout_wire import poll_parts


def size(x: Any) -> int:
    """What ``x`` costs on a Ray call: its pickled size."""
    return len(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL))


class ByteCounts:
    """Bytes per peer kind and per ``kind.call``, and the polls sent per reason."""

    def __init__(self) -> None:
        self._kinds: dict[str, int] = {}
        self._by_call: dict[str, int] = {}
        self.polls: dict[str, int] = {}
        #: bytes of calls that only kept watch on a live instance (a ``wait_results`` whose time
        #: ran out, a quiet poll answered None): they accrue per instance and second, whatever
        #: the trajectories (also counted in their calls)
        self.watch_bytes = 0
        self._parts: dict[str, int] = {}  # "kind.call.part" -> bytes (also in kind.call)

    def count(self, kind: str, n: int, call: str, *, watch: bool = False) -> None:
        """``n`` bytes of ``kind.call``; ``watch``: of a call that only kept watch (they are
        also in :attr:`watch_bytes`)."""
        self._kinds[kind] = self._kinds.get(kind, 0) + n
        key = f"{kind}.{call}"
        self._by_call[key] = self._by_call.get(key, 0) + n
        if watch:
            self.watch_bytes += n

    def poll_answer(self, p: Any, *, watch: bool) -> None:
        """A rollout instance's poll answer ``p``: its bytes under ``instances.poll_answer``,
        and those of its parts (``rollout_wire.poll_parts``: the snapshot delta, the
        outcomes, ...) under ``parts``."""
        self.count("instances", size(p), "poll_answer", watch=watch)
        if p:
            self.parts("instances.poll_answer", {k: size(v) for k, v in poll_parts(p).items()})

    def parts(self, key: str, sizes: dict[str, int]) -> None:
        """The bytes of the parts of one call counted under ``key`` (``kind.call``), each
        under ``key.part`` (they are a breakdown of that call's bytes, not bytes beside it)."""
        for part, n in sizes.items():
            self._parts[f"{key}.{part}"] = self._parts.get(f"{key}.{part}", 0) + n

    def poll(self, why: str) -> None:
        self.polls[why] = self.polls.get(why, 0) + 1

    def stats(self, ts: Any) -> dict[str, Any]:
        """Bytes per peer kind, under ``by_call`` per ``kind.call`` (a call's arguments and
        its answer counted apart: ``poll`` and ``poll_answer``; for the trajectory server
        ``ts`` by request type, from its client's socket counts), under ``polls`` the polls
        sent by reason, under ``watch`` the bytes of calls that only kept watch (see
        :attr:`watch_bytes`; a part of ``instances``, not bytes beside it), and under ``parts``
        the breakdown of some calls' bytes (:meth:`parts`)."""
        kinds, by_call = dict(self._kinds), dict(self._by_call)
        counted = getattr(ts, "wire_bytes", None)  # None: no client yet, or a test's fake
        for t, c in (counted() if counted is not None else {}).items():
            kinds["ts"] = kinds.get("ts", 0) + c["sent"] + c["received"]
            by_call[f"ts.{t}"], by_call[f"ts.{t}_answer"] = c["sent"], c["received"]
        return {**kinds, "by_call": by_call, "polls": dict(self.polls), "watch": self.watch_bytes,
                "parts": dict(self._parts)}  # fmt: skip
