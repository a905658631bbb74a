"""Coordinator-side input records: instance snapshots and the trajectory-server queue view.

These mirror the engine contract (``engine_adapters.EngineSnapshot``) without importing it, so
the coordinator depends on nothing but the protocol. :meth:`InstanceSnapshot.from_engine`
converts any object with the engine snapshot's attributes.

Validation is done once, at construction, with a plain loop (snapshots arrive 128 at a time,
every 100 ms), and raises :class:`InvalidSnapshot` naming the field.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from itertools import chain, groupby, repeat
from operator import add, attrgetter
from typing import Any, NamedTuple, overload

import attrs

from rollout_coordinator.errors import InvalidSnapshot


class RunningEntry(NamedTuple):
    """One trajectory running on an instance.

    ``v_traj`` is optional: the app may fill it from the trajectory server; when absent the
    coordinator uses the version it bound when it routed the trajectory.

    A named tuple (typed, immutable, compared by value): every snapshot lists one per running
    trajectory, and a tuple is the cheapest record to build.
    """

    trajectory_id: str
    prompt_tokens: int
    generated_tokens: int
    v_traj: int | None = None

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens


_TRAJECTORY_ID = attrgetter("trajectory_id")
_GROUP_ID = attrgetter("group_id")
_PROMPT = attrgetter("prompt_tokens")
_GENERATED = attrgetter("generated_tokens")
#: What a rejected queue record names as the snapshot's source (the queue view is the
#: trajectory server's, not an instance's)
QUEUE_SOURCE = "<trajectory-server>"


def _running_tuple(value: Iterable[RunningEntry]) -> tuple[RunningEntry, ...]:
    return value if isinstance(value, tuple) else tuple(value)


#: A ``(trajectory_id, prompt_tokens, generated_tokens, v_traj)`` row as a ``RunningEntry``,
#: built in C
_as_entry: Callable[[tuple[str, int, int, None]], RunningEntry] = partial(
    tuple.__new__, RunningEntry
)


class RunningRows(Sequence[RunningEntry]):
    """An instance's running list kept as columns: trajectory ids, prompt tokens, and generated
    tokens less a common ``offset`` (each trajectory's count is its column value + ``offset``),
    then ``tail`` (entries listed after them). The :class:`RunningEntry` records are built on
    first access to an element, once; ``len`` and :attr:`trajectory_ids` build none.

    For a producer that lists every running trajectory at every snapshot while the coordinator
    often reads only the count (the simulator: its even-routed and baseline policies look at
    the entries only when an instance syncs). It compares and hashes as the tuple of its
    entries. The columns are held, not copied: pass tuples, or anything that does not change
    afterwards; they must be of equal length."""

    __slots__ = ("_entries", "_generated", "_ids", "_offset", "_prompts", "_tail")

    def __init__(
        self,
        trajectory_ids: Sequence[str],
        prompt_tokens: Sequence[int],
        generated_tokens: Sequence[int],
        offset: int = 0,
        tail: tuple[RunningEntry, ...] = (),
    ) -> None:
        self._ids = trajectory_ids
        self._prompts = prompt_tokens
        self._generated = generated_tokens
        self._offset = offset
        self._tail = tail
        self._entries: tuple[RunningEntry, ...] | None = None

    @property
    def entries(self) -> tuple[RunningEntry, ...]:
        """The entries as a tuple (built on first use)."""
        got = self._entries
        if got is None:
            gen: Iterable[int] = self._generated
            if self._offset:
                gen = map(add, gen, repeat(self._offset))
            rows = map(_as_entry, zip(self._ids, self._prompts, gen, repeat(None)))
            got = self._entries = (*rows, *self._tail)
        return got

    @property
    def trajectory_ids(self) -> Iterable[str]:
        """The running trajectories' ids, in order, without building the entries."""
        return chain(self._ids, map(_TRAJECTORY_ID, self._tail))

    def __len__(self) -> int:
        return len(self._ids) + len(self._tail)

    @overload
    def __getitem__(self, i: int) -> RunningEntry: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[RunningEntry, ...]: ...
    def __getitem__(self, i: int | slice) -> RunningEntry | tuple[RunningEntry, ...]:
        return self.entries[i]

    def __iter__(self) -> Iterator[RunningEntry]:
        return iter(self.entries)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RunningRows):
            return self.entries == other.entries
        if isinstance(other, tuple):
            return self.entries == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.entries)

    def __repr__(self) -> str:
        return f"RunningRows({self.entries!r})"


def running_ids(running: Sequence[RunningEntry]) -> Iterable[str]:
    """The trajectory ids of a snapshot's running list (of :class:`RunningRows`, without
    building its entries)."""
    if isinstance(running, RunningRows):
        return running.trajectory_ids
    return map(_TRAJECTORY_ID, running)


