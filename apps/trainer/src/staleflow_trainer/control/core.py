"""The control core: every decision of a StaleFlow run, as a deterministic state machine.

Theory of operation
-------------------
Events in, effects out (:mod:`.events`, :mod:`.effects`), in the style of h11's state machine:
no clock, no I/O, no Ray, no logging. A shell (the Ray deployment or the simulator) feeds each
event to :meth:`ControlCore.handle` and carries out the effects it returns, in order, before
it feeds the next event. The core owns:

* the staleness protocol (built once, :func:`.config.build_protocol`) and the rollout
  ``Coordinator`` that routes, syncs and migrates against it;
* the trajectory :class:`~.ledger.Ledger` (ids, lengths, V_traj, where each one is) and the
  multi-level queue the coordinator is offered;
* the prompt feed: at least ``feed_batches`` batches of never-admitted groups stay queued,
  plus one group per replacement the protocol asks for;
* reward outcomes: when a group's ``n`` kept members are rewarded it is either filtered (all
  rewards equal, with ``dynamic_sampling``; dropped *before* it occupies a slot) or finished
  through the protocol (which occupies its slot); a reward that cannot be computed drops the
  group with the reason;
* training: when the trainer is idle and the next buffer is READY, ``consume`` → ``Train``;
  ``Trained`` publishes the new version; a stuck buffer is resolved once the trainer has
  waited ``stuck_after_s``;
* instances joining and leaving, sync outcomes (``sync_retries`` failures in a row halt the
  run; :mod:`.instances`), and the step records and instance timeline of the metrics contract
  (:mod:`.report`).

Determinism: the same events from the same state give the same effects and the same state,
in any process (no iteration over hash-ordered sets decides anything). The write-ahead journal
records the events fed to the core; recovery replays them on the last base state
(:meth:`to_dict` / :meth:`restore`).

Invariants (checked by the tests after every event): every admitted trajectory ends consumed,
or dropped with a reason; consumed staleness never exceeds η; no batch is trained twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

from rollout_coordinator import Coordinator, InstanceSnapshot, QueueView
from rollout_coordinator import Drop as CoordDrop
from rollout_coordinator import Interrupt as CoordInterrupt
from rollout_coordinator import Route as CoordRoute
from rollout_coordinator import Sync as CoordSync
from staleflow_trainer.control import effects as fx
from staleflow_trainer.control import instances
from staleflow_trainer.control.config import (
    AnyProtocol,
    CoreConfig,
    build_protocol,
)
from staleflow_trainer.control.events import (
    Cycle,
    Event,
    InstanceJoined,
    InstanceLost,
    InstanceSilent,
    Reported,
    Rewarded,
    SyncDone,
    SyncFailed,
    Trained,
)
from staleflow_trainer.control.feed import PromptFeed
from staleflow_trainer.control.ledger import Ledger, Where
from staleflow_trainer.control.report import StepReport
from staleflow_trainer.control.stream import stream_settled
from staleness_protocol import (
    Abort,
    GroupAborted,
    GroupState,
    ProtocolError,
    ReplacementRequest,
    StalenessProtocol,
    TrajectoryState,
)

_COUNTER_NAMES = """
    routes syncs sync_failures migrations bounces interrupts aborts filtered reward_dropped
    replacements stuck_resolved instances_lost instances_joined lost_requeued lost_finished
    store_dropped late_outcomes sync_interrupts instances_silent withdrawn_routes
    streamed_groups
