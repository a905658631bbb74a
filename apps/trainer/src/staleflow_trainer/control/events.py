"""What the control core is told: typed, frozen events (see :mod:`.core`).

Every event carries ``at``, the shell's clock when it happened (wall seconds since the run
started for the Ray deployment, virtual seconds for the simulator). The core never reads a
clock; time reaches it only through events. Events carry ids, versions, token counts and
finish reasons — never token payloads.

Every event is plain data and round-trips through :func:`event_to_dict` /
:func:`event_from_dict`, which is how the write-ahead journal stores them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from rollout_coordinator import InstanceSnapshot, RunningEntry


def _tuple(items: Iterable[Any]) -> tuple[Any, ...]:
    return items if isinstance(items, tuple) else tuple(items)


@attrs.frozen(kw_only=True, slots=True)
class Outcome:
    """What became of one trajectory an instance ran: ``generated`` is its response length
    so far (all segments, every version); ``finish`` is the finish reason (``stop``,
    ``length``, ...) or None when it came back unfinished (interrupted, preempted, refused)."""

    trajectory_id: str
    generated: int
    finish: str | None = None


@attrs.frozen(kw_only=True, slots=True)
class Cycle:
    """Run one coordinator cycle now (the shell feeds the instances' reports first)."""

    at: float


@attrs.frozen(kw_only=True, slots=True)
class Reported:
    """An instance's results since its last report, and a snapshot taken after them (None when
    the shell has no fresh one). Its output is already in the trajectory store. ``dropped``:
    trajectories routed there that the store holds as dropped (or does not know, or holds on
    another instance), each with the reason — the core drops them and their groups."""

    at: float
    instance_id: str
    outcomes: tuple[Outcome, ...] = attrs.field(default=(), converter=_tuple)
    snapshot: InstanceSnapshot | None = None
    dropped: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_tuple)


@attrs.frozen(kw_only=True, slots=True)
class Reward:
    """One trajectory's reward: a score, or None with the reason it could not be scored."""

    trajectory_id: str
    score: float | None
    reason: str | None = None


@attrs.frozen(kw_only=True, slots=True)
class Rewarded:
    at: float
    rewards: tuple[Reward, ...] = attrs.field(converter=_tuple)


@attrs.frozen(kw_only=True, slots=True)
class SyncDone:
    at: float
    instance_id: str
    version: int


@attrs.frozen(kw_only=True, slots=True)
class SyncFailed:
    at: float
    instance_id: str
    error: str


@attrs.frozen(kw_only=True, slots=True)
class Trained:
    """The trainer finished the batch of buffer ``version - 1`` and the weights of ``version``
    are published (pullable). ``metrics`` are the trainer's own numbers for the step record."""

    at: float
    version: int
    metrics: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True, slots=True)
class InstanceJoined:
    """An instance joins, serving ``version``. ``setup``: part of starting or recovering the
    run (its first instances; a live instance joining again after a control restart), not a
    change of membership — not counted in ``instances_joined``."""

    at: float
    instance_id: str
    kv_capacity_tokens: int
    version: int
    setup: bool = False


@attrs.frozen(kw_only=True, slots=True)
class InstanceLost:
    """An instance is gone. ``requeued`` lists what the trajectory store put back in the queue
    for it, with the response length the store holds for each (output the instance had not
    written back is lost). ``finished`` and ``dropped``: what the store holds as finished (with
    its response length and finish reason) or dropped (with the reason) of the trajectories the
    core believed ran there — output the instance wrote back but whose report died with it;
    they settle exactly as that report would have settled them. ``setup``: recovery takes the
    instance out of the run to bring it back at once (or it belonged to the deployment a
    resumed run replaced) — not counted in ``instances_lost``."""

    at: float
    instance_id: str
    requeued: tuple[tuple[str, int], ...] = attrs.field(default=(), converter=_tuple)
    setup: bool = False
    finished: tuple[Outcome, ...] = attrs.field(default=(), converter=_tuple)
    dropped: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_tuple)


@attrs.frozen(kw_only=True, slots=True)
class InstanceSilent:
    """A call to an instance is overdue (``silent``; it may be hung), or it answered again
    (not ``silent``). While silent, the coordinator leaves it out of every cycle: nothing is
    routed, migrated or synced there, and what the batches still waiting for their trajectories
    need goes to the other instances. ``withdrawn``: trajectories routed there whose route the
    shell never sent (queued behind the overdue call) and now never will — they go back to the
    queue, where the store still holds them."""

    at: float
    instance_id: str
    silent: bool = True
    withdrawn: tuple[str, ...] = attrs.field(default=(), converter=_tuple)


Event = (
    Cycle
    | Reported
    | Rewarded
    | SyncDone
    | SyncFailed
    | Trained
    | InstanceJoined
    | InstanceLost
    | InstanceSilent
)

