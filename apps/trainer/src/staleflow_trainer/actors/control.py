"""The Ray control shell: feeds the control core events and carries out its effects.

Theory of operation
-------------------
Every decision is the :class:`~staleflow_trainer.control.ControlCore`'s; this actor does the
I/O. One asyncio loop runs a cycle every ``coordinator.snapshot_interval_s``, or sooner when
background work answers (a step trained, a sync done, rewards computed) or an instance has
results (each keeps a ``wait_results`` call waiting):

1. gather the events background work produced since the last cycle (rewards computed, syncs
   done or failed, a training step done, instances joined or lost), poll the instances
   (``Reported``: outcomes, already in the trajectory store, and a snapshot; an answer late
   by ``lanes.ANSWER_WAIT_S`` comes in a later cycle), and add ``Cycle``;
2. append that batch to the write-ahead journal (one fsync), then feed the events to the core
   one by one and carry out each event's effects before the next is fed (consecutive calls
   to different instances at the same time).

Effects name trajectories by id: instances take their work from the trajectory server (TS)
themselves (``submit`` routes there), reward workers and the trainer read payloads from it; the
control process sees ids, versions and token counts only. ``Sync``, ``Score`` and ``Train`` run
in the background and answer with events at a later cycle.

A control actor that dies loses nothing: a replacement (``recover=True``) restores the journal's
base state, replays its events without carrying out their effects again, then reconciles the
other processes with the core (:mod:`.reconcile`); a resumed run does so from its checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from staleflow_trainer.actors import liveness, log_relay, reconcile
from staleflow_trainer.actors.control_queries import ControlQueries
from staleflow_trainer.actors.fault_hooks import FaultHooks
from staleflow_trainer.actors.in_store import InStore
from staleflow_trainer.actors.reconcile import STATE_FILE, checkpoint_records, latest_checkpoint
from staleflow_trainer.actors.shell_io import POLL_RETRY_S, ShellIO
from staleflow_trainer.actors.write_ahead import WAL_DIR, WriteAheadLog
from staleflow_trainer.atomic_files import read_verified_bytes
from staleflow_trainer.config import AppConfig, from_dict
from staleflow_trainer.control import ControlCore, core_config
from staleflow_trainer.control import effects as fx
from staleflow_trainer.control.events import (
    Cycle,
    Event,
    InstanceJoined,
    Outcome,
    Reported,
    Reward,
    Rewarded,
    SyncDone,
    SyncFailed,
    Trained,
    event_from_dict,
    event_to_dict,
)
from staleflow_trainer.data.tokenize import PromptLengths
from staleflow_trainer.errors import ComponentLost

log = structlog.get_logger(__name__)
SETTLE_POLLS = 3  # rounds of polls that bring the core level with the store at the run's end
SETTLE_BACKGROUND_S = 60.0  # the run's end waits this long for background work, or call_timeout_s


class ControlActor(ControlQueries, FaultHooks):
    """Wrap with ``ray.remote``; async. ``run()`` returns when ``trainer.steps`` are done."""

    def __init__(
        self,
        *,
        cfg: Mapping[str, Any],
        prompts: PromptLengths,
        ts_address: Sequence[Any],
        ts_token: str,
        rollouts: Mapping[str, Any],
        trainer: Any,
        rewards: Sequence[Any],
        reward_spec: Mapping[str, Any] | None = None,
        resume_dir: str | None = None,
        recover: bool = False,
        driver_pid: int | None = None,
        relay_logs: bool = False,
    ) -> None:
        if relay_logs:  # its warnings and errors go to the run's output with each drain
            log_relay.relay_warnings()
        self.cfg: AppConfig = from_dict(cfg)
        self.io = ShellIO(
            self.cfg,
            prompts=prompts,
            ts_address=tuple(ts_address),
            ts_token=ts_token,
            rollouts=dict(rollouts),
            trainer=trainer,
            rewards=list(rewards),
            reward_spec=dict(reward_spec or {}),
            held_by=lambda iid: self.core.ledger.held_by(iid),
        )
        self._resume_dir = Path(resume_dir) if resume_dir else None
        self._recover = bool(recover)
        self._run_dir = Path(self.cfg.run.run_dir)
        self._wal = WriteAheadLog(self._run_dir / WAL_DIR)
        self.core: ControlCore
        self._t0 = time.monotonic()
        self._events: list[Event] = []  # from background work, fed at the next cycle
        self._records: list[dict[str, Any]] = []  # not yet drained
        self._unconfirmed: list[dict[str, Any]] = []  # not yet confirmed written (checkpointed)
        self._driver_pid = driver_pid  # on this node: the loop stops when it is gone
        self._stop = False
        self._running = False
        self._trains_running = 0  # train calls sent and not answered
        self._checkpointed = False
        self._init_fault_hooks()
        self._restored: dict[str, Any] | None = None
        self._log = log.bind(component="control")

    def now(self) -> float:
        return time.monotonic() - self._t0

    # ------------------------------------------------------------------------------- set-up

    async def setup(self) -> dict[str, Any]:
        await self.io.start()
        ccfg = core_config(self.cfg, rows=self.io.rows)
        replayed, settle = 0, list[fx.Effect]()
        if self._recover:  # the previous control actor died: its journal is the truth
            base, records = self._wal.load()
            self.core = ControlCore.restore(base, ccfg, prompt_len=self.io.prompt_len)
            for rec in records:
                for d in rec["events"]:
                    effects = self.core.handle(event_from_dict(d))
                    self._records.extend(dict(e.row) for e in effects if isinstance(e, fx.Record))
                    replayed += 1
                    if rec is records[-1]:  # its effects may not all have run before the crash
                        settle.extend(reconcile.store_settlements(effects))
            ckpt = latest_checkpoint(self._run_dir)
            if ckpt is not None:  # records of before the journal's base, maybe never drained
                self._records[:0] = checkpoint_records(ckpt)
            self._unconfirmed = list(self._records)
        elif self._resume_dir is not None:
            state = json.loads(read_verified_bytes(self._resume_dir / STATE_FILE))
            self.core = ControlCore.restore(state, ccfg, prompt_len=self.io.prompt_len)
            self._restored = {
                "protocol": self.core.protocol.to_dict(),
                "groups": {gid: g.row for gid, g in self.core.ledger.groups.items()},
            }
        else:
            self.core = ControlCore(ccfg, prompt_len=self.io.prompt_len)
        self._t0 = time.monotonic() - self.core.now  # the core's clock goes on
        if not self._recover:
            self._wal.reset(self.core.to_dict())
        work = self.core.pending_work()  # before any event: events may start new work
        for e in settle:  # the last batch's drops and releases (idempotent in the store)
            await self.io.carry(e)
        events = await reconcile.world_to_core(
            self.core, self.io, self.now, resumed=self._resume_dir is not None
        )
        await self._feed_batch(events)
        await self._carry(work)
        self._log.info("control_ready", steps_done=self.core.steps_done,
                       version=self.core.published, recovered=self._recover,
                       resumed=self._resume_dir is not None, replayed=replayed)  # fmt: skip
        return {"steps_done": self.core.steps_done, "version": self.core.published,
                "recovered": self._recover, "replayed": replayed,
                "training": None if self.core.training is None else self.core.training.version}  # fmt: skip

    # ------------------------------------------------------------------------------- the loop

    async def run(self) -> dict[str, Any]:
        period = self.cfg.coordinator.snapshot_interval_s
        self._running = True
        try:
            while not self.core.done and not self._stop:
                if self.io.fatal is not None:  # a component is gone: no new work, no polls
                    self._log.error("run_stopped", error=repr(self.io.fatal)[:500],
                                    steps_done=self.core.steps_done)  # fmt: skip
                    raise self.io.fatal
                if not self._driver_alive():
                    self._log.error("driver_gone_stopping", driver_pid=self._driver_pid,
                                    steps_done=self.core.steps_done)  # fmt: skip
                    return self.summary_now()
                t = time.monotonic()
                await self._cycle()
                await liveness.wait_or_timeout(self.io.wake, period - (time.monotonic() - t))
            await self._settle()
            if self.core.done:  # the last step's checkpoint: the state the run ends in
                await self.checkpoint()
                self._wal.compact(self.core.to_dict())
            return self.summary_now()
        except Exception as e:  # the loop's own failure: its traceback stays in this log
            if e is not self.io.fatal:  # (logged above)
                self._log.exception("run_failed", error=repr(e)[:500],
                                    steps_done=self.core.steps_done)  # fmt: skip
            raise
        finally:
            self._running = False

    async def stop(self) -> None:
        self._stop = True

    def _driver_alive(self) -> bool:
        """False once the driver (a process on this node) is gone: no one would write the
        step records any more, so the loop stops instead of training unobserved."""
        return self._driver_pid is None or liveness.process_alive(self._driver_pid)

    async def _cycle(self) -> None:
        self.io.wake.clear()
        events, self._events = self._events, []
        polls = await self.io.poll_all()
        at = self.now()
        events += self.io.take_late(at)  # calls that ended after their cycle
        events += await self._answers(polls, at)
        for iid, snap in self.io.views(at, polls).items():  # not polled: extrapolated
            events.append(Reported(at=at, instance_id=iid, outcomes=[], snapshot=snap))
        events.append(Cycle(at=at))
        await self._feed_batch(events)

    async def _answers(self, polls: Mapping[str, Any], at: float) -> list[Event]:
        """The events of ``poll_all``'s answers: an instance's report, or its loss."""
        out: list[Event] = []
        for iid, p in polls.items():
            if not isinstance(p, BaseException):
                out.append(self._reported(iid, p, at, await self.io.refused(iid, p)))
            elif (lost := await self.io.lose(iid, p, at)) is not None:
                out.append(lost)
        return out

    def _reported(self, iid: str, p: Mapping[str, Any] | None, at: float,
                  refused: InStore) -> Reported:  # fmt: skip
        p = p or {}  # None: nothing happened there
        outcomes = [Outcome(trajectory_id=str(t), generated=int(g), finish=f)
                    for t, g, f in p.get("outcomes", ())]  # fmt: skip
        ended = [o.trajectory_id for o in outcomes]  # before the refused ones join them
        # the TS refused to route these there: as it holds them (finished, queued or dropped)
        outcomes += [*refused.finished, *(Outcome(trajectory_id=t, generated=g)
                                          for t, g in refused.queued)]  # fmt: skip
        if p.get("errors"):
            self.core.counters["generate_errors"] = self.core.counters.get(
                "generate_errors", 0
            ) + len(p["errors"])
            self._log.warning("instance_errors", instance=iid, errors=p["errors"][:3])
        return Reported(at=at, instance_id=iid, outcomes=outcomes, dropped=refused.dropped,
                        snapshot=self.io.snapshot(iid, p.get("snapshot"), at, ended))  # fmt: skip

    async def _feed_batch(self, events: Sequence[Event]) -> None:
        if not events:
            return
        self._wal.append({"events": [event_to_dict(e) for e in events]})
        self._maybe_crash("after_journal")
        self._checkpointed = False
        for ev in events:
            await self._carry(self.core.handle(ev))
        # the journal's base moves only here, once every event of the batch is handled: a
        # checkpoint taken midway must not drop the batch's later events from the journal
        if self._checkpointed or self._wal.journal_bytes() > self._wal.compact_bytes:
            self._wal.compact(self.core.to_dict())

    async def _carry(self, effects: Sequence[fx.Effect]) -> None:
        hold: Mapping[str, Any] | None = None
        calls: list[fx.Effect] = []  # consecutive calls to instances: carried together
        for i, e in enumerate(effects):
            if calls and (i == len(effects) // 2 or not isinstance(e, fx.Route | fx.Interrupt)):
                self._events.extend(await self.io.carry_all(calls, self.now))
                calls = []
            if i == len(effects) // 2 and len(effects) > 1:
                self._maybe_crash("mid_effects")
            if hold is not None and not isinstance(e, fx.Checkpoint | fx.Done):
                await self._hold(hold)  # the step is complete; nothing new started yet
                hold = None
            if isinstance(e, fx.Record):
                self._records.append(dict(e.row))
                self._unconfirmed.append(dict(e.row))
                if self._hold_armed:
                    self._hold_armed = False
                    hold = e.row
            elif isinstance(e, fx.Checkpoint) and self.core.done:
                pass  # the last step's: written by run() once the instances stopped
            elif isinstance(e, fx.Checkpoint):
                await self.checkpoint()
            elif isinstance(e, fx.Sync):
                self.io.spawn(self._sync(e))
            elif isinstance(e, fx.Score):
                self.io.spawn(self._score(e.trajectory_ids))
            elif isinstance(e, fx.Train | fx.TrainPart):  # a part has no answer to wait for
                self.io.spawn(self._train(e) if isinstance(e, fx.Train) else self.io.train_part(e))
            elif isinstance(e, fx.Halt):
                raise ComponentLost(e.reason, component=e.component)
            elif isinstance(e, fx.Done):
                self._log.info("run_done", steps=e.steps)
            elif isinstance(e, fx.Route | fx.Interrupt):
                calls.append(e)
            else:
                self._events.extend(await self.io.carry_all([e], self.now))
        self._events.extend(await self.io.carry_all(calls, self.now))
        if hold is not None:
            await self._hold(hold)

    # --------------------------------------------------------------------------- background

    def _post(self, ev: Event) -> None:
        """An event from background work: the next cycle, which feeds it, starts now."""
        self._events.append(ev)
        self.io.wake.set()

    async def _sync(self, e: fx.Sync) -> None:
        streak = self.core.sync_fail_streak.get(e.instance_id, 0)
        delay = liveness.sync_retry_delay(streak, self.cfg.coordinator.sync_retry_backoff_s)
        await asyncio.sleep(delay)  # 0: none
        h = self.io.rollouts.get(e.instance_id)
        if h is None:
            return
        limit_s = self.cfg.coordinator.sync_timeout_s
        try:
            info = await liveness.answer_within(
                self.io.sync(e.instance_id, h, e.version), limit_s,
                f"sync to version {e.version}", "coordinator.sync_timeout_s")  # fmt: skip
            self._post(SyncDone(at=self.now(), instance_id=e.instance_id,
                                version=int(info["version"])))  # fmt: skip
        except asyncio.CancelledError:
            raise
        except Exception as err:
            hung = isinstance(err, liveness.CallHung)  # (a dead engine: found by the instance)
            if hung or liveness.is_actor_death(err):
                if hung:
                    err = self.io.end_instance(e.instance_id, f"sync to version {e.version}", err)
                if (lost := await self.io.lose(e.instance_id, err, self.now())) is not None:
                    self._post(lost)
            else:
                self._log.warning("sync_failed", instance=e.instance_id, error=repr(err)[:300])
                self._post(SyncFailed(at=self.now(), instance_id=e.instance_id,
                                      error=repr(err)[:300]))  # fmt: skip

    async def _score(self, ids: Sequence[str]) -> None:
        for rows in await self.io.score(list(ids)):
            rewards = [Reward(trajectory_id=str(t), score=None if s is None else float(s),
                              reason=None if s is not None else str(r))
                       for t, s, r in rows]  # fmt: skip
            self._post(Rewarded(at=self.now(), rewards=rewards))

    async def _train(self, e: fx.Train) -> None:
        self._trains_running += 1
        try:
            metrics = await self.io.train(e)
        except Exception as err:  # the trainer died or failed: the run cannot go on
            self._log.error("train_step_failed", error=repr(err)[:500])
            self.io.fatal = ComponentLost(f"the trainer failed during a step: {err!r:.500}",
                                          component="trainer")  # fmt: skip
            self.io.wake.set()  # the loop stops at its next turn
            return
        finally:
            self._trains_running -= 1
        version = int(metrics.pop("version"))
        self._post(Trained(at=self.now(), version=version, metrics=metrics))

    # --------------------------------------------------------------------------- checkpoint

    async def checkpoint(self) -> str:
        """``checkpoints/step_<k>``: the trainer, the trajectory store and the core's state,
        written to a temp dir and renamed; ``latest`` names it. The journal restarts from the end of
        the batch of events being handled."""
        self._maybe_crash("before_checkpoint")
        final = await reconcile.write_checkpoint(
            self._run_dir / "checkpoints", self.core.steps_done, self.io,
            state=self.core.to_dict(), records=self._unconfirmed,
            keep=self.cfg.run.keep_checkpoints,
        )  # fmt: skip
        self._checkpointed = True  # the journal restarts from the end of this batch
        self._log.info("checkpoint_written", step=self.core.steps_done, path=str(final))
        return str(final)

    # --------------------------------------------------------------------------- shutdown

    async def _settle(self) -> None:
        """Stop every instance and feed (journaled) what it ran: the core is then level with
        the store. Failed polls are tried again ``POLL_RETRY_S`` apart (one ended is lost, as
        in a cycle); any still unread is named in a warning (a resume reconciles it)."""
        # the answers to polls still out, and the calls still out, end within call_timeout_s
        events = await self._answers(await self.io.poll_all(wait_all=True, send=False), self.now())
        await self.io.wait_background(max(SETTLE_BACKGROUND_S, self.cfg.coordinator.call_timeout_s))
        await self.io.interrupt_all()  # due for a poll now (one that just failed: POLL_RETRY_S)
        answered: set[str] = set()
        for attempt in range(SETTLE_POLLS):
            if attempt:
                await asyncio.sleep(POLL_RETRY_S)  # a failed poll is due again then
            polls = await self.io.poll_all(wait_all=True)
            answered.update(i for i, p in polls.items() if not isinstance(p, BaseException))
            events += await self._answers(polls, self.now())
            if not (unread := sorted(set(self.io.rollouts) - answered)):
                break
        else:
            self._log.warning("settle_incomplete", instances=unread, polls=SETTLE_POLLS)
        events[:0], self._events = [*self._events, *self.io.take_late(self.now())], []
        await self._feed_batch(events)

    # --------------------------------------------------------------------------- membership

    async def add_instance(
        self, instance_id: str, handle: Any, *, kv_capacity_tokens: int, version: int
    ) -> None:
        """A new (or replacement) instance joins at the next cycle, serving ``version``; a
        duplicate id, a non-positive KV capacity or an unpublished version is refused here."""
        if not instance_id or instance_id in self.io.rollouts:
            raise ValueError(f"instance_id {instance_id!r} is empty or already part of the run")
        if int(kv_capacity_tokens) <= 0:
            raise ValueError(f"kv_capacity_tokens must be > 0, got {kv_capacity_tokens!r}")
        if not 0 <= int(version) <= self.core.published:
            raise ValueError(f"version must be in [0, {self.core.published}], got {version!r}")
        self.io.rollouts[instance_id] = handle
        self._events.append(InstanceJoined(at=self.now(), instance_id=instance_id,
                                           kv_capacity_tokens=int(kv_capacity_tokens),
                                           version=int(version)))  # fmt: skip