@attrs.frozen(kw_only=True, slots=True)
class InstanceSnapshot:
    """The five facts an instance reports (version, running, waiting, KV, throughput) + seq + time."""

    instance_id: str
    seq: int
    time_s: float
    version: int
    #: a tuple, except from :meth:`unchecked` (which may pass :class:`RunningRows`)
    running: Sequence[RunningEntry] = attrs.field(default=(), converter=_running_tuple)
    waiting: int = 0
    kv_used_tokens: int = 0
    kv_capacity_tokens: int
    throughput_tokens_per_s: float = 0.0

    def __attrs_post_init__(self) -> None:
        iid = self.instance_id
        if not isinstance(iid, str) or not iid:
            raise InvalidSnapshot(
                "instance_id must be a non-empty string", instance_id=str(iid), field="instance_id"
            )
        for name in ("seq", "version", "waiting", "kv_used_tokens"):
            value = getattr(self, name)
            if value < 0:
                raise InvalidSnapshot(
                    f"{name} must be >= 0, got {value!r}", instance_id=iid, field=name
                )
        if self.kv_capacity_tokens <= 0:
            raise InvalidSnapshot(
                f"kv_capacity_tokens must be > 0, got {self.kv_capacity_tokens!r}",
                instance_id=iid,
                field="kv_capacity_tokens",
            )
        if self.kv_used_tokens > self.kv_capacity_tokens:
            raise InvalidSnapshot(
                f"kv_used_tokens={self.kv_used_tokens} exceeds kv_capacity_tokens="
                f"{self.kv_capacity_tokens}",
                instance_id=iid,
                field="kv_used_tokens",
            )
        if not self.throughput_tokens_per_s >= 0.0:  # also rejects NaN
            raise InvalidSnapshot(
                f"throughput_tokens_per_s must be >= 0, got {self.throughput_tokens_per_s!r}",
                instance_id=iid,
                field="throughput_tokens_per_s",
            )
        if not self.time_s >= 0.0:
            raise InvalidSnapshot(
                f"time_s must be >= 0, got {self.time_s!r}", instance_id=iid, field="time_s"
            )
        running = self.running
        if not running:
            return
        # the checks below run in C (every snapshot lists every running trajectory)
        if min(map(_PROMPT, running)) < 0 or min(map(_GENERATED, running)) < 0:
            entry = next(e for e in running if e.prompt_tokens < 0 or e.generated_tokens < 0)
            raise InvalidSnapshot(
                f"running trajectory {entry.trajectory_id!r} has negative token counts "
                f"({entry.prompt_tokens}, {entry.generated_tokens})",
                instance_id=iid,
                field="running",
            )
        if len(set(map(_TRAJECTORY_ID, running))) != len(running):
            raise InvalidSnapshot(
                "running lists a trajectory id more than once", instance_id=iid, field="running"
            )

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens

    @classmethod
    def unchecked(
        cls,
        instance_id: str,
        seq: int,
        time_s: float,
        version: int,
        running: Sequence[RunningEntry],
        waiting: int,
        kv_used_tokens: int,
        kv_capacity_tokens: int,
        throughput_tokens_per_s: float,
    ) -> InstanceSnapshot:
        """The snapshot these fields make, built without the checks of construction: only for
        a producer whose values meet them by construction (the simulator's engine, whose
        running ids are the keys of one dict and whose counts are never negative; it lists
        every running trajectory at every cycle, which the checks would walk three times).
        ``running`` may be a tuple or :class:`RunningRows` (its entries built only when read).
        Every engine adapter and every peer builds the class itself and is checked."""
        snap = object.__new__(cls)
        put = object.__setattr__
        put(snap, "instance_id", instance_id)
        put(snap, "seq", seq)
        put(snap, "time_s", time_s)
        put(snap, "version", version)
        put(snap, "running", running)
        put(snap, "waiting", waiting)
        put(snap, "kv_used_tokens", kv_used_tokens)
        put(snap, "kv_capacity_tokens", kv_capacity_tokens)
        put(snap, "throughput_tokens_per_s", throughput_tokens_per_s)
        return snap

    @classmethod
    def from_engine(cls, snap: Any) -> InstanceSnapshot:
        """Convert an ``engine_adapters.EngineSnapshot`` (or anything shaped like one)."""
        if isinstance(snap, InstanceSnapshot):
            return snap
        running = tuple(
            [
                RunningEntry(
                    r.trajectory_id, r.prompt_tokens, r.generated_tokens, getattr(r, "v_traj", None)
                )
                for r in snap.running
            ]
        )
        return cls(
            instance_id=snap.instance_id,
            seq=snap.seq,
            time_s=snap.time_s,
            version=snap.version,
            running=running,
            waiting=snap.waiting,
            kv_used_tokens=snap.kv_used_tokens,
            kv_capacity_tokens=snap.kv_capacity_tokens,
            throughput_tokens_per_s=snap.throughput_tokens_per_s,
        )


