"""The snapshot–command cycle: thin glue between snapshots, the protocol and a policy.

Theory of operation
-------------------
``Coordinator.step(snapshots, queue, now)`` runs one cycle:

1. Apply each snapshot to the speculative state. A rejected snapshot (unknown instance, bad
   counts, stale, from the future, inconsistent) is logged and recorded in
   ``last_cycle.rejected``; that instance keeps its last good state and the cycle goes on.
2. Release routes that were waiting for a sync the caller has since reported done. They
   and the routes still held for syncs in progress are removed from the caller's queue view
   (the caller has not executed them yet, so its queue still lists them).
3. Ask the policy's admission gate for this cycle's quota of new trajectories.
4. Synchronization decisions → ``Sync`` (never for an instance mid-sync), to the protocol's
   ``published_version`` at most.
5. Routing → ``Route``; each new trajectory is reserved through the protocol first. Routes
   to an instance that is mid-sync are held until ``on_sync_done``.
6. Migration (and bounce) → ``Interrupt(requeue=True)``.

Every issued command is applied to the speculative state at once. The caller executes the
commands and reports back: ``on_sync_done`` / ``on_sync_failed``, ``on_interrupted``,
``on_finished``, ``on_dropped`` (every admitted trajectory that ends without reaching a buffer,
so budget-based policies count it), ``remove_instance`` (an instance died; its work returns to
the queue).

The coordinator never drains the protocol's notices: the caller does (``take_notices``) and
hands the ``Abort`` notices to :meth:`Coordinator.abort`, which returns the commands that stop
them (``Interrupt(requeue=False)`` where an instance runs one, ``Drop`` for the rest). The
newest version instances may sync to is the protocol's ``published_version`` (the caller
advances it with ``protocol.publish``). The clock is injected (``clock()`` returns seconds) so
a simulator can run it in virtual time. The protocol's ``reserve`` must only be called by this
coordinator (its admission caches assume so).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from operator import itemgetter
from typing import Any

import attrs
import structlog

from rollout_coordinator._commands import Command, Drop, Interrupt, PendingRoutes, Route, Sync
from rollout_coordinator._config import CoordinatorConfig
from rollout_coordinator._meant import MeantToRun
from rollout_coordinator._port import _ProtocolPort
from rollout_coordinator._records import (
    InstanceSnapshot,
    QueuedTrajectory,
    QueueView,
    running_ids,
)
from rollout_coordinator._speculative import InstanceState, SpeculativeState
from rollout_coordinator.errors import (
    ConfigError,
    InvalidSnapshot,
    SnapshotRejected,
    StaleSnapshot,
    SyncInProgress,
)
from rollout_coordinator.policies import CycleView, GateState, Policy, build_policy
from rollout_coordinator.policies.admission import admit_by_verl_window
from staleness_protocol import (
    Abort,
    GcFifoConfig,
    ProtocolError,
    StalenessProtocol,
    UnboundedConfig,
)

_log = structlog.get_logger("rollout_coordinator")


@attrs.frozen(kw_only=True)
class CycleReport:
    """What one cycle did (for metrics and logs)."""

    now: float
    routes: int = 0
    new_admitted: int = 0
    syncs: int = 0
    interrupts: int = 0
    migrated: int = 0
    bounced: int = 0
    aborted: int = 0
    dropped: int = 0
    held_routes: int = 0
    hungry: int = 0
    quota: int | None = None
    rejected: tuple[SnapshotRejected, ...] = ()


class Coordinator:
    """Runs a policy over snapshots, a queue view and the staleness protocol, one cycle a call."""

    def __init__(
        self,
        config: CoordinatorConfig,
        protocol: StalenessProtocol,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(config, CoordinatorConfig):
            raise ConfigError("config", type(config).__name__, "a CoordinatorConfig")
        self.config = config
        self.protocol = protocol
        self.clock = clock
        self.policy: Policy = build_policy(config.policy)
        pc = protocol.config
        if self.policy.required_eta is not None and pc.eta != self.policy.required_eta:
            raise ConfigError(
                "eta",
                pc.eta,
                f"{self.policy.required_eta} for policy {self.policy.name!r}",
                detail="set the protocol's eta to match the baseline it models",
            )
        # by its config: wrappers (the app's write-ahead journal) pass ``config`` through
        kind = self.policy.protocol
        if kind == "gc-fifo":
            fits, want = isinstance(pc, GcFifoConfig), "a GcFifo (GcFifoConfig)"
        elif kind == "fifo":
            fits = isinstance(pc, UnboundedConfig) and not isinstance(pc, GcFifoConfig)
            want = "an UnboundedFifo (UnboundedConfig)"
        else:
            fits, want = not isinstance(pc, GcFifoConfig), "not a GcFifo (GcFifoConfig)"
        if not fits:
            raise ConfigError(
                "protocol",
                type(pc).__name__,
                want,
                detail=f"policy {self.policy.name!r} runs over {kind!r}; "
                "build the protocol to match",
            )
        if (
            pc.eta is None
            and self.policy.admission is admit_by_verl_window
            and config.verl_staleness_threshold is None
        ):
            raise ConfigError(
                "verl_staleness_threshold",
                None,
                "a number >= 0",
                detail=f"policy {self.policy.name!r} over a protocol without eta has no eta "
                "to take its window from",
            )
        self.state = SpeculativeState()
        self.pending = PendingRoutes()
        self._released: list[Route] = []
        self._gate = GateState()
        self._admitted_total = 0
        self._lost_total = 0
        self._known_groups: set[str] = set()
        # per instance: trajectory id -> (V_traj, time routed); and the reverse index
        self._routed: dict[str, dict[str, tuple[int, float]]] = {}
        self._where: dict[str, str] = {}
        # under the ``abort`` preemption rule: which routed trajectories were meant to run there
        # (kept only for a policy whose strategies read the rule: no other asks)
        self._meant = MeantToRun()
        self._track_meant = (
            self.config.preemption_rule == "abort" and "preemption_rule" in self.policy.reads
        )
        self._orphans: dict[str, int] = {}  # reserved, never handed out: tid -> V_traj
        self._aborted_since = self._dropped_since = 0  # by abort(), reported by the next step
        self._silent: set[str] = set()  # out of every cycle's view until they answer again
        self.last_cycle = CycleReport(now=0.0)
        self._log = _log.bind(policy=self.policy.name)

    # ---- membership and callbacks --------------------------------------------------------------

    @property
    def latest_version(self) -> int:
        """The newest version instances may sync to: the protocol's ``published_version``."""
        return self.protocol.published_version

    @property
    def instances(self) -> dict[str, InstanceState]:
        return self.state.instances

    def add_instance(self, instance_id: str, *, kv_capacity_tokens: int, version: int = 0) -> None:
        self.state.add_instance(instance_id, version=version, kv_capacity_tokens=kv_capacity_tokens)
        self._routed[instance_id] = {}
        self._meant.reset(instance_id)

    def remove_instance(self, instance_id: str) -> list[str]:
        """The instance is gone; returns the trajectories the coordinator had routed to it
        (the caller returns them to the queue). Routes held for its sync become orphans."""
        self.state.remove_instance(instance_id)
        self._silent.discard(instance_id)
        lost = list(self._routed.pop(instance_id, {}))
        self._meant.remove(instance_id)
        for tid in lost:
            self._where.pop(tid, None)
        self._orphan_held(instance_id)  # held for its sync: never issued
        return lost

    @property
    def silent(self) -> frozenset[str]:
        """The instances marked silent (:meth:`set_silent`)."""
        return frozenset(self._silent)

    def set_silent(self, instance_id: str, silent: bool = True) -> None:
        """Mark an instance silent (a call to it is overdue; it may be hung) or answering again.
        A silent instance is left out of every cycle's view: nothing is routed or migrated to
        it, none of its work is migrated away or preempted, it is not synced, and admission
        does not count its room. The routes held for its sync are not issued (new ones keep
        their reservation and V_traj, and are routed elsewhere); what it runs stays routed
        there (the caller takes back what it never sent with :meth:`unroute`, and loses the
        instance with :meth:`remove_instance` if it never answers)."""
        if instance_id not in self.state.instances:
            raise KeyError(f"unknown instance {instance_id!r}")
        if not silent:
            self._silent.discard(instance_id)
            return
        self._silent.add(instance_id)
        self._uncount(instance_id, self._orphan_held(instance_id))

    def unroute(self, instance_id: str, trajectory_ids: Iterable[str]) -> None:
        """Routes to ``instance_id`` that the caller never carried out (taken back before they
        were sent): accounted as if they had not been made. The caller queues them again."""
        ids = [t for t in trajectory_ids if self._where.get(t) == instance_id]
        for tid in ids:
            self._forget(tid)
        self._uncount(instance_id, ids)

    def _uncount(self, instance_id: str, ids: list[str]) -> None:
        """Take routes that never reached the instance out of its speculative state, where
        they were counted as running or, if it had no room, as waiting."""
        if ids:
            gone = self.state.interrupt(instance_id, ids, now=self.clock())
            self.state.withdraw_waiting(instance_id, len(ids) - len(gone))

    def _orphan_held(self, instance_id: str) -> list[str]:
        """The routes held for ``instance_id``'s sync, or released by it and not yet issued, are
        not issued: new ones keep their reservation and V_traj, partials are still queued.
        Returns their trajectory ids."""
        released = [r for r in self._released if r.instance_id == instance_id]
        self._released = [r for r in self._released if r.instance_id != instance_id]
        held = [*self.pending.orphan(instance_id), *released]
        for r in held:
            self._forget(r.trajectory_id)
            if r.new:
                self._orphans[r.trajectory_id] = r.version
        return [r.trajectory_id for r in held]

    def on_sync_done(self, instance_id: str, version: int) -> None:
        self.state.finish_sync(instance_id, version, now=self.clock())
        self._released.extend(self.pending.release(instance_id))

    def on_sync_failed(self, instance_id: str) -> list[str]:
        """The pull failed: the instance keeps its version; held routes to it are not issued.
        Returns their trajectory ids (new ones keep their reservation and V_traj)."""
        self.state.fail_sync(instance_id, now=self.clock())
        return self._orphan_held(instance_id)

    def on_interrupted(self, instance_id: str, trajectory_ids: Iterable[str]) -> None:
        """The engine stopped these (our Interrupt/Sync, or its own decision); idempotent."""
        ids = list(trajectory_ids)
        self.state.interrupt(instance_id, ids, now=self.clock())
        for tid in ids:
            self._forget(tid)

    def on_finished(self, trajectory_ids: Iterable[str]) -> None:
        for tid in trajectory_ids:
            self._forget(tid)

    def on_dropped(self, trajectory_ids: Iterable[str]) -> None:
        """Admitted trajectories that will never reach a buffer (filtered, aborted)."""
        for tid in trajectory_ids:
            self._lost_total += 1
            self._forget(tid)
            self._orphans.pop(tid, None)

    def abort(self, aborts: Iterable[Abort]) -> list[Command]:
        """The commands that carry out the protocol's ``Abort`` notices (the caller drains
        ``protocol.take_notices()`` and passes the ``Abort`` ones here, once each):
        ``Interrupt(requeue=False)`` per instance for what the coordinator routed there,
        ``Drop`` for the rest (queued, finished, or routed but held for a sync: such a route
        is cancelled). Call it before the next :meth:`step`; the counts appear in that step's
        ``last_cycle`` (``aborted`` interrupted on instances, ``dropped`` the others)."""
        commands: list[Command] = []
        n_inst, n_drop = self._abort(list(aborts), commands, self.clock())
        self._aborted_since += n_inst
        self._dropped_since += n_drop
        return commands

    def _preempted_ids(self, instance_id: str) -> tuple[str, ...]:
        """Routed to the instance and meant to run there, but in its engine's waiting queue:
        preempted, or refused (:class:`~._meant.MeantToRun`). Oldest route first; empty
        unless the ``abort`` preemption rule is on, and while the instance syncs."""
        inst = self.state.instances.get(instance_id)
        if inst is None:
            return ()
        return self._meant.out_of_place(inst, self._routed[instance_id], self.config)

    def _oldest_routed(self, instance_id: str) -> int | None:
        """The smallest V_traj routed to the instance and not heard back about."""
        return min(map(itemgetter(0), self._routed.get(instance_id, {}).values()), default=None)

    def _forget(self, tid: str) -> None:
        iid = self._where.pop(tid, None)
        if iid is not None:
            self._routed.get(iid, {}).pop(tid, None)
            self._meant.forget(iid, tid)

    def v_traj_of(self, trajectory_id: str) -> int | None:
        iid = self._where.get(trajectory_id)
        if iid is not None:
            return self._routed[iid][trajectory_id][0]
        v = self.protocol.live_version(trajectory_id)  # O(1), no record built
        if v is not None:
            return v
        try:
            return self.protocol.trajectory(trajectory_id).version
        except ProtocolError:
            return None

    # ---- the cycle ------------------------------------------------------------------------------

    def step(
        self,
        snapshots: Iterable[Any],
        queue: QueueView | Iterable[QueuedTrajectory],
        now: float | None = None,
    ) -> list[Command]:
        now = self.clock() if now is None else now
        if not isinstance(queue, QueueView):
            queue = QueueView(list(queue))
        rejected = self._ingest(snapshots, now)
        released, self._released = self._released, []
        commands: list[Command] = list(released)
        offered = queue
        queue = self._without_held(queue, commands)
        aborted, dropped = self._aborted_since, self._dropped_since
        self._aborted_since = self._dropped_since = 0

        if self._orphans:
            queue = self._with_orphans(queue)
        instances = self.state.instances
        if self._silent:
            instances = {k: v for k, v in instances.items() if k not in self._silent}
        view = CycleView(
            now=now,
            instances=instances,
            queue=queue,
            latest_version=self.protocol.published_version,
            abort_floor=self.protocol.abort_floor,
            config=self.config,
            batch_size=self.protocol.config.batch_size,
            group_size=self.protocol.config.group_size,
            group_redundancy=self.protocol.config.group_redundancy,
            eta=self.protocol.config.eta,
            admitted_total=self._admitted_total,
            lost_total=self._lost_total,
            preempted_ids=self._preempted_ids,
            oldest_routed=self._oldest_routed,
        )
        port = _ProtocolPort(self)
        quota, self._gate = self.policy.admission(view, self._gate)

        syncs = 0
        for s in self.policy.sync(view, port, quota):
            if self._apply_sync(s, now):
                commands.append(s)
                syncs += 1
        if released and syncs:
            commands, view = self._unsend_released(commands, released, offered, view)

        routing = self.policy.routing(view, port, quota)
        self.state.route_all(routing.routes, now=now)
        held = 0
        instances, routed, where = self.state.instances, self._routed, self._where
        orphans = self._orphans
        meant = self._meant if self._track_meant else None
        for r in routing.routes:
            iid, tid = r.instance_id, r.trajectory_id
            routed[iid][tid] = (r.version, now)
            where[tid] = iid
            if meant is not None and instances[iid].is_running(tid):
                meant.routed_into_room(iid, tid, r.tokens)  # not onto a waiting queue
            if orphans:
                orphans.pop(tid, None)
            if instances[iid].syncing:
                self.pending.hold(r)
                held += 1
            else:
                commands.append(r)
        if self._gate.remaining > 0:
            self._gate = attrs.evolve(
                self._gate, remaining=max(0, self._gate.remaining - routing.new_admitted)
            )

        migrated = bounced = 0
        interrupts = 0  # released routes, syncs and routes so far: migration's are the only ones
        for it in self.policy.migration(view, routing, self.v_traj_of):
            gone = self.state.interrupt(it.instance_id, it.trajectory_ids, now=now)
            # the others were waiting in the engine (preemption abort)
            self.state.withdraw_waiting(it.instance_id, len(it.trajectory_ids) - len(gone))
            for tid in it.trajectory_ids:
                self._forget(tid)
            commands.append(it)
            interrupts += 1
            if it.reason == "bounce":
                bounced += len(it.trajectory_ids)
            else:
                migrated += len(it.trajectory_ids)

        self.last_cycle = CycleReport(
            now=now,
            routes=len(routing.routes),
            new_admitted=routing.new_admitted,
            syncs=syncs,
            interrupts=interrupts,
            migrated=migrated,
            bounced=bounced,
            aborted=aborted,
            dropped=dropped,
            held_routes=held,
            hungry=len(routing.hungry),
            quota=quota,
            rejected=tuple(rejected),
        )
        if syncs or migrated or bounced or aborted or rejected:
            # per-cycle detail (many a second): debug; a run's totals are in its step records
            self._log.debug(
                "cycle",
                now=round(now, 3),
                routes=len(routing.routes),
                syncs=syncs,
                migrated=migrated,
                bounced=bounced,
                aborted=aborted,
                dropped=dropped,
                rejected=len(rejected),
            )
        return commands

    # ---- steps of the cycle ---------------------------------------------------------------------

    def _ingest(self, snapshots: Iterable[Any], now: float) -> list[SnapshotRejected]:
        rejected: list[SnapshotRejected] = []
        apply = self.state.apply_snapshot
        routed = self._routed
        latest = self.protocol.published_version
        track_meant = self._track_meant
        for raw in snapshots:
            try:
                if type(raw) is InstanceSnapshot:
                    snap = raw
                else:
                    try:
                        snap = InstanceSnapshot.from_engine(raw)
                    except (AttributeError, TypeError) as exc:
                        raise InvalidSnapshot(
                            f"not a snapshot: {exc}",
                            instance_id=str(getattr(raw, "instance_id", "?")),
                            field="snapshot",
                        ) from exc
                prev_time = apply(snap, now=now, latest_version=latest)
                if track_meant and snap.running:
                    self._meant.note_running(snap, routed[snap.instance_id])
                # _prune's own early exit, here: it runs for every instance every cycle
                if not snap.waiting and len(routed[snap.instance_id]) > len(snap.running) + 16:
                    self._prune(snap, prev_time)
            except SnapshotRejected as exc:
                rejected.append(exc)
                # a stale one is the expected race (taken just before a command went to its
                # instance; the next one replaces it): not worth a warning
                say = self._log.info if isinstance(exc, StaleSnapshot) else self._log.warning
                say("snapshot_rejected", instance=exc.instance_id, field=exc.field, error=str(exc))
        return rejected

    def _prune(self, snap: InstanceSnapshot, prev_time: float) -> None:
        """Forget routes the engine has evidently finished (cheap: only when clearly stale)."""
        routed = self._routed[snap.instance_id]
        if snap.waiting or len(routed) <= len(snap.running) + 16:
            return
        running = set(running_ids(snap.running))
        meant = self._meant
        for tid, (_v, t) in list(routed.items()):
            if t < prev_time and tid not in running:
                del routed[tid]
                self._where.pop(tid, None)
                meant.forget(snap.instance_id, tid)

    def _abort(self, aborts: list[Abort], commands: list[Command], now: float) -> tuple[int, int]:
        if not aborts:
            return 0, 0
        by_instance: dict[tuple[str, str], list[str]] = {}
        drops: dict[str, list[str]] = {}
        # A route still held for its instance's sync, or released by a finished sync but not
        # emitted yet, never reached the engine: cancel it (else it would be routed to an
        # aborted trajectory) and drop it.
        aborted = {str(a.trajectory_id) for a in aborts}
        unheld: set[str] = set()
        cancelled = [*self.pending.discard(aborted)] if len(self.pending) else []
        if self._released:
            cancelled += [r for r in self._released if r.trajectory_id in aborted]
            self._released = [r for r in self._released if r.trajectory_id not in aborted]
        for r in cancelled:
            unheld.add(r.trajectory_id)
            self.state.interrupt(r.instance_id, [r.trajectory_id], now=now)
            self._forget(r.trajectory_id)
        for a in aborts:
            tid = str(a.trajectory_id)
            iid = None if tid in unheld else self._where.get(tid)
            if iid is not None:
                by_instance.setdefault((iid, str(a.reason)), []).append(tid)
            else:
                drops.setdefault(str(a.reason), []).append(tid)
            self._orphans.pop(tid, None)
        for (iid, reason), ids in by_instance.items():
            self.state.interrupt(iid, ids, now=now)
            for tid in ids:
                self._forget(tid)
            commands.append(
                Interrupt(instance_id=iid, trajectory_ids=ids, reason=reason, requeue=False)
            )
        for reason, ids in drops.items():
            commands.append(Drop(trajectory_ids=ids, reason=reason))
        n_inst = sum(len(v) for v in by_instance.values())
        return n_inst, len(aborts) - n_inst

    def _apply_sync(self, s: Sync, now: float) -> bool:
        inst = self.state.instances.get(s.instance_id)
        if inst is None or inst.syncing or s.to_version <= inst.version:
            return False  # never a second sync mid-sync; nothing to do if not newer
        try:
            self.state.begin_sync(s.instance_id, s.to_version, now=now)
        except SyncInProgress:  # pragma: no cover - checked above
            return False
        for tid in list(self._routed[s.instance_id]):
            self._where.pop(tid, None)
        self._routed[s.instance_id] = {}
        self._meant.reset(s.instance_id)
        return True

    def _unsend_released(
        self,
        commands: list[Command],
        released: list[Route],
        offered: QueueView,
        view: CycleView,
    ) -> tuple[list[Command], CycleView]:
        """Routes a finished sync released to an instance that this same cycle syncs again are
        not sent: the new sync would interrupt them as soon as they reached the engine (their
        work back to the queue a round trip later). They go back to the queue at once, as on a
        failed sync (a new trajectory keeps its reservation and V_traj), and this cycle's
        routing may place them anywhere. Returns the commands and the view routing sees."""
        synced = {c.instance_id for c in commands if isinstance(c, Sync)}
        back = [r for r in released if r.instance_id in synced]
        if not back:
            return commands, view
        ids = {r.trajectory_id for r in back}
        for r in back:  # _apply_sync already forgot where they were routed
            if r.new:
                self._orphans[r.trajectory_id] = r.version
        kept = [c for c in commands if not (isinstance(c, Route) and c.trajectory_id in ids)]
        queue = self._with_orphans(self._without_held(offered, kept))
        return kept, attrs.evolve(view, queue=queue)

    def _without_held(self, queue: QueueView, released: list[Command]) -> QueueView:
        """Drop from the caller's queue view every trajectory the coordinator has already
        routed but the caller has not executed yet: routes held for a sync in progress, and
        routes released this cycle (they are in this cycle's commands). The caller's queue
        still lists them until it executes the Route; routing them again would hand one
        trajectory to two instances. Callers that filter them already lose nothing."""
        if not released and not len(self.pending):
            return queue
        held = self.pending.trajectory_ids()
        held.update(c.trajectory_id for c in released if isinstance(c, Route))
        if not held:
            return queue
        return QueueView([i for i in queue.items if i.trajectory_id not in held])

    def _with_orphans(self, queue: QueueView) -> QueueView:
        orphans = self._orphans
        items = [
            attrs.evolve(i, v_traj=orphans[i.trajectory_id])
            if i.v_traj is None and i.trajectory_id in orphans
            else i
            for i in queue.items
        ]
        return QueueView.from_unordered(items)
