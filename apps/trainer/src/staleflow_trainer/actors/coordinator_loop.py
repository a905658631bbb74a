"""The control loop: owns the staleness protocol and the rollout coordinator, drives everything.

Theory of operation
-------------------
One asyncio task runs cycles every ``coordinator.snapshot_interval_s``. A cycle is linear and
owns every state change; background tasks (reward scoring, weight syncs, training steps) only
append *events* that the next cycle applies first. So protocol, trajectory server (TS) and the
bookkeeping here change only between ``await``s of one cycle, and a checkpoint taken while
applying a ``trained`` event is consistent.

1. apply events: reward outcomes (a group whose ``n`` kept members are rewarded is filtered —
   ``protocol.drop_group`` + ``ts.drop_group`` — or ``protocol.finish``-ed, which occupies its
   slot), sync done / failed (``coordinator.on_sync_done`` / ``on_sync_failed``), a finished
   training step (``protocol.publish(k+1)``, step metrics, maybe a checkpoint);
2. drain the protocol's notices (``take_notices``): aborts become the coordinator's commands
   (``coordinator.abort``), executed at once; keep the TS fed with fresh prompt groups from the
   data cursor (at least one batch of never-admitted groups queued, plus one per replacement
   the protocol asks for);
3. poll every rollout instance: results since the last poll (finished → ``ts.finish`` and off to
   a reward worker; interrupted → ``ts.return_partial``; anything the protocol no longer holds
   in flight → ``ts.drop``) and a snapshot taken after them;
4. ``coordinator.step(snapshots, ts.queue_view())`` → commands, executed before the next cycle:
   ``Route`` (``ts.route`` then ``rollout.submit``, batched per instance and version),
   ``Interrupt`` (``rollout.interrupt``; ``requeue=False`` also discards in the TS), ``Drop``
   (discard in the TS), ``Sync`` (background: the instance interrupts everything, pulls the
   version from the param server over NIXL and loads it);
5. train: when ``protocol.ready()`` and the trainer is idle, ``consume`` → commit the batch
   to the write-ahead journal → read its payloads from the TS → ``trainer.train_step``
   (background; the trainer pushes version k+1) → the payloads are released once it landed.
   If the trainer has waited longer than ``STUCK_AFTER_S`` and a stuck threshold is configured,
   ``protocol.resolve_stuck()``.

Only the coordinator calls ``reserve``; only this loop calls ``take_notices``. Every admitted trajectory ends consumed, or dropped in the TS with the
reason the protocol (or the reward runner, or the filter) gave — :meth:`CoordinatorActor.ledger`
checks exactly that.

Faults (docs/reliability.md)
----------------------------
* A rollout instance whose actor dies (any call to it raises ``RayActorError``) is *lost*:
  ``ts.instance_lost`` puts what it held back in the queue with the payload the store held,
  ``coordinator.remove_instance`` stops routing to it; the protocol keeps every reservation.
  :meth:`CoordinatorActor.add_instance` lets a replacement join (between cycles) at the
  version it already serves; the coordinator syncs it to the latest like any other instance.
* The trainer dying makes :meth:`run` raise :class:`ComponentLost`; the app restarts from its
  last checkpoint (``run.resume``).
* :meth:`CoordinatorActor.handover` stops this loop cleanly and returns its live state; a new
  actor built with ``handover_state=`` rebuilds its view from that state, the TS and fresh
  snapshots (the restart path of a coordinator that is replaced, not crashed).
* A coordinator that *crashes* loses nothing it decided: every protocol and bookkeeping change
  is committed to the write-ahead journal (:mod:`.write_ahead`, ``RUN_DIR/coordinator_wal``)
  before any effect that depends on it leaves this process (``_commit`` before TS submits,
  drops and routes, instance commands and the trainer call). A replacement built with
  ``recover=True`` replays the journal and reconciles the other processes forward to it
  (``_recover``): groups committed but never submitted are submitted, reservations never
  routed are served at their V_traj, work the TS shows on an instance that no longer runs it
  goes back to the queue, trajectories the protocol let go are dropped in the TS,
  finished-but-unrewarded ones are re-scored, and a batch consumed but not yet trained is
  trained (``TrainerActor.train_step`` is idempotent per consumed version: a step that already
  ran, or still runs, is not trained twice).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import attrs
import numpy as np
import structlog

from rollout_coordinator import (
    Coordinator,
    CoordinatorConfig,
    Drop,
    Interrupt,
    QueueView,
    Route,
    Sync,
)
from staleflow_trainer.actors.payloads import (
    completion_of,
    instance_snapshot,
    queued,
    request_from_trajectory,
    result_from_dict,
    segment_of,
)
from staleflow_trainer.actors.write_ahead import (
    WAL_DIR,
    JournaledProtocol,
    WriteAheadLog,
    replay_state,
)
from staleflow_trainer.atomic_files import atomic_write_bytes, read_verified_bytes
from staleflow_trainer.config import AppConfig, from_dict
from staleflow_trainer.data import DataCursor, load_records
from staleflow_trainer.errors import CheckpointError, ComponentLost, DataError
from staleflow_trainer.metrics import staleness_summary
from staleflow_trainer.protocol_mode import build_protocol, restore_protocol
from staleflow_trainer.protocol_mode import protocol_config as protocol_config  # re-export
from staleflow_trainer.trainer import should_drop_group
from staleness_protocol import (
    Abort,
    GroupState,
    ProtocolError,
    ReplacementRequest,
    StalenessProtocol,
    TrajectoryState,
)
from trajectory_server import LocationState, SamplingParams
from trajectory_server.client import TrajectoryClient
from trajectory_server.errors import TrajectoryServerError

log = structlog.get_logger(__name__)

STUCK_AFTER_S = 5.0  # trainer wait after which a stuck buffer may be resolved
STATE_FILE = "coordinator.json"
TS_FILE = "trajectory_store.bin"
TRAINER_FILE = "trainer.pt"
LATEST_FILE = "latest"
_CLOSED = (GroupState.ABORTED, GroupState.DROPPED)
#: where :meth:`CoordinatorActor.inject_crash` can make the process exit (fault tests)
CRASH_POINTS = ("after_commit_before_execute", "after_consume_commit", "mid_routes", "before_drop")
#: the small bookkeeping a commit writes per key when it changed (the group index is journaled
#: as new entries; the protocol as its calls)
_BOOK_KEYS = (
    "steps_done", "cursor", "fresh", "serial", "rewards", "rewarded", "counters", "training",
    "outbox", "replacements_due",
)  # fmt: skip


def group_of(trajectory_id: str) -> str:
    """The trajectory server names group members ``<group_id>/<i>``."""
    return trajectory_id.rsplit("/", 1)[0]


def coordinator_config(cfg: AppConfig) -> CoordinatorConfig:
    """The coordinator's config: the same translation the control core uses."""
    from staleflow_trainer.control.config import coordinator_config as from_app

    return from_app(cfg)