_KINDS: dict[str, type[Any]] = {
    "cycle": Cycle,
    "reported": Reported,
    "rewarded": Rewarded,
    "sync_done": SyncDone,
    "sync_failed": SyncFailed,
    "trained": Trained,
    "joined": InstanceJoined,
    "lost": InstanceLost,
    "silent": InstanceSilent,
}
_NAMES = {cls: name for name, cls in _KINDS.items()}


def event_to_dict(e: Event) -> dict[str, Any]:
    """JSON-plain form of an event (the journal's record)."""
    d: dict[str, Any] = {"kind": _NAMES[type(e)], "at": e.at}
    if isinstance(e, Reported):
        d["instance_id"] = e.instance_id
        d["outcomes"] = [[o.trajectory_id, o.generated, o.finish] for o in e.outcomes]
        d["snapshot"] = None if e.snapshot is None else snapshot_to_dict(e.snapshot)
        if e.dropped:
            d["dropped"] = [list(x) for x in e.dropped]
    elif isinstance(e, Rewarded):
        d["rewards"] = [[r.trajectory_id, r.score, r.reason] for r in e.rewards]
    elif isinstance(e, InstanceLost):
        d["instance_id"] = e.instance_id
        d["requeued"] = [list(x) for x in e.requeued]
        d["setup"] = e.setup
        if e.finished:
            d["finished"] = [[o.trajectory_id, o.generated, o.finish] for o in e.finished]
        if e.dropped:
            d["dropped"] = [list(x) for x in e.dropped]
    elif isinstance(e, Trained):
        d["version"] = e.version
        d["metrics"] = dict(e.metrics)
    elif not isinstance(e, Cycle):
        d.update({k: v for k, v in attrs.asdict(e).items() if k != "at"})
    return d


def event_from_dict(d: Mapping[str, Any]) -> Event:
    kind = d.get("kind")
    cls = _KINDS.get(str(kind))
    if cls is None:
        raise ValueError(f"unknown event kind {kind!r}; allowed: {sorted(_KINDS)}")
    at = float(d["at"])
    if cls is Reported:
        snap = d.get("snapshot")
        return Reported(
            at=at,
            instance_id=str(d["instance_id"]),
            outcomes=_outcomes(d["outcomes"]),
            snapshot=None if snap is None else snapshot_from_dict(snap),
            dropped=_dropped(d),
        )
    if cls is Rewarded:
        return Rewarded(
            at=at,
            rewards=tuple(
                Reward(trajectory_id=str(t), score=None if s is None else float(s), reason=r)
                for t, s, r in d["rewards"]
            ),
        )
    if cls is InstanceLost:
        return InstanceLost(
            at=at,
            instance_id=str(d["instance_id"]),
            requeued=tuple((str(t), int(g)) for t, g in d["requeued"]),
            setup=bool(d.get("setup", False)),
            finished=_outcomes(d.get("finished", ())),
            dropped=_dropped(d),
        )
    fields = {k: v for k, v in d.items() if k not in ("kind", "at")}
    return cls(at=at, **fields)  # type: ignore[no-any-return]


def _outcomes(rows: Iterable[Any]) -> tuple[Outcome, ...]:
    return tuple(
        Outcome(trajectory_id=str(t), generated=int(g), finish=None if f is None else str(f))
        for t, g, f in rows
    )


def _dropped(d: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple((str(t), str(r)) for t, r in d.get("dropped", ()))


def snapshot_to_dict(s: InstanceSnapshot) -> dict[str, Any]:
    return {
        "instance_id": s.instance_id,
        "seq": s.seq,
        "time_s": s.time_s,
        "version": s.version,
        "running": [[r.trajectory_id, r.prompt_tokens, r.generated_tokens] for r in s.running],
        "waiting": s.waiting,
        "kv_used_tokens": s.kv_used_tokens,
        "kv_capacity_tokens": s.kv_capacity_tokens,
        "throughput_tokens_per_s": s.throughput_tokens_per_s,
    }


def snapshot_from_dict(d: Mapping[str, Any]) -> InstanceSnapshot:
    return InstanceSnapshot(
        instance_id=str(d["instance_id"]),
        seq=int(d["seq"]),
        time_s=float(d["time_s"]),
        version=int(d["version"]),
        running=tuple(
            RunningEntry(trajectory_id=str(t), prompt_tokens=int(p), generated_tokens=int(g))
            for t, p, g in d["running"]
        ),
        waiting=int(d["waiting"]),
        kv_used_tokens=int(d["kv_used_tokens"]),
        kv_capacity_tokens=int(d["kv_capacity_tokens"]),
        throughput_tokens_per_s=float(d["throughput_tokens_per_s"]),
    )
