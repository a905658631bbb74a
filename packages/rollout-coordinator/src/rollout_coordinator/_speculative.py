"""Speculative per-instance state: the last good snapshot plus the coordinator's own commands.

Theory of operation
-------------------
Snapshots arrive every cycle but lag the commands the coordinator issues. To avoid
double-counting (routing the same free KV twice before the next snapshot shows the first
route), every issued command updates the state *immediately*:

* route     → the trajectory runs (n + 1, kv + its tokens) if the instance has no waiting queue
              and KV room, else it joins the engine's waiting queue (waiting + 1);
* interrupt → the trajectories leave (n − k, kv − their tokens);
* sync      → ``syncing`` with ``target_version``; running and waiting work is interrupted
              (the engine re-queues it), so the counters drop to zero.

A snapshot replaces the counters wholesale, but only if it is at least as new as the last
local update (``time_s >= last_local_update``), its ``seq`` increases, it is not from the
future (``time_s <= now``) and it agrees with what the coordinator knows about versions (a
version never regresses, never exceeds the latest published one, and only moves up through a
sync the coordinator issued — except on the first snapshot, which defines the instance).
Anything else raises a :class:`SnapshotRejected` subclass and the state is left untouched.

A sync is never issued to an instance that is mid-sync (:class:`SyncInProgress`).

Every instance is touched every cycle (a snapshot each), so the accepted-snapshot path is one
compound test followed by the assignments; only a snapshot that fails it (or completes a
sync) goes through the checks one by one, which name what is wrong. Work the coordinator
routes is kept as ``(prompt_tokens, generated_tokens, v_traj)`` per trajectory id and turned
into :class:`RunningEntry` records only when someone lists the running work.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

from rollout_coordinator._commands import Route
from rollout_coordinator._records import InstanceSnapshot, RunningEntry
from rollout_coordinator._records import running_ids as _ids_of
from rollout_coordinator.errors import (
    ConfigError,
    FutureSnapshot,
    InconsistentSnapshot,
    StaleSnapshot,
    SyncInProgress,
    UnknownInstance,
)


class InstanceState:
    """One instance as the coordinator believes it is now. Read it; mutate via SpeculativeState."""

    __slots__ = (
        "_added",
        "_base_running",
        "_removed",
        "instance_id",
        "kv_capacity",
        "kv_used",
        "last_local_update",
        "last_seq",
        "last_snapshot_time",
        "n_running",
        "seen_snapshot",
        "syncing",
        "target_version",
        "throughput",
        "version",
        "waiting",
    )

    def __init__(self, instance_id: str, version: int, kv_capacity: int) -> None:
        self.instance_id = instance_id
        self.version = version  # served now
        self.target_version = version  # served after the sync in flight (== version if none)
        self.syncing = False
        self._base_running: Sequence[RunningEntry] = ()
        # routed by the coordinator since the snapshot: id -> (prompt, generated, V_traj)
        self._added: dict[str, tuple[int, int, int | None]] = {}
        self._removed: set[str] = set()
        self.n_running = 0
        self.kv_used = 0
        self.kv_capacity = kv_capacity
        self.waiting = 0
        self.throughput = 0.0
        self.last_seq = -1
        self.last_snapshot_time = -math.inf
        self.last_local_update = -math.inf
        self.seen_snapshot = False

    @property
    def kv_usage(self) -> float:
        return self.kv_used / self.kv_capacity

    def running_entries(self) -> Iterator[RunningEntry]:
        removed = self._removed
        for e in self._base_running:
            if e.trajectory_id not in removed:
                yield e
        for tid, (prompt, generated, v_traj) in self._added.items():
            yield RunningEntry(
                trajectory_id=tid, prompt_tokens=prompt, generated_tokens=generated, v_traj=v_traj
            )

    def running_ids(self) -> Iterator[str]:
        """The ids of :meth:`running_entries`, in the same order, building no entry."""
        removed = self._removed
        for tid in _ids_of(self._base_running):
            if tid not in removed:
                yield tid
        yield from self._added

    def is_running(self, trajectory_id: str) -> bool:
        if trajectory_id in self._added:
            return True
        if trajectory_id in self._removed:
            return False
        return trajectory_id in _ids_of(self._base_running)

    def __repr__(self) -> str:
        return (
            f"InstanceState({self.instance_id!r}, v={self.version}->{self.target_version}, "
            f"syncing={self.syncing}, n={self.n_running}, kv={self.kv_used}/{self.kv_capacity}, "
            f"waiting={self.waiting})"
        )


class SpeculativeState:
    """All instances, kept current between snapshots by the coordinator's own commands."""

    def __init__(self) -> None:
        self.instances: dict[str, InstanceState] = {}

    # ---- membership ---------------------------------------------------------------------------

    def add_instance(
        self, instance_id: str, *, version: int, kv_capacity_tokens: int
    ) -> InstanceState:
        if not instance_id:
            raise ConfigError("instance_id", instance_id, "a non-empty string")
        if instance_id in self.instances:
            raise ConfigError("instance_id", instance_id, "not already registered")
        if version < 0:
            raise ConfigError("version", version, ">= 0")
        if kv_capacity_tokens <= 0:
            raise ConfigError("kv_capacity_tokens", kv_capacity_tokens, "> 0")
        state = InstanceState(instance_id, version, kv_capacity_tokens)
        self.instances[instance_id] = state
        return state

    def remove_instance(self, instance_id: str) -> list[RunningEntry]:
        """Forget an instance (it died or was scaled down); returns what it was running."""
        state = self.get(instance_id)
        del self.instances[instance_id]
        return list(state.running_entries())

    def get(self, instance_id: str) -> InstanceState:
        try:
            return self.instances[instance_id]
        except KeyError:
            raise UnknownInstance(instance_id, list(self.instances)) from None

    # ---- snapshots ----------------------------------------------------------------------------

    def apply_snapshot(self, snap: InstanceSnapshot, *, now: float, latest_version: int) -> float:
        """Replace an instance's counters with a snapshot, or raise and change nothing.
        Returns the time of the snapshot it replaces (``-inf`` for the first)."""
        state = self.instances.get(snap.instance_id)
        t = snap.time_s
        version = snap.version
        if (
            state is None
            or t > now
            or snap.seq <= state.last_seq
            or t < state.last_local_update
            or t < state.last_snapshot_time
            or version > latest_version
            or (version != state.version and (state.seen_snapshot or state.syncing))
        ):
            # rejected (raises), or the first snapshot after a sync it completes
            if self._check_snapshot(snap, now=now, latest_version=latest_version):
                self.instances[snap.instance_id].syncing = False
            state = self.instances[snap.instance_id]
        # --- accepted: nothing above changed state ---
        state.version = version
        if not state.syncing:
            state.target_version = version
        running = snap.running
        state._base_running = running
        if state._added:
            state._added = {}
        if state._removed:
            state._removed = set()
        state.n_running = len(running)
        state.kv_used = snap.kv_used_tokens
        state.kv_capacity = snap.kv_capacity_tokens
        state.waiting = snap.waiting
        state.throughput = snap.throughput_tokens_per_s
        state.last_seq = snap.seq
        prev_time = state.last_snapshot_time
        state.last_snapshot_time = t
        state.seen_snapshot = True
        return prev_time

    def _check_snapshot(self, snap: InstanceSnapshot, *, now: float, latest_version: int) -> bool:
        """The acceptance rules one by one: raise the first that fails; else return whether
        the snapshot completes the instance's sync (changes nothing)."""
        iid = snap.instance_id
        state = self.instances.get(iid)
        if state is None:
            raise UnknownInstance(iid, list(self.instances))
        if snap.time_s > now:
            raise FutureSnapshot(
                f"taken at time_s={snap.time_s}, after the coordinator's now={now}",
                instance_id=iid,
                field="time_s",
            )
        if snap.seq <= state.last_seq:
            raise StaleSnapshot(
                f"seq {snap.seq} does not increase past the last accepted seq {state.last_seq}",
                instance_id=iid,
                field="seq",
            )
        if snap.time_s < state.last_local_update:
            raise StaleSnapshot(
                f"taken at time_s={snap.time_s}, before the coordinator's last command to it "
                f"at {state.last_local_update}",
                instance_id=iid,
                field="time_s",
            )
        if snap.time_s < state.last_snapshot_time:
            raise StaleSnapshot(
                f"time_s={snap.time_s} regresses past the last accepted {state.last_snapshot_time}",
                instance_id=iid,
                field="time_s",
            )
        if snap.version > latest_version:
            raise InconsistentSnapshot(
                f"version {snap.version} was never published (latest is {latest_version})",
                instance_id=iid,
                field="version",
            )
        sync_done = False
        if state.seen_snapshot or state.syncing:
            if snap.version < state.version:
                raise InconsistentSnapshot(
                    f"version regressed from {state.version} to {snap.version}",
                    instance_id=iid,
                    field="version",
                )
            if snap.version > state.version:
                if not state.syncing or snap.version != state.target_version:
                    raise InconsistentSnapshot(
                        f"version {snap.version} but the coordinator synced it to "
                        f"{state.target_version if state.syncing else state.version}",
                        instance_id=iid,
                        field="version",
                    )
                sync_done = True
        return sync_done

    # ---- the coordinator's own commands ---------------------------------------------------------

    def route(self, instance_id: str, entry: RunningEntry, *, now: float) -> bool:
        """Account a route; returns True if it runs now, False if it joins the waiting queue."""
        s = self.get(instance_id)
        s.last_local_update = max(s.last_local_update, now)
        tokens = entry.tokens
        # A route held for a syncing instance runs once the sync is done: count it as running.
        if s.waiting > 0 or s.kv_used + tokens > s.kv_capacity:
            s.waiting += 1
            return False
        # a snapshot entry this id had stays hidden: an interrupted trajectory routed back here
        # before the next snapshot runs once, as the new entry
        s._added[entry.trajectory_id] = (entry.prompt_tokens, entry.generated_tokens, entry.v_traj)
        s.n_running += 1
        s.kv_used += tokens
        return True

    def route_all(self, routes: Sequence[Route], *, now: float) -> None:
        """Account this cycle's routes (what :meth:`route` does for each: a route runs as a
        new trajectory of ``Route.tokens`` prompt tokens at ``Route.version``)."""
        instances = self.instances
        for r in routes:
            s = instances.get(r.instance_id)
            if s is None:
                s = self.get(r.instance_id)  # raises UnknownInstance
            if now > s.last_local_update:
                s.last_local_update = now
            tokens = r.tokens
            if s.waiting > 0 or s.kv_used + tokens > s.kv_capacity:
                s.waiting += 1
                continue
            tid = r.trajectory_id
            s._added[tid] = (tokens, 0, r.version)  # see route(): a hidden entry stays hidden
            s.n_running += 1
            s.kv_used += tokens

    def interrupt(
        self, instance_id: str, trajectory_ids: Iterable[str], *, now: float
    ) -> list[RunningEntry]:
        """Account an interrupt; returns the entries that were running (unknown ids are ignored:
        they may sit in the engine's waiting queue, which snapshots only count)."""
        s = self.get(instance_id)
        s.last_local_update = max(s.last_local_update, now)
        wanted = set(trajectory_ids)
        gone: list[RunningEntry] = []
        for e in list(s.running_entries()):
            if e.trajectory_id in wanted:
                gone.append(e)
        for e in gone:
            if s._added.pop(e.trajectory_id, None) is None:
                s._removed.add(e.trajectory_id)
            s.n_running -= 1
            s.kv_used = max(0, s.kv_used - e.tokens)
        return gone

    def withdraw_waiting(self, instance_id: str, count: int) -> None:
        """Account ``count`` trajectories taken out of the engine's waiting queue."""
        if count > 0:
            s = self.get(instance_id)
            s.waiting = max(0, s.waiting - count)

    def begin_sync(self, instance_id: str, to_version: int, *, now: float) -> list[RunningEntry]:
        """Account a sync; returns the running entries it interrupts."""
        s = self.get(instance_id)
        if s.syncing:
            raise SyncInProgress(instance_id, s.target_version)
        if to_version <= s.version:
            raise ConfigError(
                "to_version",
                to_version,
                f"> the instance's version {s.version}",
                detail=f"instance {instance_id!r}",
            )
        s.last_local_update = max(s.last_local_update, now)
        gone = list(s.running_entries())
        s.syncing = True
        s.target_version = to_version
        s._base_running = ()
        s._added = {}
        s._removed = set()
        s.n_running = 0
        s.kv_used = 0
        s.waiting = 0
        return gone

    def finish_sync(self, instance_id: str, version: int, *, now: float) -> None:
        s = self.get(instance_id)
        if version < s.version:
            raise ConfigError(
                "version",
                version,
                f">= the instance's version {s.version}",
                detail=f"instance {instance_id!r}",
            )
        s.last_local_update = max(s.last_local_update, now)
        s.version = version
        s.target_version = version
        s.syncing = False

    def fail_sync(self, instance_id: str, *, now: float) -> None:
        s = self.get(instance_id)
        s.last_local_update = max(s.last_local_update, now)
        s.syncing = False
        s.target_version = s.version