def sync_retry_delay(failures_in_row: int, backoff_s: float) -> float:
    """Seconds to wait before a sync after ``failures_in_row`` failed ones: 0 for the first
    try, then ``backoff_s`` doubling per failure, capped at 30 s."""
    if failures_in_row <= 0 or backoff_s <= 0:
        return 0.0
    return float(min(30.0, backoff_s * 2 ** (failures_in_row - 1)))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint directory the ``latest`` pointer names, or None."""
    pointer = Path(run_dir) / "checkpoints" / LATEST_FILE
    if not pointer.is_file():
        return None
    d = pointer.parent / read_verified_bytes(pointer).decode().strip()
    if not d.is_dir():
        raise CheckpointError(f"{pointer} names {d.name!r}, which does not exist", path=str(d))
    return d


class CoordinatorActor:
    """Wrap with ``ray.remote``; async. ``run()`` returns when ``trainer.steps`` are done."""

    def __init__(
        self,
        *,
        cfg: Mapping[str, Any],
        model_path: str,
        ts_address: Sequence[Any],
        ts_token: str,
        rollouts: Mapping[str, Any],
        instances: Mapping[str, Mapping[str, Any]],
        trainer: Any,
        rewards: Sequence[Any],
        resume_dir: str | None = None,
        handover_state: Mapping[str, Any] | None = None,
        recover: bool = False,
    ) -> None:
        self.cfg: AppConfig = from_dict(cfg)
        self._recover_wal = bool(recover)
        self._handover = dict(handover_state) if handover_state is not None else None
        self._model_path = model_path
        self._ts_address = tuple(ts_address)
        self._ts_token = ts_token
        self._rollouts = dict(rollouts)
        self._instances = {k: dict(v) for k, v in instances.items()}
        self._trainer = trainer
        self._rewards = list(rewards)
        self._resume_dir = Path(resume_dir) if resume_dir else None
        self._run_dir = Path(self.cfg.run.run_dir)
        self._ckpt_root = self._run_dir / "checkpoints"
        self._ts: Any = None
        self._t0 = time.monotonic()
        self._n_keep = self.cfg.protocol.group_size
        self._n_submit = self.cfg.protocol.group_size + self.cfg.protocol.group_redundancy
        self._max_new = self.cfg.rollout.sampling.max_new_tokens
        self._steps_target = self.cfg.trainer.steps
        # bookkeeping (checkpointed)
        self._groups: dict[str, int] = {}  # every group ever submitted -> record index
        self._fresh: set[str] = set()  # submitted, no member admitted yet
        self._serial = 0
        self._rewards_of: dict[str, float] = {}
        self._rewarded: dict[str, list[str]] = {}  # group -> rewarded members, in order
        self._steps_done = 0
        self._replacements_due = 0  # replacement prompts asked for, not yet submitted
        self._counters: dict[str, int] = dict.fromkeys(
            (
                "routes",
                "syncs",
                "sync_failures",
                "migrations",
                "bounces",
                "interrupts",
                "aborts",
                "filtered",
                "reward_dropped",
                "replacements",
                "stuck_resolved",
                "generate_errors",
                "ts_refusals",
                "instances_lost",
                "instances_joined",
                "lost_requeued",
            ),
            0,
        )
        # transient
        self._events: list[tuple[str, Any]] = []
        self._reward_pending: set[str] = set()
        self._syncing: dict[str, asyncio.Task[None]] = {}
        #: consecutive failed syncs per instance (reset by a successful one); backoff + limit
        self._sync_failures_in_row: dict[str, int] = {}
        self._train_task: asyncio.Task[None] | None = None
        self._known_len: dict[str, int] = {}
        # reserved by a coordinator that was restarted before handing them out: still queued
        # as new in the TS; served as partials at their V_traj (never reserved twice)
        self._reserved_unrouted: dict[str, int] = {}
        self._tokens_step = 0
        self._tokens_total = 0
        self._last_step_t = time.monotonic()
        self._wait_since = time.monotonic()
        self._records: list[dict[str, Any]] = []  # committed, not yet drained
        self._uncommitted: list[dict[str, Any]] = []  # step records awaiting their commit
        # write-ahead journal (see .write_ahead): the batch being trained, groups not yet
        # journaled, and the bookkeeping as last written
        self._wal = WriteAheadLog(self._run_dir / WAL_DIR)
        self._training: dict[str, Any] | None = None
        self._new_groups: list[list[Any]] = []
        self._book_written: dict[str, Any] = {}
        self._crash_at: str | None = None
        self._hold_armed = False
        self._held_at: dict[str, Any] | None = None
        self._hold_release = asyncio.Event()
        self._timeline: list[dict[str, Any]] = []
        self._inst_state: dict[str, list[Any]] = {}  # iid -> [state, since_s, version]
        self._busy_acc: dict[str, float] = {}
        self._last_cycle_t = time.monotonic()
        self._step_counters: dict[str, int] = dict(self._counters)
        self._stop = False
        self._running = False
        self._done = asyncio.Event()
        self._lost: list[dict[str, Any]] = []  # instances lost: iid, requeued ids, when
        self._log = log.bind(component="coordinator_loop")

    # ------------------------------------------------------------------------------- set-up

    async def setup(self) -> dict[str, Any]:
        from transformers import AutoTokenizer

        cfg = self.cfg
        self._tok = AutoTokenizer.from_pretrained(self._model_path)
        self._eos = self._tok.eos_token_id
        self._records_data = load_records(cfg)
        self._cursor = DataCursor(
            len(self._records_data), seed=cfg.run.seed, shuffle=cfg.data.shuffle
        )
        self._rng = np.random.default_rng([cfg.run.seed, 17])
        state: dict[str, Any] | None = None
        if self._recover_wal:  # the previous coordinator crashed: its journal is the truth
            base, records = self._wal.load()
            journaled, state = replay_state(
                base, records, restore=lambda d: restore_protocol(d, cfg)
            )
            self.protocol = journaled.inner
            self._restore_bookkeeping(state)
        elif self._handover is not None:
            state = self._handover
            self.protocol = restore_protocol(state["protocol"], cfg)
            self._restore_bookkeeping(state)
        elif self._resume_dir is not None:
            state = json.loads(read_verified_bytes(self._resume_dir / STATE_FILE))
            self.protocol = restore_protocol(state["protocol"], cfg)
            self._restore_bookkeeping(state)
        else:
            self.protocol = build_protocol(cfg)  # eta unbounded: an UnboundedFifo, same methods
        self.protocol = JournaledProtocol(self.protocol)
        if not self._recover_wal:  # a new journal from this state; recovery commits on top
            self._wal.reset(self._state_dict(wal=True))
            self._book_written = self._book()
        version = self.protocol.next_buffer
        # instances sync to the protocol's published_version: behind next_buffer by one while
        # a consumed batch trains (a coordinator recovered mid-step must not sync to it yet)
        self.coordinator = Coordinator(
            coordinator_config(cfg), cast(StalenessProtocol, self.protocol), time.monotonic
        )
        for iid, info in self._instances.items():
            self.coordinator.add_instance(
                iid,
                kv_capacity_tokens=int(info["kv_capacity_tokens"]),
                version=int(info.get("version", self._steps_done)),
            )
            self._inst_state[iid] = ["idle", 0.0, self._steps_done]
            self._busy_acc[iid] = 0.0
        self._ts = await TrajectoryClient.connect(*self._ts_address, token=self._ts_token)
        requeued = 0
        if self._handover is not None or self._recover_wal:
            await self._settle_instances()
        if state is not None:
            requeued = await self._recover()
        self._commit()
        self._log.info(
            "loop_ready",
            version=version,
            resumed=state is not None,
            recovered=self._recover_wal,
            requeued=requeued,
            steps_done=self._steps_done,
        )
        return {
            "version": version,
            "steps_done": self._steps_done,
            "requeued": requeued,
            "recovered": self._recover_wal,
            "training": None if self._training is None else int(self._training["version"]),
        }

    def _restore_bookkeeping(self, state: Mapping[str, Any]) -> None:
        self._cursor.load_state_dict(state["cursor"])
        self._groups = {str(k): int(v) for k, v in state["groups"].items()}
        self._fresh = set(state["fresh"])
        self._serial = int(state["serial"])
        self._rewards_of = {str(k): float(v) for k, v in state["rewards"].items()}
        self._rewarded = {str(k): list(v) for k, v in state["rewarded"].items()}
        self._steps_done = int(state["steps_done"])
        self._replacements_due = int(state.get("replacements_due", 0))
        self._counters.update(state["counters"])
        self._step_counters = dict(self._counters)
        self._rng = np.random.default_rng([self.cfg.run.seed, 17, self._steps_done])
        self._training = state.get("training")
        self._records = list(state.get("outbox", []))
        self._book_written = self._book()

    async def _recover(self) -> int:
        """After a restart: work the checkpoint saw on instances goes back to the queue (the
        protocol keeps its reservations); finished-but-unrewarded trajectories are re-scored."""
        requeued = 0
        await self._submit_missing_groups()
        for e in await self._ts.queue_view(None, level=None):
            if self._proto_state(e.trajectory_id) is TrajectoryState.IN_FLIGHT:
                self._reserved_unrouted[e.trajectory_id] = self.protocol.trajectory(
                    e.trajectory_id
                ).version
        self._fresh = {g for g in self._fresh if not self._known_group(g)}
        for iid in set(await self._ts_instances()):
            requeued += len(await self._ts.instance_lost(iid))
        await self._drop_let_go()
        training = {t for m in (self._training or {}).get("tids", []) for t in m}
        items = []
        for ft in await self._ts.finished():
            tid = ft.trajectory.trajectory_id
            if tid in self._rewards_of or tid in training:
                continue
            if self._proto_state(tid) is TrajectoryState.IN_FLIGHT:
                items.append(self._reward_item(ft.trajectory))
        self._dispatch_rewards(items)
        if self._training is not None:  # consumed, maybe trained: finish it (idempotent)
            self._launch_training()
        elif self._checkpoint_due() and self._checkpoint_missing():
            await self.checkpoint()  # the crash hit between a step and its checkpoint
        return requeued

    async def _submit_missing_groups(self) -> None:
        """Groups committed to the journal whose submission never reached the TS."""
        for gid in sorted(self._fresh):
            try:
                await self._ts.group(gid)
            except TrajectoryServerError:
                self._log.info("group_resubmitted", group_id=gid)
                await self._submit_group(gid, self._groups[gid])

    async def _drop_let_go(self) -> None:
        """Drop in the TS what the protocol already let go (aborted, dropped, closed groups)
        but the crashed loop had not dropped yet."""
        live = [e.trajectory_id for e in await self._ts.queue_view(None, level=None)]
        live += [ft.trajectory.trajectory_id for ft in await self._ts.finished()]
        gone = [
            t
            for t in live
            if self._proto_state(t) in (TrajectoryState.ABORTED, TrajectoryState.DROPPED)
            or (self._proto_state(t) is None and self._group_closed(group_of(t)))
        ]
        if gone:
            self._log.info("recover_dropped", count=len(gone))
            await self._discard(gone, "aborted")

    def _checkpoint_due(self) -> bool:
        every = self.cfg.run.checkpoint_every
        k = self._steps_done
        return k > 0 and ((every and k % every == 0) or k >= self._steps_target)

    def _checkpoint_missing(self) -> bool:
        try:
            latest = latest_checkpoint(self._run_dir)
        except CheckpointError:
            return True
        return latest is None or latest.name != f"step_{self._steps_done:06d}"

    async def _settle_instances(self) -> None:
        """A replaced coordinator's instances: stop everything they run and put what they
        produced into the TS (partials back in the queue, finished ones finished), so the view
        this loop rebuilds from the TS is complete and nothing still runs unseen."""
        for iid, h in list(self._rollouts.items()):
            try:
                p = await h.quiesce.remote()
            except Exception as e:  # died meanwhile: the loop's first poll handles it
                self._log.warning("settle_failed", instance=iid, error=repr(e))
                continue
            partial, finished = [], []
            for d in p["results"]:
                r = result_from_dict(d)
                if self._proto_state(r.trajectory_id) is not TrajectoryState.IN_FLIGHT:
                    continue  # the old loop already handled it or the protocol let it go
                if r.finished or len(r.token_ids) >= self._max_new:
                    finished.append(
                        completion_of(r, finish_reason=None if r.finished else "length")
                    )
                else:
                    partial.append(segment_of(r))
            if partial:
                await self._ts_batch("return_partial", iid, partial)
            if finished:
                await self._ts_batch("finish", iid, finished)
            snap = p["snapshot"]
            self.coordinator.remove_instance(iid)
            self.coordinator.add_instance(
                iid,
                kv_capacity_tokens=int(snap["kv_capacity_tokens"]),
                version=int(snap["version"]),
            )

    async def _ts_instances(self) -> list[str]:
        stats = await self._ts.stats()
        return list(stats.running_by_instance)

    # ------------------------------------------------------------------------------- the loop

    async def run(self) -> dict[str, Any]:
        period = self.cfg.coordinator.snapshot_interval_s
        self._last_step_t = self._wait_since = time.monotonic()
        self._running = True
        self._done.clear()
        try:
            while self._steps_done < self._steps_target and not self._stop:
                t = time.monotonic()
                await self._cycle()
                await asyncio.sleep(max(0.0, period - (time.monotonic() - t)))
            if self._train_task is not None:  # stop requested mid-step: let it land
                await self._train_task
                await self._apply_events()
            await self._quiesce()
            return await self.summary()
        finally:
            self._running = False
            self._done.set()

    async def stop(self) -> None:
        self._stop = True

    async def add_instance(
        self, instance_id: str, handle: Any, *, kv_capacity_tokens: int, version: int
    ) -> None:
        """A new (or replacement) rollout instance joins at the next cycle, serving
        ``version``; the coordinator syncs it to the latest published version as needed.
        A duplicate id, a non-positive KV capacity or a version outside [0, current] is refused
        here (ValueError naming the field), never inside the loop."""
        joining = {p[0] for k, p in self._events if k == "joined"}
        if not instance_id or instance_id in self._rollouts or instance_id in joining:
            raise ValueError(f"instance_id {instance_id!r} is empty or already part of the run")
        if int(kv_capacity_tokens) <= 0:
            raise ValueError(f"kv_capacity_tokens must be > 0, got {kv_capacity_tokens!r}")
        current = self.protocol.published_version
        if not 0 <= int(version) <= current:
            raise ValueError(f"version must be in [0, {current}], got {version!r}")
        self._events.append(("joined", (instance_id, handle, int(kv_capacity_tokens), version)))

    async def instances(self) -> list[str]:
        return list(self._rollouts)

    async def lost_instances(self) -> list[dict[str, Any]]:
        return list(self._lost)

    async def handover(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Stop the loop (a running step lands first), put everything the instances produced
        into the TS, wait for outstanding rewards, and return the live state a replacement
        coordinator starts from (``handover_state=``). This actor must not run again."""
        self._stop = True
        if self._running:
            await asyncio.wait_for(self._done.wait(), timeout_s)
        await self._collect_all()
        deadline = time.monotonic() + timeout_s
        while self._reward_pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            await self._apply_events()
        await self._apply_events()
        self._commit()
        return self._state_dict(wal=True)

    async def _collect_all(self) -> None:
        """Poll every instance once more and apply what it returned."""
        iids = list(self._rollouts)
        polls = await asyncio.gather(
            *(self._rollouts[i].poll.remote() for i in iids), return_exceptions=True
        )
        for iid, p in zip(iids, polls, strict=True):
            if isinstance(p, BaseException):
                await self._instance_lost(iid, p)
            elif p["results"]:
                await self._handle_results(iid, p["results"])

    async def _cycle(self) -> None:
        # Routes held for a sync are not in the TS's view of things yet: keep them out of the
        # queue view (also the ones released by a sync applied below: step() emits them).
        held = self.coordinator.pending.trajectory_ids()
        await self._apply_events()
        if self._steps_done >= self._steps_target:
            return
        await self._feed()
        iids = list(self._rollouts)
        got = await asyncio.gather(
            *(self._rollouts[i].poll.remote() for i in iids), return_exceptions=True
        )
        alive: list[str] = []
        polls: list[Mapping[str, Any]] = []
        for iid, p in zip(iids, got, strict=True):
            if isinstance(p, BaseException):
                await self._instance_lost(iid, p)
                continue
            alive.append(iid)
            polls.append(p)
        for iid, p in zip(alive, polls, strict=True):
            self._counters["generate_errors"] += len(p["errors"])
            if p["results"]:
                await self._handle_results(iid, p["results"])
        entries = await self._ts.queue_view(4096)
        now = time.monotonic()
        snaps = [instance_snapshot(p["snapshot"], time_s=now) for p in polls]
        self._account_timeline(alive, polls, now)
        held |= self.coordinator.pending.trajectory_ids()
        items = [queued(e) for e in entries if e.trajectory_id not in held]
        if self._reserved_unrouted:
            fix = self._reserved_unrouted
            items = [
                attrs.evolve(q, v_traj=fix[q.trajectory_id]) if q.trajectory_id in fix else q
                for q in items
            ]
            queue = QueueView.from_unordered(items)
        else:
            queue = QueueView(items)
        commands = self.coordinator.step(snaps, queue, now)
        await self._execute(commands)
        await self._maybe_train()
        self._commit()

    # --------------------------------------------------------------------------- feeding

    def _encode(self, idx: int) -> list[int]:
        rec = self._records_data[idx]
        if self.cfg.data.apply_chat_template:
            ids = self._tok.apply_chat_template(
                rec.chat_messages(), add_generation_prompt=True, tokenize=True
            )
        else:
            ids = self._tok(rec.prompt_text())["input_ids"]
        ids = [int(i) for i in cast(list[int], ids)]
        if not ids or len(ids) > self.cfg.data.max_prompt_len:
            raise DataError(
                f"row {rec.index}: prompt has {len(ids)} tokens; allowed 1..data.max_prompt_len="
                f"{self.cfg.data.max_prompt_len}",
                row=rec.index,
                field="prompt",
            )
        return ids

    def _target_lengths(self) -> list[int] | None:
        if self.cfg.rollout.backend != "sim":
            return None
        w = self.cfg.sim.workload
        draw = self._rng.lognormal(math.log(w.response_len_median), w.response_len_sigma, 1)
        base = int(np.clip(draw[0], 1, self._max_new))  # group-correlated lengths
        jitter = self._rng.integers(-1, 2, size=self._n_submit)
        return [int(np.clip(base + j, 1, self._max_new)) for j in jitter]

    async def _drain_notices(self) -> None:
        """Act on what the protocol decided: its aborts become the coordinator's commands,
        executed now; replacement requests are counted for the next feed."""
        notices = self.protocol.take_notices()
        self._replacements_due += sum(isinstance(n, ReplacementRequest) for n in notices)
        aborts = [n for n in notices if isinstance(n, Abort)]
        if aborts:
            await self._execute(self.coordinator.abort(aborts))

    async def _feed(self) -> None:
        await self._drain_notices()
        reqs, self._replacements_due = self._replacements_due, 0
        self._counters["replacements"] += reqs
        need = max(self.cfg.protocol.batch_size - len(self._fresh), 0) + reqs
        planned = []
        for _ in range(need):
            idx = self._cursor.next_index()
            gid = f"g{self._serial:06d}"
            self._serial += 1
            self._groups[gid] = idx
            self._new_groups.append([gid, idx])
            self._fresh.add(gid)
            planned.append((gid, idx))
        self._commit()  # write-ahead: a crash from here on resubmits what the TS lacks
        for gid, idx in planned:
            await self._submit_group(gid, idx)

    async def _submit_group(self, gid: str, idx: int) -> None:
        rec = self._records_data[idx]
        s = self.cfg.rollout.sampling
        serial = int(gid[1:]) + 1  # the serial after this group's (the seed it always used)
        await self._ts.submit_group(
            gid,
            self._encode(idx),
            self._n_submit,
            sampling=SamplingParams(
                temperature=s.temperature,
                top_p=s.top_p,
                max_new_tokens=s.max_new_tokens,
                stop_token_ids=() if self._eos is None else (int(self._eos),),
                seed=(self.cfg.run.seed * 1_000_003 + serial * 64) % (2**31),
            ),
            metadata={
                "index": rec.index,
                "ground_truth": rec.ground_truth,
                "data_source": rec.data_source,
                "extra_info": rec.extra_info,
            },
            target_lengths=self._target_lengths(),
        )

    # --------------------------------------------------------------------------- results

    def _proto_state(self, tid: str) -> TrajectoryState | None:
        try:
            return cast(TrajectoryState, self.protocol.trajectory(tid).state)
        except ProtocolError:
            return None

    def _known_group(self, gid: str) -> bool:
        try:
            self.protocol.group(gid)
        except ProtocolError:
            return False
        return True

    def _group_closed(self, gid: str) -> bool:
        try:
            return self.protocol.group(gid).state in _CLOSED
        except ProtocolError:
            return False

    async def _handle_results(self, iid: str, results: Sequence[Mapping[str, Any]]) -> None:
        finished, partial, gone = [], [], []
        for d in results:
            r = result_from_dict(d)
            tid = r.trajectory_id
            new = len(r.token_ids) - self._known_len.pop(tid, 0)
            self._tokens_step += max(new, 0)
            self._tokens_total += max(new, 0)
            if self._proto_state(tid) is not TrajectoryState.IN_FLIGHT:
                gone.append(tid)
            elif r.finished or len(r.token_ids) >= self._max_new:
                finished.append(r)
            else:
                partial.append(r)
        if gone:
            await self._discard(gone, "aborted")
        if partial:
            segs = [segment_of(r) for r in partial]
            await self._ts_batch("return_partial", iid, segs)
            self.coordinator.on_interrupted(iid, [r.trajectory_id for r in partial])
        if finished:
            comps = [
                completion_of(r, finish_reason=None if r.finished else "length") for r in finished
            ]
            done = await self._ts_batch("finish", iid, comps)
            self.coordinator.on_finished([r.trajectory_id for r in finished])
            self._dispatch_rewards([self._reward_item(ft.trajectory) for ft in done])

    async def _instance_lost(self, iid: str, error: BaseException) -> None:
        """``iid``'s actor died: what it held goes back to the queue (the protocol keeps the
        reservations), the coordinator stops routing to it. Idempotent."""
        if iid not in self._rollouts:
            return
        if not _is_actor_death(error):
            raise error
        del self._rollouts[iid]
        self._instances.pop(iid, None)
        task = self._syncing.pop(iid, None)
        if task is not None:
            task.cancel()
        requeued = list(await self._ts.instance_lost(iid))
        routed = self.coordinator.remove_instance(iid)
        for tid in requeued:
            self._known_len.pop(tid, None)
        state = self._inst_state.pop(iid, None)
        self._busy_acc.pop(iid, None)
        t = time.monotonic() - self._t0
        if state is not None and t > state[1]:
            self._timeline.append(
                {"instance": iid, "state": state[0], "start_s": state[1], "end_s": t,
                 "version": state[2]}
            )  # fmt: skip
        self._counters["instances_lost"] += 1
        self._counters["lost_requeued"] += len(requeued)
        self._lost.append(
            {"instance_id": iid, "requeued": requeued, "routed": routed, "error": repr(error)}
        )
        self._log.warning(
            "instance_lost", instance=iid, requeued=len(requeued), error=repr(error)[:200]
        )

    def _instance_joined(self, iid: str, handle: Any, kv: int, version: int) -> None:
        if iid in self._rollouts:
            raise ValueError(f"rollout instance {iid!r} is already part of the run")
        self._rollouts[iid] = handle
        self._instances[iid] = {"kv_capacity_tokens": kv, "version": version}
        self.coordinator.add_instance(iid, kv_capacity_tokens=kv, version=version)
        self._inst_state[iid] = ["idle", time.monotonic() - self._t0, version]
        self._busy_acc[iid] = 0.0
        self._counters["instances_joined"] += 1
        self._log.info("instance_joined", instance=iid, version=version)

    async def _ts_batch(self, op: str, iid: str, items: Sequence[Any]) -> list[Any]:
        """A batch TS call; if the store refuses the batch (all-or-nothing), retry one by one
        and discard what it still refuses (logged and counted)."""
        fn = getattr(self._ts, op)
        try:
            return list(await fn(iid, items))
        except TrajectoryServerError as e:
            self._log.warning("ts_batch_refused", op=op, instance=iid, error=str(e))
        out = []
        for it in items:
            try:
                out.extend(await fn(iid, [it]))
            except TrajectoryServerError as e:
                self._counters["ts_refusals"] += 1
                self._log.warning(
                    "ts_refused", op=op, instance=iid, trajectory_id=it.trajectory_id, error=str(e)
                )
        return out

    async def _discard(self, ids: Sequence[str], reason: str) -> None:
        """Drop in the TS what the protocol no longer holds; a closed group's never-admitted
        siblings go with it (otherwise they would sit in the queue forever)."""
        self._commit()  # write-ahead: the protocol decision first
        self._maybe_crash("before_drop")
        groups = {group_of(t) for t in ids}
        closed = {g for g in groups if self._group_closed(g)}
        for g in sorted(closed):
            reason_g = self.protocol.group(g).reason or reason
            try:
                await self._ts.drop_group(g, str(reason_g))
            except TrajectoryServerError as e:
                self._log.debug("drop_group_noop", group_id=g, error=str(e))
            self._fresh.discard(g)
        rest = [t for t in ids if group_of(t) not in closed]
        if rest:
            locs = await self._ts.locate(rest)
            live = [
                t
                for t, loc in zip(rest, locs, strict=True)
                if loc.state is not LocationState.DROPPED
            ]
            if live:
                await self._ts.drop(live, reason)

    # --------------------------------------------------------------------------- rewards

    def _reward_item(self, t: Any) -> dict[str, Any]:
        md = dict(t.metadata)
        return {
            "trajectory_id": t.trajectory_id,
            "response_ids": list(t.generated_token_ids),
            "data_source": md.get("data_source", "unknown"),
            "ground_truth": md.get("ground_truth", ""),
            "extra_info": md.get("extra_info") or {},
        }

    def _dispatch_rewards(self, items: list[dict[str, Any]]) -> None:
        if not items:
            return
        k = len(self._rewards)
        shards = [items[i::k] for i in range(k)]
        for worker, shard in zip(self._rewards, shards, strict=True):
            if shard:
                self._reward_pending.update(it["trajectory_id"] for it in shard)
                asyncio.get_running_loop().create_task(self._score(worker, shard))

    async def _score(self, worker: Any, shard: list[dict[str, Any]]) -> None:
        try:
            outcomes = await worker.score.remote(shard)
        except Exception as e:  # the worker died: drop with the reason, the run goes on
            outcomes = [
                {
                    "trajectory_id": it["trajectory_id"],
                    "score": None,
                    "dropped": True,
                    "reason": f"reward worker failed: {e!r}"[:200],
                }
                for it in shard
            ]
        self._events.append(("rewarded", outcomes))

    async def _apply_rewards(self, outcomes: Sequence[Mapping[str, Any]]) -> None:
        for o in outcomes:
            tid = str(o["trajectory_id"])
            self._reward_pending.discard(tid)
            gid = group_of(tid)
            if self._proto_state(tid) is not TrajectoryState.IN_FLIGHT:
                await self._discard([tid], "aborted")
                continue
            if o["dropped"]:
                self._counters["reward_dropped"] += 1
                reason = f"reward_failed: {o['reason']}"[:200]
                self.protocol.drop_group(gid, reason)
                await self._discard([tid], reason)
                continue
            self._rewards_of[tid] = float(o["score"])
            members = self._rewarded.setdefault(gid, [])
            members.append(tid)
            if len(members) < self._n_keep:
                continue
            kept = members[: self._n_keep]
            if self.protocol.group(gid).state is not GroupState.RESERVED or any(
                self._proto_state(t) is not TrajectoryState.IN_FLIGHT for t in kept
            ):
                continue
            if self.cfg.trainer.dynamic_sampling and should_drop_group(
                [self._rewards_of[t] for t in kept]
            ):
                self._counters["filtered"] += 1
                self.protocol.drop_group(gid, "filtered: equal rewards")
                await self._discard(kept, "filtered: equal rewards")
                continue
            for t in kept:
                self.protocol.finish(t)

    # --------------------------------------------------------------------------- commands

    async def _execute(self, commands: Sequence[Any]) -> None:
        self._commit()  # write-ahead: reservations and aborts before routes and drops
        if commands:
            self._maybe_crash("after_commit_before_execute")
        routes: dict[tuple[str, int], list[Route]] = {}
        jobs = []
        for c in commands:
            if isinstance(c, Route):
                routes.setdefault((c.instance_id, c.version), []).append(c)
            elif isinstance(c, Interrupt):
                jobs.append(self._interrupt(c))
            elif isinstance(c, Drop):
                self._counters["aborts"] += len(c.trajectory_ids)
                self.coordinator.on_dropped(c.trajectory_ids)
                jobs.append(self._discard(list(c.trajectory_ids), str(c.reason)))
            elif isinstance(c, Sync):
                self._start_sync(c.instance_id, c.to_version)
        for (iid, version), rs in routes.items():
            jobs.append(self._route(iid, version, rs))
        if jobs:
            await asyncio.gather(*jobs)

    async def _interrupt(self, c: Interrupt) -> None:
        ids = list(c.trajectory_ids)
        if c.requeue:
            key = "bounces" if c.reason == "bounce" else "migrations"
            self._counters[key] += len(ids)
        else:
            self._counters["aborts"] += len(ids)
            self.coordinator.on_dropped(ids)
        self._counters["interrupts"] += len(ids)
        h = self._rollouts.get(c.instance_id)
        if h is not None:
            try:
                await h.interrupt.remote(ids)
            except Exception as e:
                await self._instance_lost(c.instance_id, e)
        if not c.requeue:
            await self._discard(ids, str(c.reason))

    async def _route(self, iid: str, version: int, rs: Sequence[Route]) -> None:
        ids = [r.trajectory_id for r in rs]
        try:
            payloads = list(await self._ts.route(iid, ids, version))
        except TrajectoryServerError as e:
            self._log.warning("ts_route_refused", instance=iid, error=str(e))
            payloads = []
            for tid in ids:
                try:
                    payloads.extend(await self._ts.route(iid, [tid], version))
                except TrajectoryServerError as e1:
                    self._counters["ts_refusals"] += 1
                    self._log.warning("ts_route_skip", trajectory_id=tid, error=str(e1))
        routed = {t.trajectory_id for t in payloads}
        missing = [t for t in ids if t not in routed]
        if missing:
            self.coordinator.on_interrupted(iid, missing)
        for r in rs:
            if r.new:
                self._fresh.discard(r.group_id)
        if not payloads:
            return
        self._counters["routes"] += len(payloads)
        for t in payloads:
            self._known_len[t.trajectory_id] = len(t.generated_token_ids)
            self._reserved_unrouted.pop(t.trajectory_id, None)
        self._maybe_crash("mid_routes")  # routed in the TS, not yet on the instance
        try:
            acks = await self._rollouts[iid].submit.remote(
                [request_from_trajectory(t) for t in payloads]
            )
        except Exception as e:  # died between the poll and now: the TS requeues its work
            await self._instance_lost(iid, e)
            return
        refused = [a["trajectory_id"] for a in acks if not a["ok"]]
        if refused:
            self._log.warning("submit_refused", instance=iid, acks=[a for a in acks if not a["ok"]])
            by_id = {t.trajectory_id: t for t in payloads}
            segs = [segment_of(_as_result(by_id[t])) for t in refused]
            await self._ts_batch("return_partial", iid, segs)
            self.coordinator.on_interrupted(iid, refused)

    def _start_sync(self, iid: str, version: int) -> None:
        failures = self._sync_failures_in_row.get(iid, 0)
        delay = sync_retry_delay(failures, self.cfg.coordinator.sync_retry_backoff_s)

        async def job() -> None:
            try:
                if delay > 0:  # back off after failed syncs of this instance
                    await asyncio.sleep(delay)
                info = await self._rollouts[iid].sync.remote(version)
                self._events.append(("synced", (iid, int(info["version"]), info)))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if _is_actor_death(e):
                    self._events.append(("lost", (iid, e)))
                    return
                self._events.append(("sync_failed", (iid, repr(e))))

        self._syncing[iid] = asyncio.get_running_loop().create_task(job())

    # --------------------------------------------------------------------------- events

    async def _apply_events(self) -> None:
        while self._events:
            events, self._events = self._events, []
            for kind, payload in events:
                if kind == "rewarded":
                    await self._apply_rewards(payload)
                elif kind == "joined":
                    self._instance_joined(*payload)
                elif kind == "lost":
                    self._syncing.pop(payload[0], None)
                    await self._instance_lost(*payload)
                elif kind == "train_failed":
                    self._train_task = None
                    raise ComponentLost(
                        f"the trainer failed during a step: {payload}", component="trainer"
                    )
                elif kind in ("synced", "sync_failed") and payload[0] not in self._rollouts:
                    continue  # the instance was lost meanwhile
                elif kind == "synced":
                    iid, version, _info = payload
                    self._counters["syncs"] += 1
                    inst = self.coordinator.instances.get(iid)
                    if inst is not None and version < max(inst.version, inst.target_version):
                        # superseded: a snapshot already completed this sync and the coordinator
                        # has moved the instance on (greedy sync issues back-to-back syncs)
                        continue
                    self._syncing.pop(iid, None)
                    self._sync_failures_in_row.pop(iid, None)
                    self.coordinator.on_sync_done(iid, version)
                elif kind == "sync_failed":
                    iid, err = payload
                    self._syncing.pop(iid, None)
                    self._counters["sync_failures"] += 1
                    in_row = self._sync_failures_in_row.get(iid, 0) + 1
                    self._sync_failures_in_row[iid] = in_row
                    self._log.warning("sync_failed", instance=iid, error=err, in_row=in_row)
                    self.coordinator.on_sync_failed(iid)
                    if in_row > self.cfg.coordinator.sync_retries:
                        raise ComponentLost(
                            f"instance {iid} failed to sync {in_row} times in a row "
                            f"(coordinator.sync_retries={self.cfg.coordinator.sync_retries}); "
                            f"last error: {err}",
                            component=f"rollout:{iid}",
                        )
                elif kind == "trained":
                    await self._apply_trained(*payload)

    # --------------------------------------------------------------------------- training

    async def _maybe_train(self) -> None:
        if self._train_task is not None or self._steps_done >= self._steps_target:
            return
        now = time.monotonic()
        if not self.protocol.ready():
            if (
                self.protocol.config.stuck_threshold is not None
                and now - self._wait_since > STUCK_AFTER_S
            ):
                res = self.protocol.resolve_stuck()
                if res.resolved:
                    self._counters["stuck_resolved"] += 1
                    self._log.info("stuck_resolved", buffer=res.buffer, moved=len(res.moved))
            if not self.protocol.ready():
                return
        wait_s = now - self._wait_since
        batch = self.protocol.consume()
        self._training = {
            "version": int(batch.version),
            "groups": [str(g) for g in batch.group_ids],
            "tids": [[str(t) for t in m] for m in batch.trajectory_ids],
            "staleness": [[int(x) for x in st] for st in batch.trajectory_staleness],
            "rewards": {
                str(t): self._rewards_of.pop(str(t)) for m in batch.trajectory_ids for t in m
            },
            "wait_s": wait_s,
        }
        for gid in batch.group_ids:
            self._rewarded.pop(str(gid), None)
        self._commit()  # write-ahead: a crash from here on trains this batch exactly once
        self._maybe_crash("after_consume_commit")
        self._launch_training()
        # a FIFO that drops what aged out (GcFifo): tell the TS now, not next cycle
        await self._drain_notices()

    def _launch_training(self) -> None:
        """Train the committed batch (``self._training``) in the background: its samples are
        read from the TS (released only once the step is done), the trainer call is idempotent
        per consumed version."""
        tr = self._training
        assert tr is not None
        tids = [t for m in tr["tids"] for t in m]

        async def job() -> None:
            t0 = time.monotonic()
            try:
                samples = await self._samples(tr, tids)
                metrics = await self._trainer.train_step.remote(
                    samples, consumed_version=tr["version"]
                )
            except Exception as e:  # the trainer died or failed: the run cannot go on
                self._log.error("train_step_failed", error=repr(e)[:500])
                self._events.append(("train_failed", repr(e)[:500]))
                return
            stale = [s for st in tr["staleness"] for s in st]
            rewards = [tr["rewards"][t] for t in tids]
            self._events.append(
                ("trained", (tr["version"], stale, rewards, metrics, tr["wait_s"], t0, tids))
            )

        self._train_task = asyncio.get_running_loop().create_task(job())

    async def _samples(self, tr: Mapping[str, Any], tids: list[str]) -> list[dict[str, Any]]:
        """The training samples of a committed batch, from the TS's unreleased finished
        trajectories; none when the TS already released them (the step then ran: the trainer
        answers from its record of it)."""
        try:
            finished = {ft.trajectory.trajectory_id: ft for ft in await self._ts.finished(tids)}
        except TrajectoryServerError as e:
            self._log.info("training_batch_released", version=tr["version"], error=str(e)[:200])
            return []
        samples = []
        for gid, members, st in zip(tr["groups"], tr["tids"], tr["staleness"], strict=True):
            for tid, s in zip(members, st, strict=True):
                ft = finished[tid]
                t = ft.trajectory
                samples.append(
                    {
                        "group_id": str(gid),
                        "prompt_ids": list(t.prompt_token_ids),
                        "response_ids": list(t.generated_token_ids),
                        "rollout_logprobs": list(t.generated_logprobs),
                        "reward": float(tr["rewards"][tid]),
                        "truncated": str(ft.finish_reason) == "length",
                        "v_traj": int(t.v_traj or 0),
                        "staleness": int(s),
                    }
                )
        return samples

    async def _apply_trained(
        self,
        consumed: int,
        stale: list[int],
        rewards: list[float],
        metrics: Mapping[str, Any],
        wait_s: float,
        t_start: float,
        tids: list[str],
    ) -> None:
        version = int(metrics["version"])
        if version != consumed + 1:
            raise RuntimeError(f"trainer produced version {version} for buffer {consumed}")
        await self._release(tids)
        self._training = None
        self.protocol.publish(version)
        self._steps_done += 1
        now = time.monotonic()
        span = max(now - self._last_step_t, 1e-9)
        stats = await self._ts.stats()
        step_counts = {k: v - self._step_counters.get(k, 0) for k, v in self._counters.items()}
        record: dict[str, Any] = {
            "step": self._steps_done,
            "version": version,
            "tokens_per_s": self._tokens_step / span,
            **staleness_summary(stale),
            "reward_mean": float(np.mean(rewards)),
            "accuracy": float(np.mean([r >= 1.0 for r in rewards])),
            "trainer_wait_s": wait_s,
            "train_s": now - t_start,
            "step_s": span,
            "time_s": now - self._t0,
            "tokens": self._tokens_step,
            "instance_busy_frac": {k: v / span for k, v in sorted(self._busy_acc.items())},
            "syncs": step_counts["syncs"],
            "migrations": step_counts["migrations"] + step_counts["bounces"],
            "interrupts": step_counts["interrupts"],
            "aborts": step_counts["aborts"],
            "filtered": step_counts["filtered"],
            "queue_depth": {
                "queued": stats.queued,
                "running": stats.running,
                "finished": stats.finished,
                **{f"level_{k}": v for k, v in stats.queued_by_level.items()},
            },
            "trainer": {k: v for k, v in metrics.items() if k not in ("version", "reward_mean")},
        }
        self._uncommitted.append(record)
        self._tokens_step = 0
        self._last_step_t = now
        self._wait_since = now
        self._busy_acc = dict.fromkeys(self._busy_acc, 0.0)
        self._step_counters = dict(self._counters)
        self._train_task = None
        self._commit()  # the step is durable (and its record visible to drain) from here
        if self._checkpoint_due():
            await self.checkpoint()
        if self._hold_armed:  # a fault test kills the trainer here: between two steps
            self._hold_armed = False
            self._hold_release.clear()
            self._held_at = {
                "steps_done": self._steps_done,
                "version": version,
                "train_in_flight": self._train_task is not None,
                "checkpoint": str(latest_checkpoint(self._run_dir)),
            }
            self._log.info("held_between_steps", **self._held_at)
            await self._hold_release.wait()
            self._held_at = None

    async def _release(self, tids: list[str]) -> None:
        """Free a trained batch's payloads in the TS; after a crash some may be freed."""
        try:
            await self._ts.release(tids)
        except TrajectoryServerError:
            for t in tids:
                try:
                    await self._ts.release([t])
                except TrajectoryServerError as e:
                    self._log.debug("release_noop", trajectory_id=t, error=str(e)[:200])

    # --------------------------------------------------------------------------- checkpoint

    async def checkpoint(self) -> str:
        """Write ``checkpoints/step_<k>`` atomically (temp dir + rename + ``latest`` pointer)."""
        self._commit()
        k = self._steps_done
        self._ckpt_root.mkdir(parents=True, exist_ok=True)
        final = self._ckpt_root / f"step_{k:06d}"
        tmp = self._ckpt_root / f".tmp_step_{k:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        await self._trainer.save_checkpoint.remote(str(tmp))
        ts_path = await self._ts.save_checkpoint()
        shutil.copyfile(ts_path, tmp / TS_FILE)
        encoded = json.dumps(self._state_dict(wal=True)).encode()  # also the journal's new base
        atomic_write_bytes(tmp / STATE_FILE, encoded)
        shutil.rmtree(final, ignore_errors=True)
        tmp.replace(final)
        atomic_write_bytes(self._ckpt_root / LATEST_FILE, final.name.encode())
        kept = sorted(p for p in self._ckpt_root.glob("step_*") if p.is_dir())
        for old in kept[: -self.cfg.run.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        self._log.info("checkpoint_written", step=k, path=str(final))
        self._wal.compact(encoded=encoded)  # the journal restarts from this state
        return str(final)

    def _state_dict(self, *, wal: bool = False) -> dict[str, Any]:
        """Everything a restarted loop needs besides the TS (JSON-serialisable). ``wal``: the
        write-ahead base, which also holds the batch being trained and undrained records."""
        book = self._book()
        if not wal:
            book.pop("training")
            book.pop("outbox")
        return {
            "format": "staleflow-loop/1",
            "protocol": self.protocol.to_dict(),
            "groups": dict(self._groups),
            **book,
        }

    def _book(self) -> dict[str, Any]:
        """The bookkeeping besides protocol and group index, as fresh plain copies."""
        return {
            "steps_done": self._steps_done,
            "cursor": self._cursor.state_dict(),
            "fresh": sorted(self._fresh),
            "serial": self._serial,
            "rewards": dict(self._rewards_of),
            "rewarded": {k: list(v) for k, v in self._rewarded.items()},
            "counters": dict(self._counters),
            "training": None if self._training is None else dict(self._training),
            "outbox": [*self._records, *self._uncommitted],
            "replacements_due": self._replacements_due,
        }

    def _commit(self) -> None:
        """Write-ahead: make every change since the last commit durable (protocol calls, new
        groups, changed bookkeeping keys) before an effect that depends on it leaves this
        process. A no-op when nothing changed."""
        ops = self.protocol.take_ops()
        book = self._book()
        changed = {k: v for k, v in book.items() if self._book_written.get(k) != v}
        if not ops and not self._new_groups and not changed:
            return
        groups, self._new_groups = self._new_groups, []
        self._wal.append({"ops": ops, "groups": groups, "book": changed})
        self._book_written.update(changed)
        if self._uncommitted:
            self._records.extend(self._uncommitted)
            self._uncommitted = []
        if self._wal.journal_bytes() > self._wal.compact_bytes:
            self._wal.compact(self._state_dict(wal=True))

    def _maybe_crash(self, point: str) -> None:
        if self._crash_at == point:
            self._log.warning("injected_crash", point=point)
            os._exit(17)  # no handover, no cleanup: what a crashed process leaves behind

    # --------------------------------------------------------------------------- fault hooks

    async def inject_crash(self, point: str) -> None:
        """Make this process exit at the next ``point`` (one of :data:`CRASH_POINTS`)."""
        if point not in CRASH_POINTS:
            raise ValueError(f"point must be one of {CRASH_POINTS}, got {point!r}")
        self._crash_at = point

    async def hold_after_next_step(self) -> None:
        """Hold the loop after the next training step completes (its record committed, its
        checkpoint written if due, no other step started) until :meth:`release_hold`."""
        self._hold_armed = True

    async def held(self) -> dict[str, Any] | None:
        """Where the loop is held (``steps_done``, ``version``, ``train_in_flight``,
        ``checkpoint``), or None."""
        return None if self._held_at is None else dict(self._held_at)

    async def release_hold(self) -> None:
        self._hold_release.set()

    async def wal_stats(self) -> dict[str, Any]:
        """Write-ahead journal figures: appends, bytes, seconds (fsync included), max."""
        return {**self._wal.stats, "journal_bytes": self._wal.journal_bytes()}

    # --------------------------------------------------------------------------- timeline

    def _account_timeline(
        self, iids: Sequence[str], polls: Sequence[Mapping[str, Any]], now: float
    ) -> None:
        dt = now - self._last_cycle_t
        self._last_cycle_t = now
        t = now - self._t0
        for iid, p in zip(iids, polls, strict=True):
            snap = p["snapshot"]
            if iid in self._syncing or p.get("syncing"):
                state = "syncing"
            elif snap["running"] or snap["waiting"]:
                state = "busy"
            else:
                state = "idle"
            cur = self._inst_state[iid]
            if cur[0] == "busy":
                self._busy_acc[iid] += dt
            if state != cur[0] or snap["version"] != cur[2]:
                if t > cur[1]:
                    self._timeline.append(
                        {
                            "instance": iid,
                            "state": cur[0],
                            "start_s": cur[1],
                            "end_s": t,
                            "version": cur[2],
                        }
                    )
                self._inst_state[iid] = [state, t, int(snap["version"])]

    # --------------------------------------------------------------------------- shutdown

    async def _quiesce(self) -> None:
        """Stop generating (the last checkpoint already holds what resume needs)."""
        for task in list(self._syncing.values()):
            try:
                await asyncio.wait_for(task, 60)
            except Exception as e:  # a failed sync at shutdown changes nothing
                self._log.debug("sync_at_shutdown", error=repr(e))
        await asyncio.gather(
            *(h.interrupt.remote(None) for h in self._rollouts.values()), return_exceptions=True
        )
        t = time.monotonic() - self._t0
        for iid, (state, since, version) in self._inst_state.items():
            if t > since:
                self._timeline.append(
                    {
                        "instance": iid,
                        "state": state,
                        "start_s": since,
                        "end_s": t,
                        "version": version,
                    }
                )
            self._inst_state[iid] = ["idle", t, version]

    # --------------------------------------------------------------------------- queries

    async def drain(self) -> dict[str, Any]:
        """Step records and timeline rows produced since the last call (for the driver)."""
        records, self._records = self._records, []  # committed ones only
        timeline, self._timeline = self._timeline, []
        return {"records": records, "timeline": timeline, "steps_done": self._steps_done}

    async def summary(self) -> dict[str, Any]:
        st = self.protocol.stats()
        return {
            "steps_done": self._steps_done,
            "version": self.protocol.next_buffer,
            "tokens_total": self._tokens_total,
            "counters": dict(self._counters),
            "staleness_histogram": {str(k): v for k, v in st.staleness_histogram.items()},
            "aborts_by_reason": dict(st.aborts_by_reason),
            "groups_submitted": len(self._groups),
        }

    async def protocol_state(self) -> dict[str, Any]:
        return cast(dict[str, Any], self.protocol.to_dict())

    async def groups(self) -> dict[str, int]:
        """Every group submitted so far → the dataset row it was made from."""
        return dict(self._groups)

    async def held_by(self, instance_id: str) -> list[str]:
        """What the TS says ``instance_id`` is generating now."""
        return list(await self._ts.held_by(instance_id))

    async def histories(self) -> dict[str, list[list[Any]]]:
        """The TS ledger history of every trajectory submitted so far:
        ``tid → [[kind, instance_id, version, seq], ...]`` in order (``seq`` is the store's
        global event sequence number)."""
        out: dict[str, list[list[Any]]] = {}
        for gid in self._groups:
            for tid in await self._ts.group(gid):
                out[tid] = [
                    [str(e.kind), e.instance_id, e.version, e.seq]
                    for e in await self._ts.history(tid)
                ]
        return out

    async def ts_stats(self) -> dict[str, Any]:
        return attrs.asdict(await self._ts.stats())

    async def ledger(self) -> dict[str, Any]:
        """Every trajectory ever submitted: consumed, in flight, or dropped with a reason.

        ``problems`` lists any trajectory for which the TS and the protocol disagree in a way
        that would mean it was lost or counted twice; it must be empty.
        """
        counts = dict.fromkeys(("consumed", "in_flight", "dropped", "waiting_consume"), 0)
        reasons: dict[str, int] = {}
        problems: list[str] = []
        for gid in self._groups:
            members = list(await self._ts.group(gid))
            if len(members) != self._n_submit:
                problems.append(f"{gid}: {len(members)} members, expected {self._n_submit}")
            for tid, loc in zip(members, await self._ts.locate(members), strict=True):
                ps = self._proto_state(tid)
                if loc.state is LocationState.DROPPED:
                    counts["dropped"] += 1
                    reasons[loc.reason or "?"] = reasons.get(loc.reason or "?", 0) + 1
                    if ps in (
                        TrajectoryState.IN_FLIGHT,
                        TrajectoryState.FINISHED,
                        TrajectoryState.OCCUPIED,
                        TrajectoryState.CONSUMED,
                    ):
                        problems.append(f"{tid}: dropped in TS but {ps.value} in the protocol")
                elif ps is TrajectoryState.CONSUMED or (
                    ps is None and loc.state is LocationState.FINISHED
                ):  # the protocol retires consumed trajectories from its ledger at once
                    counts["consumed"] += 1
                    if loc.state is not LocationState.FINISHED:
                        problems.append(f"{tid}: consumed but {loc.state.value} in TS")
                elif ps in (TrajectoryState.ABORTED, TrajectoryState.DROPPED):
                    problems.append(
                        f"{tid}: {ps.value} in the protocol but {loc.state.value} in TS"
                    )
                elif ps is TrajectoryState.OCCUPIED or ps is TrajectoryState.FINISHED:
                    counts["waiting_consume"] += 1
                else:  # None (never admitted) or IN_FLIGHT: queued, running, or being rewarded
                    counts["in_flight"] += 1
        return {
            "groups": len(self._groups),
            "trajectories": len(self._groups) * self._n_submit,
            **counts,
            "dropped_reasons": reasons,
            "problems": problems,
            "steps_done": self._steps_done,
        }


def _is_actor_death(e: BaseException) -> bool:
    """True for Ray's "this actor is gone" errors (killed, crashed, its node died)."""
    try:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    except ImportError:  # pragma: no cover - the loop only runs under Ray
        return False
    return isinstance(e, (RayActorError, ActorDiedError, ActorUnavailableError))


def _as_result(t: Any) -> Any:
    """A payload the engine refused, as a zero-progress interrupted result."""
    from engine_adapters import FinishReason, GenerateResult

    return GenerateResult(
        trajectory_id=t.trajectory_id,
        token_ids=list(t.generated_token_ids),
        logprobs=list(t.generated_logprobs),
        versions=list(t.generated_versions),
        finish_reason=FinishReason.INTERRUPTED,
    )
