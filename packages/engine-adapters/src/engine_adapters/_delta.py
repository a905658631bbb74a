"""Snapshot deltas: an instance's snapshots sent as changes, not as a full list per poll.

A snapshot lists every running trajectory with its generated-token count. Sent every poll, that
list costs bytes per trajectory per poll, so a trajectory that runs longer costs more. The
engine's snapshot also carries ``decode_steps``, a counter of its decode steps; a trajectory
that decodes without pause gains one token per step, so its count is ``decode_steps + offset``
with an offset that stays fixed while it runs.

:class:`SnapshotEncoder` (beside the engine) sends a trajectory's entry (its id, prompt tokens
and offset; entries that share the last two and an id prefix go as one ``[prompt, offset,
prefix, n, n, ...]`` for the ids ``prefix/n``, as the samples of one prompt admitted together
do; other ids go whole after a ``None`` prefix) once when it appears in ``running``, and again
only when its real count stops matching that rule (it was preempted, waited, resumed, or the
engine keeps no step counter); it sends the id in ``left`` when the trajectory leaves ``running``, unless its end is reported
beside the delta anyway (``ended``: the ids of the poll's outcomes, known to both sides). Of
the header (``version``, ``waiting``, ``kv_cap``, ``tps`` and ``n``, the running count that
the receiver checks) a delta carries only the fields that changed. The receiver numbers the
snapshots it rebuilds itself (``seq``); the engine's own numbering does not travel.

The two fields that move while the engine decodes, the step counter ``steps`` and the KV use
``kv``, are extrapolated in time: both sides hold the value last sent, when it was sent (each
on its own clock: the snapshot's ``time_s`` here, the decode time there) and its rate per
second (``ds``, ``dk``: the sender's mean rate since the value before). The encoder sends a
field again only when the receiver's extrapolation is off by more than its ``tolerance``
allows: that share of the change since the value was last sent, and, with a tolerance above
0, at least the change since the previous check (the jitter of an engine's pace over one
check; a field that :meth:`SnapshotEncoder.due` found off is sent with the next delta anyway);
``tps`` is resent when it moves by more than that share. A delta that changes the running
count sends both fields as they are, with the pace they keep from then on: none while nothing
runs, else the step rate last sent while trajectories ran and a KV rate of that many tokens a
step (:meth:`SnapshotEncoder._repace`), so that a start or an end needs no correction after
it. With the default tolerance of 0 the
reconstruction is exact at every poll when both clocks agree (a test's); an engine that
decodes at a steady pace then sends nothing at all. A snapshot with nothing changed encodes to
``None``. Because the receiver extrapolates by time, not by polls, it need not poll to keep
its view: :meth:`SnapshotEncoder.due` tells the sender's side when the view is off (a
trajectory started, left or changed pace, a header field changed, progress drifted), so the
receiver can be told to poll only then, and :meth:`SnapshotDecoder.view` is the view between
polls.
:class:`SnapshotDecoder` (on the receiving side) rebuilds the :class:`EngineSnapshot`: the
encoder compares each trajectory's real count with what the decoder will compute and resends
the entry on any difference (with a tolerance, only when its offset moved by more than that
share of the trajectory's own count: its count is then off by at most that share plus the step
counter's allowance). Only the order of ``running`` may differ beyond the tolerance (a resent entry
moves to the end; no consumer reads meaning into it). A lost ``None`` answer costs nothing:
``None`` carries no state.

Every delta other than ``None`` carries a counter ``k`` that starts at a random value. The
receiver acknowledges the last delta it applied with its next request (``ack=k``); the encoder
answers ``None`` only once its last delta is acknowledged, and a full snapshot whenever the
request does not acknowledge the last delta it sent or asks for one (``full``): after an answer
that was lost or never decoded, after either side restarted. A delta whose ``k`` does not
follow the last one applied is refused: ``decode`` returns None and resets, and the receiver
asks for a full snapshot next time. The encoder's first delta is full.

Bytes: nothing while nothing changes or the engine decodes at its pace; a correction when the
pace changes; one entry per trajectory start or change of pace and one id per trajectory that
left without an outcome — never one entry per running trajectory per poll.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from engine_adapters._contract import EngineSnapshot, RunningTrajectory

_HEADER = ("version", "waiting", "kv_cap", "tps", "n")
#: a delta's fields as they travel: each as its number here (:meth:`SnapshotDecoder.fields`
#: names them again)
_FIELDS = ("k", "full", *_HEADER, "steps", "kv", "ds", "dk", "add", "left")
_CODE = {f: i for i, f in enumerate(_FIELDS)}
# the fields that move while the engine decodes: the receiver extrapolates them by their pace
_PROGRESS = ("steps", "kv")


def _header(snap: EngineSnapshot, n: int) -> dict[str, Any]:
    return {
        "version": snap.version,
        "waiting": snap.waiting,
        "kv_cap": snap.kv_capacity_tokens,
        "tps": snap.throughput_tokens_per_s,
        "n": n,
    }


def _progress(snap: EngineSnapshot) -> dict[str, int]:
    """The fields of :data:`_PROGRESS` in ``snap``."""
    return {"steps": snap.decode_steps, "kv": snap.kv_used_tokens}


class _Pace:
    """A progress field (``steps`` or ``kv``) as both sides extrapolate it: the value last sent
    plus its rate (per second) times the seconds since, each side on its own clock (the
    sender's snapshot time, the receiver's decode time)."""

    __slots__ = ("base", "last", "rate", "t0")

    def __init__(self, base: int = 0, t0: float = 0.0, rate: float = 0.0) -> None:
        self.base, self.t0, self.rate = base, t0, rate
        self.last = base  # (sender) the value at the previous check

    def at(self, t: float) -> int:
        return self.base + round(self.rate * max(t - self.t0, 0.0))

    def rebase(self, value: int, t: float) -> None:
        """(Sender) restart from ``value`` at ``t`` with the mean rate since the last value
        sent (exact for a steady engine), rounded as it is sent."""
        if t > self.t0:
            self.rate = _wire_rate((value - self.base) / (t - self.t0))
        self.base, self.t0 = value, t


def _wire_rate(rate: float) -> float:
    """A rate as it is sent: a whole number from 100 on (0.5 % off at most, and a third of the
    bytes), else to three decimals."""
    return round(rate) if abs(rate) >= 100 else round(rate, 3)


_PACE_KEY = {"steps": "ds", "kv": "dk"}


def id_prefix(tid: str) -> str | None:
    """The prompt part of a trajectory id ``prefix/n`` (the samples of one prompt share it;
    what :func:`pack_ids` groups by), None for an id of another shape."""
    return _split(tid)[0]


def _split(tid: str) -> tuple[str | None, Any]:
    """``"g7/3"`` -> ``("g7", 3)``: the samples of one group share a prefix, so a group of
    entries sends it once; an id of another shape goes whole, as ``(None, tid)``."""
    head, sep, tail = tid.rpartition("/")
    if sep and tail.isascii() and tail.isdigit() and str(int(tail)) == tail:
        return head, int(tail)
    return None, tid


def pack_ids(ids: Iterable[str]) -> list[Any]:
    """Trajectory ids as a compact list: ids ``prefix/n`` grouped by prefix (in order of first
    appearance), each group its prefix then its ``n``; an id of another shape goes whole,
    followed by no number. ``["g7/0", "g7/2", "x", "g8/1"]`` -> ``["g7", 0, 2, "x", "g8",
    1]``. :func:`unpack_ids` reverses it (in the packed order); a plain list of ids unpacks
    to itself."""
    groups: dict[str | None, list[Any]] = {}
    for tid in ids:
        prefix, item = _split(tid)
        groups.setdefault(prefix, []).append(item)
    out: list[Any] = []
    for prefix, items in groups.items():
        if prefix is None:
            out.extend(items)
        else:
            out.append(prefix)
            out.extend(items)
    return out


def unpack_ids(packed: Iterable[Any]) -> list[str]:
    """The ids of a :func:`pack_ids` list, in its order: a string followed by numbers is the
    prefix of ``prefix/n`` for each of them; a string followed by no number is an id."""
    out: list[str] = []
    prefix: str | None = None
    members = 0
    for x in packed:
        if isinstance(x, str):
            if prefix is not None and not members:
                out.append(prefix)
            prefix, members = x, 0
        elif prefix is None or isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"packed ids: {x!r} follows no prefix")
        else:
            out.append(f"{prefix}/{x}")
            members += 1
    if prefix is not None and not members:
        out.append(prefix)
    return out


def _check_tolerance(tolerance: float) -> float:
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    return float(tolerance)


class SnapshotEncoder:
    """Turns one instance's successive snapshots into deltas (see the module docstring)."""

    __slots__ = (
        "_acked",
        "_busy",
        "_flagged",
        "_head",
        "_k",
        "_pace",
        "_sent",
        "_stepping",
        "tolerance",
    )

    def __init__(self, tolerance: float = 0.0) -> None:
        self.tolerance = _check_tolerance(tolerance)
        self._k: int | None = None  # counter of the last delta sent; None: none yet
        self._acked = False  # the receiver acknowledged delta _k
        self._head: dict[str, Any] = {}
        self._sent: dict[str, tuple[int, int]] = {}  # id -> (prompt, offset) the receiver holds
        self._pace = {f: _Pace() for f in _PROGRESS}  # what the receiver extrapolates
        self._flagged: set[str] = set()  # progress fields due() found off: the next delta's
        self._busy = 0.0  # the decode-step rate last sent while trajectories ran
        self._stepping = False  # the engine keeps a step counter (it was seen above 0)

    def _allowed(self, field: str, value: int) -> float:
        """How far the receiver's view of ``field`` may be off: the tolerance's share of the
        change since the value was last sent, and, with a tolerance above 0, at least the
        change since the previous check (the jitter of an engine's pace over one check)."""
        pace = self._pace[field]
        allowed = self.tolerance * abs(value - pace.base)
        if self.tolerance > 0:
            allowed = max(allowed, abs(value - pace.last))
        return allowed

    def _off(self, field: str, value: int, t: float, cap: int) -> bool:
        """Whether the receiver's extrapolation of ``field`` at ``t`` is off by more than
        :meth:`_allowed`."""
        guess = self._pace[field].at(t)
        if field == "kv":
            guess = min(max(guess, 0), cap)
        return abs(value - guess) > self._allowed(field, value)

    def _moved(self, old: tuple[int, int] | None, entry: tuple[int, int], count: int) -> bool:
        """Whether a trajectory's entry must be resent: new, another prompt length, or its
        offset moved by more than the tolerance's share of its own count ``count``."""
        return (
            old is None
            or old[0] != entry[0]
            or abs(old[1] - entry[1]) > self.tolerance * max(count, 0)
        )

    def _changed(self, field: str, value: Any) -> bool:
        if field not in self._head:
            return True
        old = self._head[field]
        if field == "tps":
            return bool(abs(value - old) > self.tolerance * abs(old))
        return bool(old != value)

    def due(self, snap: EngineSnapshot) -> bool:
        """Whether the receiver's view of ``snap`` is off by more than the tolerance: more
        trajectories started, left or changed pace than its share of those running (with a
        tolerance of 0: any), the version or KV capacity changed, the waiting or running count
        moved by more than that share of the larger of them, the throughput by more than that
        share, or a progress field drifted past its allowance. Call it between requests to
        learn when one is worth making (what it waves through, the next answer still carries).
        It records the progress fields as checked (the next check's allowance is the change
        since this one) and flags those it found off (the next delta sends them whatever its
        allowance by then); it changes nothing the receiver mirrors."""
        if self._k is None:
            return True
        steps = snap.decode_steps
        n = len(snap.running)
        scale = self.tolerance * max(n, len(self._sent), snap.waiting)
        ids = {r.trajectory_id for r in snap.running}
        moved = sum(1 for t in self._sent if t not in ids) + sum(
            1
            for r in snap.running
            if self._moved(
                self._sent.get(r.trajectory_id),
                (r.prompt_tokens, r.generated_tokens - steps),
                r.generated_tokens,
            )
        )
        due = moved > scale
        for f, v in _header(snap, n).items():
            if f in ("waiting", "n"):
                due = due or f not in self._head or abs(v - self._head[f]) > scale
            else:
                due = due or self._changed(f, v)
        for f, v in _progress(snap).items():
            if self._off(f, v, snap.time_s, snap.kv_capacity_tokens):
                self._flagged.add(f)  # sent with the answer this asks for, whatever its floor
                due = True
            self._pace[f].last = v
        return due

    def _repace(
        self, progress: dict[str, int], t: float, head: dict[str, Any], out: dict[str, Any]
    ) -> None:
        """The running count changed (or a full delta goes with no pace known): the progress
        fields are sent as they are, with the pace they keep from here. An engine with
        nothing running takes no decode step; one that runs ``n`` trajectories takes them at
        the rate last sent while it ran (a decode step's time hardly moves with the batch
        below an engine's knee) or, before it ever ran, at its throughput over ``n`` (each
        step gives each a token), and each step adds a token to each running trajectory's KV
        (``kv``'s rate is ``n`` times ``steps``'). An engine that keeps no step counter (it
        never read above 0) keeps it at 0, and its KV grows by its throughput. What the mean
        rate since the last values would say instead is the old pace: the receiver would be
        off at once, and the next check would ask for a poll to correct it."""
        n, tps = int(head["n"]), float(head["tps"])
        if self._pace["steps"].rate:
            self._busy = self._pace["steps"].rate
        if not self._stepping:  # no step counter: it stays 0, and the KV grows by throughput
            rates = (0.0, tps if n else 0.0)
        else:
            step_rate = (self._busy or tps / n) if n else 0.0
            rates = (step_rate, n * step_rate)
        for f, rate in zip(_PROGRESS, rates, strict=True):
            pace, v = self._pace[f], progress[f]
            pace.base, pace.t0, pace.last = v, t, v
            out[f] = v
            rate = _wire_rate(rate)
            if rate != pace.rate:
                pace.rate = out[_PACE_KEY[f]] = rate

    def encode(
        self,
        snap: EngineSnapshot,
        *,
        ack: int | None = None,
        full: bool = False,
        ended: Collection[str] = (),
    ) -> dict[int, Any] | None:
        """The delta from the last one sent to ``snap`` (None: nothing changed).

        ``ack``: the counter of the last delta the receiver applied, if it applied one since
        its last request; ``full``: the receiver asks for the whole snapshot. ``ended``: ids
        whose end travels beside this delta (the receiver drops them itself)."""
        if ack is not None:
            self._acked = ack == self._k
        full = full or not self._acked  # the last delta was lost or never decoded
        self._stepping = self._stepping or snap.decode_steps > 0
        old = {} if full else self._sent
        steps, t = snap.decode_steps, snap.time_s
        cur: dict[str, tuple[int, int]] = {}
        add: dict[tuple[int, int, str | None], list[Any]] = {}  # grouped, see _split
        for r in snap.running:
            tid = r.trajectory_id
            entry = (r.prompt_tokens, r.generated_tokens - steps)
            if self._moved(old.get(tid), entry, r.generated_tokens) or tid in ended:
                prefix, item = _split(tid)
                add.setdefault((*entry, prefix), [*entry, prefix]).append(item)
            else:
                entry = old[tid]  # what the receiver holds, within the allowance
            cur[tid] = entry
        left = [t for t in old if t not in cur and t not in ended]
        head = _header(snap, len(cur))
        progress = _progress(snap)
        out: dict[str, Any]
        if full:  # the rates the sender knows go along: the receiver extrapolates at once
            out = {"full": 1, **head, **progress}
            self._pace = {f: _Pace(v, t, self._pace[f].rate) for f, v in progress.items()}
            if not self._pace["steps"].rate or head["n"] != self._head.get("n"):
                self._repace(progress, t, head, out)
            out.update({_PACE_KEY[f]: p.rate for f, p in self._pace.items() if p.rate})
        else:
            out = {f: v for f, v in head.items() if self._changed(f, v)}
            if "n" in out:  # the running count sets the pace: see _repace
                self._repace(progress, t, head, out)
            else:
                for f, v in progress.items():
                    pace = self._pace[f]
                    if f in self._flagged or self._off(f, v, t, snap.kv_capacity_tokens):
                        out[f] = v
                        was = pace.rate
                        pace.rebase(v, t)
                        if pace.rate != was:
                            out[_PACE_KEY[f]] = pace.rate
                    pace.last = v
        self._flagged.clear()
        if add:
            out["add"] = list(add.values())
        if left:
            out["left"] = pack_ids(left)
        if not out:
            return None  # nothing changed since an acknowledged delta
        self._head.update({f: head[f] for f in _HEADER if f in out})
        self._sent = cur
        self._k = secrets.randbits(30) if self._k is None else self._k + 1
        self._acked = False
        out["k"] = self._k
        return {_CODE[f]: v for f, v in out.items()}


