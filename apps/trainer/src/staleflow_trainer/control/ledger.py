"""The control core's trajectory ledger: where every live trajectory is, by ids and lengths.

Theory of operation
-------------------
The ledger knows every trajectory the core submitted and has not yet *settled*: its group,
prompt and response lengths, its V_traj once admitted, and where it is —

* ``queued``: in the multi-level queue (partials by V_traj, oldest first, longer partials first
  within a level, then FIFO; then the never-routed members of groups the core *promoted*; then
  every other never-routed prompt, FIFO) — the order the coordinator's ``QueueView`` expects;
* ``running`` on one instance (routed, or a route held until the instance's sync is done);
* ``finished``: its output is complete, its reward is pending or known.

A group is *partly admitted* while the protocol has admitted some of its members and others
have never been routed. The core promotes such a group once the trainer's next batch can take
it (the rule is ``ControlCore._promote_due``'s): its never-routed members then come before
every fresh group, so the router's scan, which stops after a run of misses, cannot leave them
behind fresh groups that no buffer admits (the trainer would wait for them for ever).

A trajectory settles when it is consumed (trained) or dropped with a reason. When every member
of a group has settled, the group and its members are *retired*: forgotten, counted in
:attr:`Ledger.settled`. So the ledger's size follows what is in flight, not the run's length.

Payloads never enter the ledger. It is plain data: :meth:`to_dict` / :meth:`from_dict`.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterator, Mapping
from itertools import chain, islice
from operator import attrgetter, itemgetter
from typing import Any

from rollout_coordinator import QueuedTrajectory


class LedgerError(Exception):
    """The core asked the ledger for an impossible move (a bug in the core or its shell)."""


class Where(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    CONSUMED = "consumed"
    DROPPED = "dropped"


_SETTLED = (Where.CONSUMED, Where.DROPPED)
_TID = itemgetter(2)  # a level key's trajectory id
_ITEM = attrgetter("item")  # an entry's queued item
_ABSENT: Any = object()  # what dict.pop returns for an id the dict does not hold


class Entry:
    __slots__ = (
        "generated",
        "group",
        "instance",
        "item",
        "member",
        "prompt_len",
        "reward",
        "tid",
        "v_traj",
        "where",
    )

    def __init__(self, tid: str, group: str, member: int, prompt_len: int) -> None:
        self.tid = tid
        self.group = group
        self.member = member
        self.prompt_len = prompt_len
        self.generated = 0
        self.v_traj: int | None = None
        self.where = Where.QUEUED
        self.instance: str | None = None
        self.reward: float | None = None
        self.item: QueuedTrajectory | None = None  # its queue record, while queued

    def queued_item(self) -> QueuedTrajectory:
        self.item = QueuedTrajectory(
            trajectory_id=self.tid,
            group_id=self.group,
            v_traj=self.v_traj,
            prompt_len=self.prompt_len,
            generated_len=self.generated,
        )
        return self.item

    @property
    def tokens(self) -> int:
        return self.prompt_len + self.generated

    def to_list(self) -> list[Any]:
        return [
            self.tid,
            self.member,
            self.prompt_len,
            self.generated,
            self.v_traj,
            self.where.value,
            self.instance,
            self.reward,
        ]


class Group:
    __slots__ = ("closed", "gid", "members", "rewarded", "row", "settled")

    def __init__(self, gid: str, row: int, members: tuple[str, ...]) -> None:
        self.gid = gid
        self.row = row
        self.members = members
        self.rewarded: list[str] = []  # members whose reward is known, in arrival order
        self.settled = 0
        self.closed = False  # consumed or dropped as a group: no member may run again


class Ledger:
    """Live trajectories and groups; the multi-level queue over them."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.groups: dict[str, Group] = {}
        # never-routed queued ids, FIFO, and those of promoted groups, each with its queue
        # record (``Entry.item``: the queue view copies them in one pass)
        self._new: dict[str, QueuedTrajectory] = {}
        self._promoted: dict[str, QueuedTrajectory] = {}
        self._partly: dict[str, None] = {}  # partly admitted groups not promoted (see above)
        self.promotions = 0  # groups promoted so far
        self._levels: dict[int, list[tuple[int, int, str]]] = {}
        self._level_versions: list[int] = []
        self._key: dict[str, tuple[int, tuple[int, int, str]]] = {}
        self._seq = 0
        self._cached: list[QueuedTrajectory] | None = None  # the whole queue, until it changes
        self.held: dict[str, dict[str, None]] = {}  # instance -> ids running there
        #: retired trajectories by how they settled: consumed, dropped after admission, and
        #: dropped never admitted (a closed group's queued siblings)
        self.settled: dict[str, int] = {"consumed": 0, "dropped": 0, "unadmitted": 0}
        self.dropped_reasons: dict[str, int] = {}

    # ---- submission ----------------------------------------------------------------------

    def add_group(self, gid: str, row: int, members: int, prompt_len: int) -> tuple[str, ...]:
        if gid in self.groups:
            raise LedgerError(f"group {gid!r} exists")
        self._cached = None
        ids = tuple(f"{gid}/{m}" for m in range(members))
        self.groups[gid] = Group(gid, row, ids)
        for m, tid in enumerate(ids):
            e = self.entries[tid] = Entry(tid, gid, m, prompt_len)
            self._new[tid] = e.queued_item()
        return ids

    # ---- the queue -----------------------------------------------------------------------

    @property
    def new_queued(self) -> int:
        return len(self._promoted) + len(self._new)

    @property
    def partials_queued(self) -> int:
        return len(self._key)

    def level_counts(self) -> dict[str, int]:
        out = {str(v): len(self._levels[v]) for v in self._level_versions}
        out["new"] = len(self._promoted) + len(self._new)
        return out

    def queue_items(self, limit: int | None = None) -> list[QueuedTrajectory]:
        """The queue in service order, at most ``limit`` items (None: all)."""
        if limit is None and self._cached is not None:
            return self._cached
        entries = self.entries
        out: list[QueuedTrajectory] = []
        for v in self._level_versions:
            out.extend(map(_ITEM, map(entries.__getitem__, map(_TID, self._levels[v]))))
            if limit is not None and len(out) >= limit:
                return out[:limit]
        if limit is None:
            out.extend(self._promoted.values())
            out.extend(self._new.values())
            self._cached = out
            return out
        out.extend(islice(chain(self._promoted.values(), self._new.values()), limit - len(out)))
        return out

    def partly_admitted(self) -> list[str]:
        """The partly admitted groups not promoted yet (see the module docstring)."""
        for gid in list(self._partly):
            g = self.groups.get(gid)
            if g is None or not any(t in self._new for t in g.members):
                del self._partly[gid]
        return list(self._partly)

    def promote(self, gid: str) -> None:
        """Serve the never-routed members of ``gid`` before every fresh group."""
        self._partly.pop(gid, None)
        g = self.groups.get(gid)
        if g is None:
            return
        self.promotions += 1
        for t in g.members:
            item = self._new.pop(t, _ABSENT)
            if item is not _ABSENT:
                self._promoted[t] = item
                self._cached = None

    def _unqueue(self, tid: str) -> None:
        self._cached = None
        if (
            self._new.pop(tid, _ABSENT) is not _ABSENT
            or self._promoted.pop(tid, _ABSENT) is not _ABSENT
        ):
            return
        v, key = self._key.pop(tid)
        bucket = self._levels[v]
        del bucket[bisect.bisect_left(bucket, key)]
        if not bucket:
            del self._levels[v]
            self._level_versions.remove(v)

    def _enqueue(self, e: Entry) -> None:
        self._cached = None
        e.where = Where.QUEUED
        e.instance = None
        item = e.queued_item()
        if e.v_traj is None:  # never admitted (a reserved-but-unrouted one has its V_traj)
            self._new[e.tid] = item
            if self._admitted(e.group):
                self._partly[e.group] = None
            return
        self._seq += 1
        key = (-e.generated, self._seq, e.tid)
        bucket = self._levels.get(e.v_traj)
        if bucket is None:
            bucket = self._levels[e.v_traj] = []
            bisect.insort(self._level_versions, e.v_traj)
        bisect.insort(bucket, key)
        self._key[e.tid] = (e.v_traj, key)

    # ---- moves ---------------------------------------------------------------------------

    def get(self, tid: str) -> Entry | None:
        return self.entries.get(tid)

    def _expect(self, tid: str, *where: Where) -> Entry:
        e = self.entries.get(tid)
        if e is None:
            raise LedgerError(f"unknown trajectory {tid!r}")
        if e.where not in where:
            raise LedgerError(f"{tid!r} is {e.where.value}, expected {[w.value for w in where]}")
        return e

    def run(self, tid: str, instance: str, v_traj: int) -> Entry:
        """Routed (or held for a sync) to ``instance``; binds V_traj at the first route."""
        e = self._expect(tid, Where.QUEUED)
        self._unqueue(tid)
        if e.v_traj is None:
            e.v_traj = v_traj
            self._partly.setdefault(e.group, None)  # dropped later if no sibling waits
        e.where = Where.RUNNING
        e.instance = instance
        self.held.setdefault(instance, {})[tid] = None
        return e

    def requeue(self, tid: str, generated: int | None = None) -> Entry:
        """Back in the queue from an instance (interrupted, preempted, refused, lost)."""
        e = self._expect(tid, Where.RUNNING)
        self._off_instance(e)
        if generated is not None:
            e.generated = generated
        self._enqueue(e)
        return e

    def _admitted(self, gid: str) -> bool:
        return any(self.entries[t].v_traj is not None for t in self.groups[gid].members)

    def set_v_traj(self, tid: str, v_traj: int) -> None:
        """A queued new prompt the protocol reserved but no instance will run (its route was
        held for a sync that failed): it keeps that V_traj and queues as a partial."""
        e = self._expect(tid, Where.QUEUED)
        self._unqueue(tid)
        e.v_traj = v_traj
        self._partly.setdefault(e.group, None)
        self._enqueue(e)

    def finish(self, tid: str, generated: int) -> Entry:
        e = self._expect(tid, Where.RUNNING)
        self._off_instance(e)
        e.generated = generated
        e.where = Where.FINISHED
        return e

    def reward(self, tid: str, score: float) -> Group:
        e = self._expect(tid, Where.FINISHED)
        e.reward = score
        g = self.groups[e.group]
        g.rewarded.append(tid)
        return g

    def consume(self, tid: str) -> Entry:
        e = self._expect(tid, Where.FINISHED)
        e.where = Where.CONSUMED
        self._settle(e)
        return e

    def drop(self, tid: str, reason: str) -> Entry | None:
        """Settle ``tid`` as dropped from wherever it is; None if it already settled."""
        e = self.entries.get(tid)
        if e is None or e.where in _SETTLED:
            return None
        if e.where is Where.QUEUED:
            self._unqueue(tid)
        elif e.where is Where.RUNNING:
            self._off_instance(e)
        e.where = Where.DROPPED
        self.dropped_reasons[reason] = self.dropped_reasons.get(reason, 0) + 1
        self._settle(e)
        return e

    def close_group(self, gid: str) -> None:
        g = self.groups.get(gid)
        if g is not None:
            g.closed = True

    def _off_instance(self, e: Entry) -> None:
        if e.instance is not None:
            self.held.get(e.instance, {}).pop(e.tid, None)
        e.instance = None

    def _settle(self, e: Entry) -> None:
        g = self.groups[e.group]
        g.settled += 1
        if g.settled == len(g.members):
            for tid in g.members:
                gone = self.entries.pop(tid)
                kind = gone.where.value if gone.v_traj is not None else "unadmitted"
                self.settled[kind] += 1
            del self.groups[g.gid]

    # ---- queries -------------------------------------------------------------------------

    def held_by(self, instance: str) -> list[str]:
        return list(self.held.get(instance, ()))

    def forget_instance(self, instance: str) -> None:
        self.held.pop(instance, None)

    def live(self) -> Iterator[Entry]:
        return iter(self.entries.values())

    def counts(self) -> dict[str, int]:
        """Live trajectories by place, plus the settled totals (retired groups included)."""
        out = {w.value: 0 for w in Where}
        out["unadmitted"] = self.settled["unadmitted"]
        for e in self.entries.values():
            if e.where is Where.DROPPED and e.v_traj is None:
                out["unadmitted"] += 1
            else:
                out[e.where.value] += 1
        out["consumed"] += self.settled["consumed"]
        out["dropped"] += self.settled["dropped"]
        return out

    # ---- state ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "groups": [
                [g.gid, g.row, list(g.members), list(g.rewarded), g.closed]
                for g in self.groups.values()
            ],
            "entries": [e.to_list() for e in self.entries.values()],
            # the queue's order: never-routed prompts in service order (the promoted ones,
            # listed again under "promoted", first), partials by their keys
            "new": [*self._promoted, *self._new],
            "promoted": list(self._promoted),
            "partly": list(self._partly),  # in order: it decides the order of promotions
            "promotions": self.promotions,
            "keys": {tid: [v, list(k)] for tid, (v, k) in self._key.items()},
            "seq": self._seq,
            "held": {iid: list(ids) for iid, ids in self.held.items()},
            "settled": dict(self.settled),
            "dropped_reasons": dict(self.dropped_reasons),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Ledger:
        led = cls()
        for gid, row, members, rewarded, closed in d["groups"]:
            g = Group(str(gid), int(row), tuple(str(m) for m in members))
            g.rewarded = [str(t) for t in rewarded]
            g.closed = bool(closed)
            led.groups[g.gid] = g
        for tid, member, prompt_len, generated, v_traj, where, instance, reward in d["entries"]:
            gid = str(tid).rsplit("/", 1)[0]
            e = Entry(str(tid), gid, int(member), int(prompt_len))
            e.generated = int(generated)
            e.v_traj = None if v_traj is None else int(v_traj)
            e.where = Where(where)
            e.instance = instance
            e.reward = None if reward is None else float(reward)
            led.entries[e.tid] = e
            if e.where is Where.QUEUED:
                e.queued_item()
            if e.where in _SETTLED:
                led.groups[gid].settled += 1
        promoted = set(d.get("promoted", ()))
        for tid in d["new"]:
            queued = led.entries.get(str(tid))
            if queued is None:
                what = "not in the entries"
            elif queued.item is None:
                what = "not queued"
            elif queued.v_traj is not None:
                what = f"admitted at version {queued.v_traj} (a partial, queued by its key)"
            else:
                (led._promoted if tid in promoted else led._new)[str(tid)] = queued.item
                continue
            raise LedgerError(f"the saved queue lists {tid!r} as never routed, but it is {what}")
        led.promotions = int(d.get("promotions", 0))
        if "partly" in d:
            led._partly = dict.fromkeys(str(g) for g in d["partly"])
        else:  # a state saved before promotion existed: rebuilt from the entries
            for gid, g in led.groups.items():
                if any(t in led._new for t in g.members) and led._admitted(gid):
                    led._partly[gid] = None
        for tid, (v, key) in d["keys"].items():
            k = (int(key[0]), int(key[1]), str(key[2]))
            led._key[str(tid)] = (int(v), k)
            bucket = led._levels.get(int(v))
            if bucket is None:
                bucket = led._levels[int(v)] = []
                bisect.insort(led._level_versions, int(v))
            bisect.insort(bucket, k)
        led._seq = int(d["seq"])
        led.held = {str(i): dict.fromkeys(str(t) for t in ids) for i, ids in d["held"].items()}
        led.settled = {str(k): int(v) for k, v in d["settled"].items()}
        led.dropped_reasons = {str(k): int(v) for k, v in d["dropped_reasons"].items()}
        return led