@attrs.frozen(kw_only=True, slots=True)
class QueuedTrajectory:
    """A trajectory waiting in the trajectory server: a new prompt (``v_traj`` None) or a partial."""

    trajectory_id: str
    group_id: str
    v_traj: int | None
    prompt_len: int
    generated_len: int = 0

    def __attrs_post_init__(self) -> None:
        # the checks of :meth:`_reject` as one test (one record per queued trajectory)
        p, g, v = self.prompt_len, self.generated_len, self.v_traj
        if not (
            type(p) is int
            and p >= 0
            and type(g) is int
            and g >= 0
            and (v is None or (type(v) is int and v >= 0))
            and isinstance(self.trajectory_id, str)
            and self.trajectory_id
            and isinstance(self.group_id, str)
            and self.group_id
        ):
            self._reject()

    def _reject(self) -> None:
        """Raise :class:`InvalidSnapshot` naming the first bad field."""
        checks = (
            ("trajectory_id", _is_name, "a non-empty string"),
            ("group_id", _is_name, "a non-empty string"),
            ("v_traj", lambda v: v is None or _is_count(v), "None or an int >= 0"),
            ("prompt_len", _is_count, "an int >= 0"),
            ("generated_len", _is_count, "an int >= 0"),
        )
        for name, good, allowed in checks:
            value = getattr(self, name)
            if not good(value):
                raise InvalidSnapshot(
                    f"queued trajectory {self.trajectory_id!r}: {name} must be {allowed}, "
                    f"got {value!r} ({type(value).__name__})",
                    instance_id=QUEUE_SOURCE,
                    field=f"queue.{name}",
                )
        raise AssertionError("QueuedTrajectory: the fast check and _reject disagree")

    @property
    def tokens(self) -> int:
        return self.prompt_len + self.generated_len

    @property
    def is_new(self) -> bool:
        return self.v_traj is None


def _is_name(value: object) -> bool:
    return isinstance(value, str) and bool(value)


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0  # (not a bool)


def _queue_key(item: QueuedTrajectory) -> tuple[int, int, int]:
    # Multi-level queue (docs/design.md, "Trajectory server"): oldest V_traj first, new prompts last, longer partials first.
    if item.v_traj is None:
        return (1, 0, 0)
    return (0, item.v_traj, -item.generated_len)


class QueueView:
    """Read-only view of the trajectory server's multi-level queue, in its serving order.

    The trajectory server keeps the queue ordered (oldest V_traj first, unversioned new prompts
    last), so the coordinator never sorts it on the hot path; :meth:`from_unordered` sorts for
    callers that cannot promise the order and :meth:`check_order` verifies it (O(n), for tests).
    """

    __slots__ = ("_run_ends", "items")

    def __init__(self, items: Sequence[QueuedTrajectory] = ()) -> None:
        self.items: Sequence[QueuedTrajectory] = items
        self._run_ends: list[int] | None = None

    def group_run_end(self, i: int) -> int:
        """The index after the run of consecutive items of ``items[i]``'s group that holds
        ``i``. For a new trajectory (new ones come last) the rest of its run are new members of
        its group: a router passing over a group skips them at once. Built on first use and
        kept with the view (a caller that serves the same view again keeps the index; the
        items must not change while the view is in use)."""
        ends = self._run_ends
        if ends is None:
            ends = self._run_ends = []
            at = 0
            for _, run in groupby(map(_GROUP_ID, self.items)):
                size = len(list(run))
                at += size
                ends.extend(repeat(at, size))
        return ends[i]

    @classmethod
    def from_unordered(cls, items: Iterable[QueuedTrajectory]) -> QueueView:
        return cls(sorted(items, key=_queue_key))

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.items)

    @property
    def has_new(self) -> bool:
        return bool(self.items) and self.items[-1].v_traj is None

    def min_partial_version(self, above: int | None = None) -> int | None:
        """Smallest V_traj among queued partials that is > ``above`` (None: any)."""
        for item in self.items:
            v = item.v_traj
            if v is None:
                return None
            if above is None or v > above:
                return v
        return None

    def check_order(self) -> None:
        keys = [_queue_key(i)[:2] for i in self.items]
        if keys != sorted(keys):
            raise InvalidSnapshot(
                "queue view is not in multi-level order (oldest V_traj first, new prompts last)",
                instance_id=QUEUE_SOURCE,
                field="queue",
            )
