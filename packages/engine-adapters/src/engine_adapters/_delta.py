"""Snapshot deltas: an instance's snapshots sent as changes, not as a full list per poll.

A snapshot lists every running trajectory with its generated-token count. Sent every poll, that
list costs bytes per trajectory per poll, so a trajectory that runs longer costs more. The
engine's snapshot also carries ``decode_steps``, a counter of its decode steps; a trajectory
that decodes without pause gains one token per step, so its count is ``decode_steps + offset``
with an offset that stays fixed while it runs.

:class:`SnapshotEncoder` (beside the engine) sends a trajectory's entry ``[id, prompt tokens,
offset]`` once when it appears in ``running``, and again only when its real count stops
matching that rule (it was preempted, waited, resumed, or the engine keeps no step counter); it
sends the id in ``left`` when the trajectory leaves ``running``, unless its end is reported
beside the delta anyway (``ended``: the ids of the poll's outcomes, known to both sides). Of
the header (``seq``, ``version``, ``steps``, ``waiting``, ``kv``, ``kv_cap``, ``tps`` and
``n``, the running count that the receiver checks) a delta carries only the fields that changed
(``seq`` only when it is not the last one sent plus one). A snapshot with nothing changed
encodes to ``None``. :class:`SnapshotDecoder` (on the receiving side) rebuilds the
:class:`EngineSnapshot`. The reconstruction is exact at every poll: the encoder compares each
trajectory's real count with what the decoder will compute and resends the entry on any
difference. Only two things may differ: the order of ``running`` (a resent entry moves to the
end; no consumer reads meaning into it), and ``seq`` after a lost ``None`` (the decoded one
runs behind the engine's, still increasing by one a poll).

Every delta other than ``None`` carries a counter ``k`` that starts at a random value. The
receiver acknowledges the last delta it applied with its next request (``ack=k``); the encoder
answers ``None`` only once its last delta is acknowledged, and a full snapshot whenever the
request does not acknowledge the last delta it sent or asks for one (``full``): after an answer
that was lost or never decoded, after either side restarted. A delta whose ``k`` does not
follow the last one applied is refused: ``decode`` returns None and resets, and the receiver
asks for a full snapshot next time. The encoder's first delta is full.

Bytes per poll: nothing while nothing changes; while the engine decodes, the changed header
fields; one entry per trajectory start or change of pace and one id per trajectory that left
without an outcome — never one entry per running trajectory per poll.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Mapping
from typing import Any

from engine_adapters._contract import EngineSnapshot, RunningTrajectory

_HEADER = ("version", "steps", "waiting", "kv", "kv_cap", "tps", "n")


def _header(snap: EngineSnapshot, n: int) -> dict[str, Any]:
    return {
        "version": snap.version,
        "steps": snap.decode_steps,
        "waiting": snap.waiting,
        "kv": snap.kv_used_tokens,
        "kv_cap": snap.kv_capacity_tokens,
        "tps": snap.throughput_tokens_per_s,
        "n": n,
    }


class SnapshotEncoder:
    """Turns one instance's successive snapshots into deltas (see the module docstring)."""

    __slots__ = ("_acked", "_head", "_k", "_sent", "_seq")

    def __init__(self) -> None:
        self._k: int | None = None  # counter of the last delta sent; None: none yet
        self._acked = False  # the receiver acknowledged delta _k
        self._seq = 0
        self._head: dict[str, Any] = {}
        self._sent: dict[str, tuple[int, int]] = {}  # id -> (prompt, offset) the receiver holds

    def encode(
        self,
        snap: EngineSnapshot,
        *,
        ack: int | None = None,
        full: bool = False,
        ended: Collection[str] = (),
    ) -> dict[str, Any] | None:
        """The delta from the last one sent to ``snap`` (None: nothing changed).

        ``ack``: the counter of the last delta the receiver applied, if it applied one since
        its last request; ``full``: the receiver asks for the whole snapshot. ``ended``: ids
        whose end travels beside this delta (the receiver drops them itself)."""
        if ack is not None:
            self._acked = ack == self._k
        full = full or not self._acked  # the last delta was lost or never decoded
        old = {} if full else self._sent
        steps = snap.decode_steps
        cur: dict[str, tuple[int, int]] = {}
        add: list[list[Any]] = []
        for r in snap.running:
            tid = r.trajectory_id
            entry = (r.prompt_tokens, r.generated_tokens - steps)
            cur[tid] = entry
            if old.get(tid) != entry or tid in ended:
                add.append([tid, entry[0], entry[1]])
        left = [t for t in old if t not in cur and t not in ended]
        head = _header(snap, len(cur))
        out: dict[str, Any]
        if full:
            out = {"full": 1, **head, "seq": snap.seq}
        else:
            out = {f: v for f, v in head.items() if self._head.get(f) != v}
            if snap.seq != self._seq + 1:
                out["seq"] = snap.seq
        if add:
            out["add"] = add
        if left:
            out["left"] = left
        self._seq = snap.seq
        if not out:
            return None  # nothing changed since an acknowledged delta
        self._head = head
        self._sent = cur
        self._k = secrets.randbits(30) if self._k is None else self._k + 1
        self._acked = False
        out["k"] = self._k
        return out