"""
#: the run's counters (the step records' ``counters``), in the order they are reported
COUNTERS = tuple(_COUNTER_NAMES.split())


class CoreHalted(Exception):
    """The core was fed an event after it halted (see :class:`~.effects.Halt`)."""


class ControlCore:
    """One run's control state. ``prompt_len(row)`` is the token length of a dataset row's
    prompt (a pure function: the same row, the same length, in every process)."""

    def __init__(
        self,
        config: CoreConfig,
        *,
        prompt_len: Callable[[int], int],
        start_version: int = 0,
    ) -> None:
        self.config = config
        self._prompt_len = prompt_len
        self.protocol: AnyProtocol = build_protocol(config.protocol)
        if start_version:
            self.protocol = _at_version(self.protocol, start_version)
        self.now = 0.0
        self.coordinator = Coordinator(
            config.coordinator, cast(StalenessProtocol, self.protocol), clock=lambda: self.now
        )
        self.ledger = Ledger()
        self.feed = PromptFeed(rows=config.rows, seed=config.seed, shuffle=config.shuffle)
        self.steps_done = start_version
        self.published = start_version
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.report = StepReport(window=config.rate_window_steps)
        #: the batch being trained (a Train effect not yet answered), or None
        self.training: fx.Train | None = None
        self._idle_since = 0.0
        self._stuck_checked_at = -1.0
        self._fresh: dict[str, None] = {}  # groups no member of which was admitted yet
        self._replacements_due = 0  # replacement prompts the protocol asked for, not yet fed
        self._snapshots: dict[str, InstanceSnapshot] = {}
        self._queue_view: QueueView | None = None  # kept while the ledger serves the same queue
        self._sync_fail_streak: dict[str, int] = {}
        self._reward_fail_streak = 0
        self._filtered_streak = 0  # groups filtered in a row (dynamic sampling)
        #: groups of the next batch sent to the trainer early (``stream_batch``)
        self.streamed: set[str] = set()
        self.halted: fx.Halt | None = None
        self.done = False

    # ------------------------------------------------------------------------- dispatch

    def handle(self, event: Event) -> list[fx.Effect]:
        """Apply one event; returns the effects the shell must carry out, in order."""
        if self.halted is not None:
            raise CoreHalted(f"the run halted: {self.halted.reason}")
        self.now = max(self.now, float(event.at))
        out: list[fx.Effect] = []
        if isinstance(event, Cycle):
            self._cycle(out)
        elif isinstance(event, Reported):
            self._reported(event, out)
        elif isinstance(event, Rewarded):
            self._rewarded(event, out)
        elif isinstance(event, Trained):
            self._trained(event, out)
        elif isinstance(event, SyncDone):
            instances.sync_done(self, event)
        elif isinstance(event, SyncFailed):
            instances.sync_failed(self, event, out)
        elif isinstance(event, InstanceJoined):
            instances.joined(self, event)
        elif isinstance(event, InstanceLost):
            instances.lost(self, event, out)
        elif isinstance(event, InstanceSilent):
            instances.silent(self, event)
        else:  # pragma: no cover - the Event union is closed
            raise TypeError(f"not an event: {event!r}")
        if self.halted is not None:  # the shell stops at the Halt: nothing may follow it
            return out
        self._after_change(out)
        if not isinstance(event, Cycle | SyncDone | InstanceJoined):
            self._maybe_train(out)
        return out

    # ------------------------------------------------------------------------- the cycle

    def _cycle(self, out: list[fx.Effect]) -> None:
        if self.done:
            return
        self._stock(out)
        snaps = list(self._snapshots.values())
        self._snapshots.clear()
        self._promote_due()
        items = self.ledger.queue_items(self.config.queue_view_limit)
        view = self._queue_view
        if view is None or view.items is not items:  # the ledger's list is new when it changed
            view = self._queue_view = QueueView(items)
        commands = self.coordinator.step(snaps, view, self.now)
        self._execute(commands, out)
        # routes held until their instance's sync is done were reserved: their V_traj is set
        pending = self.coordinator.pending
        if len(pending):
            for iid in self.coordinator.instances:
                for r in pending.held_for(iid):
                    if r.new and self._never_admitted(r.trajectory_id):
                        self.ledger.set_v_traj(r.trajectory_id, r.version)
        self._maybe_train(out)

    def _execute(self, commands: Sequence[Any], out: list[fx.Effect]) -> None:
        """The coordinator's commands as effects, in its order (a route released by a finished
        sync comes before the next sync of that instance); consecutive routes are batched per
        instance and version."""
        routes: dict[tuple[str, int], list[str]] = {}

        def flush() -> None:
            for (iid, version), tids in routes.items():
                self.counters["routes"] += len(tids)
                out.append(fx.Route(instance_id=iid, version=version, trajectory_ids=tids))
            routes.clear()

        for c in commands:
            if isinstance(c, CoordRoute):
                e = self.ledger.run(c.trajectory_id, c.instance_id, c.version)
                self._fresh.pop(e.group, None)
                routes.setdefault((c.instance_id, c.version), []).append(c.trajectory_id)
                continue
            flush()
            if isinstance(c, CoordInterrupt):
                ids = tuple(c.trajectory_ids)
                if not ids:
                    continue
                self.counters["interrupts"] += len(ids)
                if c.requeue:
                    self.counters["bounces" if c.reason == "bounce" else "migrations"] += len(ids)
                else:  # the protocol aborted them: settled now, the shell discards the output
                    self._drop_ids(ids, str(c.reason))
                    self.coordinator.on_dropped(ids)
                out.append(
                    fx.Interrupt(
                        instance_id=c.instance_id,
                        trajectory_ids=ids,
                        reason=str(c.reason),
                        requeue=bool(c.requeue),
                    )
                )
            elif isinstance(c, CoordDrop):
                ids = tuple(c.trajectory_ids)
                self._drop_ids(ids, str(c.reason))
                self.coordinator.on_dropped(ids)
                out.append(fx.Drop(trajectory_ids=ids, reason=str(c.reason)))
            elif isinstance(c, CoordSync):
                self.counters["syncs"] += 1
                self.counters["sync_interrupts"] += len(self.ledger.held.get(c.instance_id, ()))
                self.report.instance_syncing(c.instance_id, self.now, c.to_version)
                out.append(fx.Sync(instance_id=c.instance_id, version=c.to_version))
        flush()

    def _drop_ids(self, ids: Iterable[str], reason: str) -> None:
        self.counters["aborts"] += sum(1 for t in ids if self.ledger.drop(t, reason) is not None)

    # ------------------------------------------------------------------------- feeding

    def _stock(self, out: list[fx.Effect]) -> None:
        want = self.config.feed_batches * self.config.batch_size - len(self._fresh)
        extra, self._replacements_due = self._replacements_due, 0
        self.counters["replacements"] += extra
        want = max(want, 0) + extra
        if want <= 0:
            return
        specs = []
        for _ in range(want):
            gid, row = self.feed.next_group()
            self.ledger.add_group(gid, row, self.config.members, self._prompt_len(row))
            self._fresh[gid] = None
            specs.append(fx.GroupSpec(group_id=gid, row=row, members=self.config.members))
        out.append(fx.SubmitGroups(groups=specs))

    # ------------------------------------------------------------------------- results

    def _reported(self, ev: Reported, out: list[fx.Effect]) -> None:
        iid = ev.instance_id
        partial: list[str] = []
        finished: list[str] = []
        for o in ev.outcomes:
            e = self.ledger.get(o.trajectory_id)
            if e is None or e.where is not Where.RUNNING or e.instance != iid:
                # aborted (settled) while the instance worked on it, or not ours any more
                self.counters["late_outcomes"] += 1
                self.report.wasted(max(o.generated - (e.generated if e else 0), 0))
                continue
            self.report.generated(max(o.generated - e.generated, 0))
            if o.finish is None:
                self.ledger.requeue(o.trajectory_id, o.generated)
                partial.append(o.trajectory_id)
            else:
                self.ledger.finish(o.trajectory_id, o.generated)
                finished.append(o.trajectory_id)
        if partial and iid in self.coordinator.instances:
            self.coordinator.on_interrupted(iid, partial)
        if finished:
            self.coordinator.on_finished(finished)
            out.append(fx.Score(trajectory_ids=finished))
        for tid, reason in ev.dropped:  # the store cannot run it (dropped there): nor can we
            e = self.ledger.get(tid)
            if e is None or e.where is not Where.RUNNING or e.instance != iid:
                continue  # settled, or moved, meanwhile
            self.counters["store_dropped"] += 1
            self._drop_ids([tid], reason)
            self._drop_group(e.group, reason, out)  # its group can no longer complete
        if ev.snapshot is not None and iid in self.coordinator.instances:
            self._snapshots[iid] = ev.snapshot
            self.report.instance_load(iid, ev.at, ev.snapshot)

    def _rewarded(self, ev: Rewarded, out: list[fx.Effect]) -> None:
        n = self.config.group_size
        for r in ev.rewards:
            e = self.ledger.get(r.trajectory_id)
            if e is None or e.where is not Where.FINISHED or e.reward is not None:
                continue  # dropped while it was scored
            gid = e.group
            if r.score is None:
                self.counters["reward_dropped"] += 1
                self._reward_fail_streak += 1
                self._drop_group(gid, f"reward_failed: {r.reason or 'unknown'}"[:200], out)
                if self._reward_fail_streak >= self.config.reward_failures_in_row:
                    self.halt(
                        "reward",
                        f"the reward failed for {self._reward_fail_streak} trajectories in a row "
                        f"(reward.max_failures_in_row={self.config.reward_failures_in_row}); "
                        f"last error: {r.reason}",
                        out,
                    )
                    return
                continue
            self._reward_fail_streak = 0
            g = self.ledger.reward(r.trajectory_id, float(r.score))
            if len(g.rewarded) != n or self._group_state(gid) is not GroupState.RESERVED:
                continue
            kept = g.rewarded[:n]
            scores = [cast(float, self.ledger.entries[t].reward) for t in kept]
            if self.config.dynamic_sampling and len(set(scores)) == 1:
                self.counters["filtered"] += 1
                self._filtered_streak += 1
                self._drop_group(gid, "filtered: equal rewards", out)
                if self._filtered_streak >= self.config.filtered_limit:
                    self.halt(
                        "data",
                        f"dynamic sampling filtered {self._filtered_streak} groups in a row "
                        f"(every reward of each equal, last {scores[0]:g}; the limit, "
                        f"trainer.max_filtered_in_row, is {self.config.filtered_limit}): the "
                        "data is too easy or too hard for the model, or the reward is constant",
                        out,
                    )
                    return
                continue
            self._filtered_streak = 0
            for t in kept:
                self.protocol.finish(t)  # the n-th places the group (OCCUPIED)
            # never-admitted siblings can no longer join a complete group
            stray = [t for t in g.members if self._never_admitted(t)]
            if stray:
                self._drop_ids(stray, "group_surplus")
                out.append(fx.Drop(trajectory_ids=stray, reason="group_surplus"))

    def halt(self, component: str, reason: str, out: list[fx.Effect]) -> None:
        """The run cannot go on: ``Halt`` is the last effect, and the core takes no more
        events (:class:`CoreHalted`)."""
        self.halted = fx.Halt(component=component, reason=reason)
        out.append(self.halted)

    def _never_admitted(self, tid: str) -> bool:
        e = self.ledger.entries.get(tid)
        return e is not None and e.where is Where.QUEUED and e.v_traj is None

    def _drop_group(self, gid: str, reason: str, out: list[fx.Effect]) -> None:
        if self._group_state(gid) in (GroupState.RESERVED, GroupState.OCCUPIED):
            self.protocol.drop_group(gid, reason)  # its aborts are drained by _after_change
        self._close(gid, reason, out)

    def _close(self, gid: str, reason: str, out: list[fx.Effect]) -> None:
        """A closed group: its never-admitted members are dropped too, and the store discards
        whatever it holds of the group."""
        self._fresh.pop(gid, None)  # (also where the ledger forgot it: all members settled)
        g = self.ledger.groups.get(gid)
        if g is None or g.closed:
            return
        self.ledger.close_group(gid)
        # admitted members come back as the protocol's aborts; these it never saw
        self._drop_ids([t for t in g.members if self._never_admitted(t)], reason)
        out.append(fx.DropGroup(group_id=gid, reason=reason))

    def _promote_due(self) -> None:
        """Partly admitted groups the trainer's next batch can take: their never-routed
        members go before every fresh group (see :mod:`.ledger`). Under the buffer protocol,
        those reserved in the buffer the trainer takes next; under a FIFO one (no buffers:
        the first complete groups are trained), all of them."""
        due = self.protocol.next_buffer
        for gid in self.ledger.partly_admitted():
            try:
                buffer = self.protocol.group(gid).buffer
            except ProtocolError:
                continue
            if buffer is None or buffer <= due:
                self.ledger.promote(gid)

    def _group_state(self, gid: str) -> GroupState | None:
        try:
            return self.protocol.group(gid).state
        except ProtocolError:
            return None

    def _after_change(self, out: list[fx.Effect]) -> None:
        """Turn what the protocol decided during this event (its notices, drained here and
        nowhere else) into effects: aborts become commands on the instances or drops in the
        store, a group it closed is dropped whole, replacement prompts are fed next cycle."""
        notices = self.protocol.take_notices()
        if not notices:
            return
        aborts = [n for n in notices if isinstance(n, Abort)]
        if aborts:
            self._execute(self.coordinator.abort(aborts), out)
        for n in notices:
            if isinstance(n, GroupAborted):
                self._close(str(n.group_id), str(n.reason), out)
            elif isinstance(n, ReplacementRequest):
                self._replacements_due += 1

    @property
    def sync_fail_streak(self) -> Mapping[str, int]:
        """Consecutive failed syncs per instance (the Ray shell backs off by it)."""
        return self._sync_fail_streak

    # ------------------------------------------------------------------------- training

    def _maybe_train(self, out: list[fx.Effect]) -> None:
        if self.training is not None or self.done:
            return
        proto = self.protocol
        if not proto.ready():
            thr = proto.config.stuck_threshold
            waited = self.now - self._idle_since
            if thr and waited >= self.config.stuck_after_s and self.now > self._stuck_checked_at:
                self._stuck_checked_at = self.now
                if proto.resolve_stuck().resolved:
                    self.counters["stuck_resolved"] += 1
                    self._after_change(out)
            if not proto.ready():
                if self.config.stream_batch:
                    stream_settled(self, out)
                return
        batch = proto.consume()
        self.streamed.clear()
        ids: list[tuple[str, ...]] = []
        rewards: list[tuple[float, ...]] = []
        lengths: list[tuple[int, ...]] = []
        tokens = response = 0
        for members in batch.trajectory_ids:
            ids.append(tuple(str(t) for t in members))
            rs, ls = [], []
            for t in members:
                e = self.ledger.consume(str(t))
                tokens += e.tokens
                response += e.generated
                rs.append(cast(float, e.reward))
                ls.append(e.generated)
            rewards.append(tuple(rs))
            lengths.append(tuple(ls))
        self.training = fx.Train(
            version=batch.version,
            group_ids=tuple(str(g) for g in batch.group_ids),
            trajectory_ids=tuple(ids),
            staleness=tuple(tuple(int(s) for s in st) for st in batch.trajectory_staleness),
            rewards=tuple(rewards),
            tokens=tokens,
            response_tokens=response,
            response_lengths=tuple(lengths),
        )
        self.report.consumed(self.now, self.now - self._idle_since)
        out.append(self.training)
        self._after_change(out)  # a FIFO that drops what aged out (GcFifo) aborts at consume

    def _trained(self, ev: Trained, out: list[fx.Effect]) -> None:
        tr = self.training
        if tr is None or ev.version != tr.version + 1:
            raise ValueError(
                f"Trained(version={ev.version}) but the batch in training is "
                f"{None if tr is None else tr.version} (expected version {tr.version + 1 if tr else '-'})"
            )
        self.training = None
        self.steps_done += 1
        self.published = ev.version
        self.protocol.publish(ev.version)
        self._idle_since = self.now
        out.append(fx.Release(trajectory_ids=tr.flat_ids))
        row = self.report.step(
            step=self.steps_done,
            version=ev.version,
            at=self.now,
            batch=tr,
            counters=self.counters,
            queue_depth=self.ledger.level_counts(),
            in_flight=self._in_flight(),
            trainer=ev.metrics,
        )
        out.append(fx.Record(row=row))
        every = self.config.checkpoint_every
        last = self.steps_done >= self.config.steps
        if last or (every and self.steps_done % every == 0):
            out.append(fx.Checkpoint(step=self.steps_done))
        if last:
            self.done = True
            out.append(fx.Done(steps=self.steps_done))

    def _in_flight(self) -> int:
        return int(self.protocol.stats().trajectories_by_state.get("in_flight", 0))

    # ------------------------------------------------------------------------- queries

    def trajectory_state(self, tid: str) -> TrajectoryState | None:
        try:
            return self.protocol.trajectory(tid).state
        except ProtocolError:
            return None

    def pending_work(self) -> list[fx.Effect]:
        """What a restarted shell must (re)issue after :meth:`restore` — ask right after it,
        before feeding any event (an event may start new work): the rewards of finished
        trajectories not yet scored, and the batch in training (the trainer's step is
        idempotent per consumed version)."""
        unscored = [
            e.tid for e in self.ledger.live() if e.where is Where.FINISHED and e.reward is None
        ]
        out: list[fx.Effect] = [fx.Score(trajectory_ids=unscored)] if unscored else []
        if self.training is not None:
            out.append(self.training)
        return out

    def instances(self) -> list[str]:
        return list(self.coordinator.instances)

    def take_timeline(self) -> list[dict[str, Any]]:
        return self.report.take_timeline()

    # ------------------------------------------------------------------------- state

    def to_dict(self) -> dict[str, Any]:
        """The whole state, JSON-plain (the journal's base and the checkpoint)."""
        from staleflow_trainer.control.state import core_to_dict

        return core_to_dict(self)

    @classmethod
    def restore(
        cls, state: Mapping[str, Any], config: CoreConfig, *, prompt_len: Callable[[int], int]
    ) -> ControlCore:
        """A core in exactly the state :meth:`to_dict` wrote (the caller's dict is not
        aliased); refuses a state whose protocol ``config`` would run under other rules."""
        from staleflow_trainer.control.state import core_from_dict

        return core_from_dict(cls(config, prompt_len=prompt_len), state)


def _at_version(protocol: AnyProtocol, version: int) -> AnyProtocol:
    return type(protocol)(protocol.config, start_version=version)  # type: ignore[arg-type]
