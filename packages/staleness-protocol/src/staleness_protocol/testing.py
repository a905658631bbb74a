"""Helpers for testing code that embeds the protocol.

- ``check_invariants(p)``: raise ``InvariantViolation`` (an AssertionError) if the protocol's
  state breaks any rule (bound, capacities, nothing lost, retirement, internal consistency).
  Cheap enough to call after every step of a test; it reads only ``to_dict()`` and ``stats()``.
- ``layout(p)``: ``{buffer: (occupied group ids, reserved group ids)}`` for whole-state asserts.
- ``ReferenceModel``: a deliberately naive model of the same rules over explicit slot arrays
  (no counters, no shortcuts, full history). Drive it beside a ``StalenessProtocol`` and
  compare placements, notices and what should be live or tombstoned, or use it as a stand-in
  when you want an obviously-correct oracle.
"""

from __future__ import annotations

from typing import Any

from ._config import ProtocolConfig
from ._protocol import StalenessProtocol
from ._records import AbortReason

Id = str | int

_LIVE_T = ("in_flight", "finished", "occupied")


class InvariantViolation(AssertionError):
    """A protocol invariant does not hold."""


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise InvariantViolation(message)


def layout(p: StalenessProtocol) -> dict[int, tuple[list[Id], list[Id]]]:
    """Every live buffer's (occupied, reserved) group ids, in slot order."""
    return {b["version"]: (b["occupied"], b["reserved"]) for b in p.to_dict()["buffers"]}


def check_invariants(p: StalenessProtocol) -> None:
    """Raise InvariantViolation unless every protocol invariant holds."""
    d = p.to_dict()
    cfg = p.config
    eta = cfg.eta
    c = d["next_buffer"]
    published = d["published_version"]
    _require(0 <= published <= c, f"published_version {published} outside [0, {c}]")
    need, slots = cfg.batch_size, cfg.slots_per_buffer
    groups = {g[0]: g for g in d["groups"]}
    trajs = {t[0]: t for t in d["trajectories"]}
    _require(len(groups) == len(d["groups"]), "duplicate group ids")
    _require(len(trajs) == len(d["trajectories"]), "duplicate trajectory ids")
    where: dict[Id, tuple[int, str]] = {}
    for buf in d["buffers"]:
        b = buf["version"]
        _require(c <= b <= c + eta, f"buffer {b} outside [{c}, {c + eta}]")
        occ, res = buf["occupied"], buf["reserved"]
        _require(len(occ) <= need, f"buffer {b}: {len(occ)} occupied > batch_size {need}")
        _require(len(occ) + len(res) <= slots, f"buffer {b}: {len(occ) + len(res)} > {slots} slots")
        _require(
            not (len(occ) >= need and res), f"buffer {b} is READY but still holds reservations"
        )
        for gid, kind in [(g, "occupied") for g in occ] + [(g, "reserved") for g in res]:
            _require(gid not in where, f"group {gid!r} sits in two slots")
            where[gid] = (b, kind)
    floor = p.abort_floor
    for gid, state, buffer, members, finished in d["groups"]:
        _require(state in ("reserved", "occupied"), f"group {gid!r} is {state} in the live ledger")
        _require(
            where.get(gid) == (buffer, state), f"group {gid!r} ({state}) not in buffer {buffer}"
        )
        _require(len(members) <= cfg.samples_per_group, f"group {gid!r} has too many members")
        if state == "reserved":
            _require(len(finished) < cfg.group_size, f"complete group {gid!r} still reserved")
        else:
            _require(len(finished) == cfg.group_size, f"group {gid!r} placed without n members")
        _require(set(finished) <= set(members), f"group {gid!r}: a finished one is no member")
        for tid in members:
            t = trajs.get(tid)
            _require(t is not None and t[1] == gid, f"group {gid!r} member {tid!r} not in ledger")
    _require(set(where) == set(groups), "a buffer slot holds a group the ledger does not")
    for tid, gid, version, state in d["trajectories"]:
        g = groups.get(gid)
        _require(g is not None, f"trajectory {tid!r} names no live group {gid!r}")
        assert g is not None
        _require(state in _LIVE_T, f"trajectory {tid!r} is {state} in the live ledger")
        _require(tid in g[3], f"live trajectory {tid!r} missing from group {gid!r}")
        _require(0 <= version <= published, f"trajectory {tid!r} at unpublished V={version}")
        if state in ("in_flight", "finished"):
            _require(g[1] == "reserved", f"{state} trajectory {tid!r} in a {g[1]} group")
            _require(
                version <= g[2] <= version + eta,
                f"trajectory {tid!r} (V={version}) reserved in buffer {g[2]} beyond the bound",
            )
        if state == "in_flight":
            _require(
                version > floor, f"in-flight trajectory {tid!r} at V={version} <= floor {floor}"
            )
        if state == "occupied":
            _require(g[1] == "occupied", f"occupied trajectory {tid!r} in a {g[1]} group")
            _require(
                version <= g[2] <= version + eta,
                f"trajectory {tid!r} (V={version}) placed in buffer {g[2]}: staleness > eta",
            )
    last = None
    for row in d["tombstones"]:
        stamp, key = row[-1], row[1]
        low = c - cfg.tombstone_versions - 1  # expiry runs at publish: one consume may lead
        _require(low <= stamp <= c, f"tombstone {key!r} stamp {stamp}")
        _require(last is None or last <= stamp, "tombstones out of order")
        last = stamp
        if row[0] == "group":
            _require(key not in groups, f"group {key!r} is both live and a tombstone")
            _require(row[2] in ("consumed", "dropped", "aborted"), f"tombstone {key!r}: {row[2]}")
            _require(row[2] == "consumed" or bool(row[3]), f"group {key!r} ended without reason")
        else:
            _require(key not in trajs, f"trajectory {key!r} is both live and a tombstone")
            _require(row[4] in ("dropped", "aborted") and bool(row[5]), f"tombstone {key!r}")
    for s, _n in d["staleness_histogram"]:
        _require(0 <= s <= eta, f"a consumed trajectory had staleness {s} > eta {eta}")
    stats = p.stats()
    counted = dict.fromkeys(_LIVE_T, 0)
    for t in d["trajectories"]:
        counted[t[3]] += 1
    for state_name in _LIVE_T:
        n = stats.trajectories_by_state[state_name]
        _require(counted[state_name] == n, f"state counter {state_name}={n} is wrong")
    for state_name, n in d["ended"]["trajectories"].items():
        _require(stats.trajectories_by_state[state_name] == n, f"ended {state_name} counter")
    consumed = sum(n for _s, n in d["staleness_histogram"])
    _require(consumed == stats.trajectories_by_state["consumed"], "histogram != consumed count")