class SnapshotDecoder:
    """Rebuilds one instance's snapshots from :class:`SnapshotEncoder` deltas."""

    __slots__ = ("_head", "_running", "_seq", "_unacked", "instance_id", "k")

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.k: int | None = None  # counter of the last delta applied; None: ask for a full one
        self._unacked = False
        self._seq = 0
        self._head: dict[str, Any] = {}
        self._running: dict[str, tuple[int, int]] = {}

    def request(self) -> dict[str, Any]:
        """What the next request tells the encoder: ``{}`` (nothing new applied), ``{"ack":
        k}`` (delta ``k`` applied since the last request) or ``{"full": True}``."""
        if self.k is None:
            return {"full": True}
        if self._unacked:
            self._unacked = False
            return {"ack": self.k}
        return {}

    def reset(self) -> None:
        """Forget everything: the next request asks for a full snapshot."""
        self.k = None
        self._unacked = False
        self._head = {}
        self._running = {}

    def decode(
        self, delta: Mapping[str, Any] | None, *, time_s: float, ended: Collection[str] = ()
    ) -> EngineSnapshot | None:
        """The snapshot ``delta`` describes (``None``: the same as the last one, one ``seq``
        on), stamped ``time_s``; None if there is no last one or ``delta`` does not follow it
        (the decoder resets, so the next request asks for a full one).

        ``ended``: the ids whose end came beside the delta (the poll's outcomes). Raises
        ValueError (and resets) if the rebuilt running count is not the delta's ``n``."""
        if delta is None:
            if self.k is None:
                return None
            self._seq += 1
            return self._snapshot(time_s)
        k = int(delta["k"])
        if delta.get("full"):
            running: dict[str, tuple[int, int]] = {}
            head: dict[str, Any] = {}
        elif self.k is not None and k == self.k + 1:
            running, head = self._running, self._head
        else:
            self.reset()
            return None
        for tid in ended:
            running.pop(tid, None)
        for tid in delta.get("left", ()):
            running.pop(tid, None)
        for tid, prompt, offset in delta.get("add", ()):
            running.pop(tid, None)  # a resent entry moves to the end, as in the engine
            running[str(tid)] = (int(prompt), int(offset))
        for f in _HEADER:
            if f in delta:
                head[f] = delta[f]
        missing = [f for f in _HEADER if f not in head]
        if missing or len(running) != int(head["n"]):
            self.reset()
            what = (
                f"no {missing}"
                if missing
                else f"{len(running)} running rebuilt, the instance reports n={head['n']}"
            )
            raise ValueError(f"snapshot delta from {self.instance_id!r} does not add up: {what}")
        self._seq = int(delta["seq"]) if "seq" in delta else self._seq + 1
        self._running, self._head, self.k = running, head, k
        self._unacked = True
        return self._snapshot(time_s)

    def _snapshot(self, time_s: float) -> EngineSnapshot:
        h = self._head
        steps = int(h["steps"])
        return EngineSnapshot(
            instance_id=self.instance_id,
            seq=self._seq,
            time_s=time_s,
            version=int(h["version"]),
            running=tuple(
                RunningTrajectory(trajectory_id=t, prompt_tokens=p, generated_tokens=steps + o)
                for t, (p, o) in self._running.items()
            ),
            waiting=int(h["waiting"]),
            kv_used_tokens=int(h["kv"]),
            kv_capacity_tokens=int(h["kv_cap"]),
            throughput_tokens_per_s=float(h["tps"]),
            decode_steps=steps,
        )