class SnapshotDecoder:
    """Rebuilds one instance's snapshots from :class:`SnapshotEncoder` deltas."""

    __slots__ = ("_head", "_pace", "_running", "_seq", "_unacked", "instance_id", "k")

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.k: int | None = None  # counter of the last delta applied; None: ask for a full one
        self._unacked = False
        self._seq = 0
        self._head: dict[str, Any] = {}
        self._running: dict[str, tuple[int, int]] = {}
        self._pace: dict[str, _Pace] = {}

    @staticmethod
    def fields(delta: Mapping[Any, Any]) -> dict[str, Any]:
        """A delta with its fields by name (they travel as numbers): ``k``, ``full``, the
        header's, ``steps``, ``kv``, their rates ``ds``, ``dk``, ``add`` and ``left`` (ids
        packed, see :func:`pack_ids`). Raises ValueError for a field it does not know."""
        bad = [c for c in delta if not (type(c) is int and 0 <= c < len(_FIELDS))]
        if bad:
            raise ValueError(f"not snapshot delta fields: {bad} (known: 0..{len(_FIELDS) - 1})")
        return {_FIELDS[c]: v for c, v in delta.items()}

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
        self._pace = {}

    def decode(
        self, delta: Mapping[int, Any] | None, *, time_s: float, ended: Collection[str] = ()
    ) -> EngineSnapshot | None:
        """The snapshot ``delta`` describes (``None``: nothing beyond the extrapolated
        progress changed: :meth:`view`), stamped ``time_s``; None if there is no last one or
        ``delta`` does not follow it (the decoder resets, so the next request asks for a full
        one).

        ``ended``: the ids whose end came beside the delta (the poll's outcomes). Raises
        ValueError (and resets) if the rebuilt running count is not the delta's ``n``."""
        if delta is None:
            return self.view(time_s)
        try:
            named = self.fields(delta)
        except ValueError:
            self.reset()
            raise
        k = int(named["k"])
        if named.get("full"):
            running: dict[str, tuple[int, int]] = {}
            head: dict[str, Any] = {}
            paces = {
                f: _Pace(int(named[f]), time_s, float(named.get(_PACE_KEY[f], 0.0)))
                for f in _PROGRESS
                if f in named
            }
        elif self.k is not None and k == self.k + 1:
            running, head, paces = self._running, self._head, self._pace
            for f in _PROGRESS:
                if f in named:
                    paces[f].base, paces[f].t0 = int(named[f]), time_s
                if _PACE_KEY[f] in named:
                    paces[f].rate = float(named[_PACE_KEY[f]])
        else:
            self.reset()
            return None
        for tid in ended:
            running.pop(tid, None)
        for tid in unpack_ids(named.get("left", ())):
            running.pop(tid, None)
        for prompt, offset, prefix, *items in named.get("add", ()):
            for item in items:
                tid = str(item) if prefix is None else f"{prefix}/{item}"
                running.pop(tid, None)  # a resent entry moves to the end
                running[tid] = (int(prompt), int(offset))
        for f in _HEADER:
            if f in named:
                head[f] = named[f]
        missing = [f for f in _HEADER if f not in head] + [f for f in _PROGRESS if f not in paces]
        if missing or len(running) != int(head["n"]):
            self.reset()
            what = (
                f"no {missing}"
                if missing
                else f"{len(running)} running rebuilt, the instance reports n={head['n']}"
            )
            raise ValueError(f"snapshot delta from {self.instance_id!r} does not add up: {what}")
        self._seq += 1
        self._running, self._head, self._pace, self.k = running, head, paces, k
        self._unacked = True
        return self._snapshot(time_s)

    def view(self, time_s: float) -> EngineSnapshot | None:
        """The snapshot as extrapolated to ``time_s`` (the last one decoded with its progress
        fields moved on by their rates), None if there is none yet. What a ``None`` answer
        decodes to; also the view between requests."""
        if self.k is None:
            return None
        self._seq += 1
        return self._snapshot(time_s)

    def _snapshot(self, time_s: float) -> EngineSnapshot:
        h = self._head
        steps = self._pace["steps"].at(time_s)
        kv = min(max(self._pace["kv"].at(time_s), 0), int(h["kv_cap"]))
        return EngineSnapshot(
            instance_id=self.instance_id,
            seq=self._seq,
            time_s=time_s,
            version=int(h["version"]),
            running=tuple(
                RunningTrajectory(
                    trajectory_id=t, prompt_tokens=p, generated_tokens=max(steps + o, 0)
                )
                for t, (p, o) in self._running.items()
            ),
            waiting=int(h["waiting"]),
            kv_used_tokens=kv,
            kv_capacity_tokens=int(h["kv_cap"]),
            throughput_tokens_per_s=float(h["tps"]),
            decode_steps=steps,
        )