class ReferenceModel:
    """A naive, slot-array model of Reserve / Occupy / Consume and every optional mechanism.

    Mirrors ``StalenessProtocol`` for legal calls: ``reserve`` returns the buffer or None
    (inadmissible); ``finish`` returns the occupied buffer, None (waiting) or
    ``"already_ended"``; ``consume`` returns the consumed group ids. It keeps the whole
    history: ``notices`` lists every notice the protocol must emit, as tuples
    (``("abort", tid, reason, was_running)``, ``("group_aborted", gid, reason)``,
    ``("replacement", gid, reason)``), and ``live_ids`` / ``tombstone_ids`` say what the
    protocol's ledger must hold after retirement. It raises AssertionError on illegal calls
    instead of typed errors.
    """

    def __init__(self, config: ProtocolConfig, start_version: int = 0) -> None:
        self.config = config
        self.version = start_version  # next_buffer
        self.published = start_version
        self.top = start_version - 1
        # slot arrays: None (EMPTY), ("R", gid) or ("O", gid)
        self.slots: dict[int, list[tuple[str, Id] | None]] = {}
        self.groups: dict[Id, dict[str, Any]] = {}
        self.trajs: dict[Id, dict[str, Any]] = {}
        self.notices: list[tuple[Any, ...]] = []
        self.forgotten_below = start_version - config.tombstone_versions  # expiry limit

    # -- slot helpers
    def _count(self, b: int, kind: str) -> int:
        return sum(1 for s in self.slots.get(b, []) if s is not None and s[0] == kind)

    def _ready(self, b: int) -> bool:
        return self._count(b, "O") >= self.config.batch_size

    def _has_room(self, b: int) -> bool:
        if b not in self.slots:
            return True
        return not self._ready(b) and any(s is None for s in self.slots[b])

    def _create_upto(self, b: int) -> None:
        while self.top < b:
            self.top += 1
            self.slots[self.top] = [None] * self.config.slots_per_buffer

    def _remove(self, b: int, gid: Id) -> None:
        arr = self.slots[b]
        i = arr.index(next(s for s in arr if s is not None and s[1] == gid))
        was_reserved = arr[i] is not None and arr[i][0] == "R"  # type: ignore[index]
        arr[i] = None
        if was_reserved:  # compaction: pull the front-most reservation into the hole
            front = next((j for j, s in enumerate(arr) if s is not None and s[0] == "R"), None)
            if front is not None and front < i:
                arr[i], arr[front] = arr[front], None
        else:  # keep occupied slots contiguous at the front
            occ: list[tuple[str, Id] | None] = [s for s in arr if s is not None and s[0] == "O"]
            res: list[tuple[str, Id] | None] = [s for s in arr if s is not None and s[0] == "R"]
            arr[:] = occ + [None] * (len(arr) - len(occ) - len(res)) + res

    def floor(self) -> int:
        u = self.version - self.config.eta - 1
        while u + self.config.eta + 1 <= self.version + self.config.eta and self._ready(
            u + self.config.eta + 1
        ):
            u += 1
        return u

    # -- the rules
    def admission(self, gid: Id, v: int) -> str:
        """What ``can_reserve(gid, v)`` must answer (an ``Admission`` value)."""
        g = self.groups.get(gid)
        if g is None:
            if any(self._has_room(b) for b in range(v + self.config.eta, self.version - 1, -1)):
                return "admit"
            return "sync" if v <= self.floor() else "wait"
        if g["state"] != "reserved" or len(g["members"]) >= self.config.samples_per_group:
            return "discard"
        return "sync" if v + self.config.eta < g["buffer"] else "admit"

    def publish(self, version: int) -> None:
        assert version == self.published + 1 <= self.version
        self.published = version
        self.forgotten_below = self.version - self.config.tombstone_versions

    def reserve(self, gid: Id, tid: Id, v: int) -> int | None:
        eta = self.config.eta
        assert tid not in self.trajs and 0 <= v <= self.published
        g = self.groups.get(gid)
        if g is None:
            for b in range(v + eta, self.version - 1, -1):
                if self._has_room(b):
                    self._create_upto(b)
                    arr = self.slots[b]
                    j = max(i for i, s in enumerate(arr) if s is None)  # back-filled
                    arr[j] = ("R", gid)
                    self.groups[gid] = {
                        "state": "reserved",
                        "buffer": b,
                        "members": [],
                        "finished": [],
                    }
                    g = self.groups[gid]
                    break
            else:
                return None
        else:
            if g["state"] != "reserved" or len(g["members"]) >= self.config.samples_per_group:
                return None
            if v + eta < g["buffer"]:
                return None
        g["members"].append(tid)
        self.trajs[tid] = {"group": gid, "version": v, "state": "in_flight"}
        return int(g["buffer"])

    def finish(self, tid: Id) -> int | str | None:
        t = self.trajs[tid]
        if t["state"] in ("aborted", "dropped"):
            assert t["was_running"]
            return "already_ended"
        assert t["state"] == "in_flight"
        t["state"] = "finished"
        g = self.groups[t["group"]]
        g["finished"].append(tid)
        if len(g["finished"]) < self.config.group_size:
            return None
        for m in list(g["members"]):
            if self.trajs[m]["state"] == "in_flight":
                self._end(m, AbortReason.GROUP_SURPLUS.value, "aborted")
                g["members"].remove(m)
        self._remove(g["buffer"], t["group"])
        vmin = min(self.trajs[m]["version"] for m in g["finished"])
        for b in range(self.version, vmin + self.config.eta + 1):
            if b in self.slots and self._has_room(b):
                arr = self.slots[b]
                arr[arr.index(None)] = ("O", t["group"])  # front-filled
                break
        else:
            raise AssertionError("a finished group found no buffer: the protocol is broken")
        g["state"], g["buffer"] = "occupied", b
        for m in g["finished"]:
            self.trajs[m]["state"] = "occupied"
        if self._ready(b):
            floor = self.floor()
            for s in list(self.slots[b]):
                if s is not None and s[0] == "R":
                    sg = self.groups[s[1]]
                    vm = min((self.trajs[m]["version"] for m in sg["members"]), default=None)
                    stale = vm is not None and vm <= floor
                    reason = AbortReason.STALE if stale else AbortReason.BATCH_SURPLUS
                    self._close(s[1], "aborted", reason.value, by_protocol=True)
        return b

    def _end(self, tid: Id, reason: str, state: str, *, notify: bool = True) -> None:
        t = self.trajs[tid]
        was_running = t["state"] == "in_flight"
        t.update(state=state, reason=reason, was_running=was_running, ended_at=self.version)
        if notify:
            self.notices.append(("abort", tid, reason, was_running))

    def _close(self, gid: Id, state: str, reason: str, *, by_protocol: bool) -> None:
        g = self.groups[gid]
        self._remove(g["buffer"], gid)
        for m in g["members"]:
            self._end(m, reason, "aborted" if state == "aborted" else "dropped")
        g.update(state=state, buffer=None, members=[], finished=[], ended_at=self.version)
        if by_protocol:
            self.notices.append(("group_aborted", gid, reason))

    def abort(self, tid: Id) -> bool:
        t = self.trajs[tid]
        if t["state"] in ("aborted", "dropped"):
            assert t["was_running"]
            return False
        assert t["state"] == "in_flight"
        self._end(tid, "interrupted for good", "aborted", notify=False)
        self.groups[t["group"]]["members"].remove(tid)
        return True

    def drop_group(self, gid: Id, reason: str) -> bool:
        state = self.groups[gid]["state"]
        if state == "aborted":
            return False
        assert state in ("reserved", "occupied")
        self._close(gid, "dropped", reason, by_protocol=False)
        if self.config.filtering:
            self.notices.append(("replacement", gid, reason))
        return True

    def consume(self) -> list[Id]:
        assert self._ready(self.version)
        gids = [s[1] for s in self.slots.pop(self.version) if s is not None and s[0] == "O"]
        self.version += 1
        if self.version - self.published > 1:  # not publishing: consume expires instead
            self.forgotten_below = self.version - self.config.tombstone_versions
        self.top = max(self.top, self.version - 1)
        for gid in gids:
            self.groups[gid].update(state="consumed", ended_at=self.version)
            for m in self.groups[gid]["finished"]:
                self.trajs[m]["state"] = "consumed"
        return gids

    def resolve_stuck(self) -> bool:
        threshold = self.config.stuck_threshold
        assert threshold is not None
        c = self.version
        if c not in self.slots or self._ready(c):
            return False
        missing = self.config.batch_size - self._count(c, "O")
        later = [
            s[1]
            for b in range(c + 1, self.top + 1)
            for s in self.slots[b]
            if s is not None and s[0] == "O"
        ]
        if missing > threshold or len(later) < missing:
            return False
        for s in list(self.slots[c]):
            if s is not None and s[0] == "R":
                self._close(s[1], "aborted", AbortReason.STUCK.value, by_protocol=True)
                self.notices.append(("replacement", s[1], AbortReason.STUCK.value))
        for gid in later[:missing]:
            g = self.groups[gid]
            self._remove(g["buffer"], gid)
            arr = self.slots[c]
            arr[arr.index(None)] = ("O", gid)
            g["buffer"] = c
        return True

    # -- what the protocol's ledger must hold
    def layout(self) -> dict[int, tuple[set[Id], set[Id]]]:
        """Per buffer: (occupied group ids, reserved group ids), as sets."""
        out: dict[int, tuple[set[Id], set[Id]]] = {}
        for b in range(self.version, self.top + 1):
            arr = self.slots[b]
            out[b] = (
                {s[1] for s in arr if s is not None and s[0] == "O"},
                {s[1] for s in arr if s is not None and s[0] == "R"},
            )
        return out

    def states(self) -> dict[Id, str]:
        """Every trajectory ever reserved -> its state (the full history)."""
        return {tid: t["state"] for tid, t in self.trajs.items()}

    def live_ids(self) -> dict[Id, str]:
        """Live trajectories (in flight, finished, occupied) -> state."""
        return {tid: s for tid, s in self.states().items() if s in _LIVE_T}

    def _kept(self, entry: dict[str, Any]) -> bool:
        return "ended_at" in entry and entry["ended_at"] >= self.forgotten_below

    def tombstone_ids(self) -> tuple[set[Id], set[Id]]:
        """(trajectory ids, group ids) the protocol must still recognise: aborted or dropped
        trajectories and closed groups that ended within the last ``tombstone_versions``
        (counted at the last publish, or consume when versions are not being published)."""
        trajs = {
            tid
            for tid, t in self.trajs.items()
            if t["state"] in ("aborted", "dropped") and self._kept(t)
        }
        groups = {
            gid
            for gid, g in self.groups.items()
            if g["state"] in ("consumed", "dropped", "aborted") and self._kept(g)
        }
        return trajs, groups


__all__ = ["InvariantViolation", "ReferenceModel", "check_invariants", "layout"]
