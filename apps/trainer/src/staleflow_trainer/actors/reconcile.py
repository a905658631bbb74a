"""Bringing the other processes and a restored control core level, and checking they are.

After a control actor is replaced (its journal replayed) or a run resumes from a checkpoint,
the core's state is exact but the world may differ from it: effects of the last journaled
events may not have run, instances may have written results the core never saw, instances of
the old deployment are gone. :func:`world_to_core` asks the trajectory server (TS) and the
live instances and returns the events that bring the core level with them:

* every instance the core knows is stopped (live ones write back what they ran; the TS puts
  back in the queue what dead ones held); each trajectory the core believes runs there is
  reported with what the TS holds — finished (with its finish reason), back in the queue
  (with its response length) or dropped there (the core drops its group;
  :mod:`.in_store`) — and a dead instance leaves (``InstanceLost``);
* live instances the core does not know join (``InstanceJoined``);
* groups the core submitted that the TS lacks are submitted again, trajectories the TS holds
  that the core let go are dropped, consumed ones not yet released are released.

The rewards of finished trajectories not yet scored and the batch in training are re-issued
by the shell from :meth:`~staleflow_trainer.control.ControlCore.pending_work`.
:func:`ledger_report` is the end-of-run check that core, protocol and TS agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from staleflow_trainer.actors.in_store import in_store
from staleflow_trainer.actors.liveness import CallHung, answer_within, kill_actor
from staleflow_trainer.atomic_files import atomic_write_bytes, read_verified_bytes
from staleflow_trainer.control import ControlCore
from staleflow_trainer.control import effects as fx
from staleflow_trainer.control.checks import ledger_problems
from staleflow_trainer.control.events import Event, InstanceJoined, InstanceLost, Outcome, Reported
from staleflow_trainer.control.ledger import Where
from staleflow_trainer.errors import CheckpointError
from trajectory_server import LocationState
from trajectory_server.errors import TrajectoryServerError

log = structlog.get_logger(__name__)


STATE_FILE = "core.json"
TS_FILE = "trajectory_store.bin"
TRAINER_FILE = "trainer.pt"
LATEST_FILE = "latest"
RECORDS_FILE = "records.json"  # step records the driver had not confirmed written


async def write_checkpoint(
    root: Path, step: int, io: Any, *, state: Any, records: list[Any], keep: int
) -> Path:
    """``root/step_<k>``: the trainer's files, the trajectory store, the core's ``state`` and
    the unconfirmed step ``records``, written to a temp dir and renamed; ``latest`` then names
    it; only the newest ``keep`` step directories stay."""
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step_{step:06d}", root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    await io.trainer.save_checkpoint.remote(str(tmp))
    shutil.copyfile(await io.ts.save_checkpoint(), tmp / TS_FILE)
    atomic_write_bytes(tmp / STATE_FILE, json.dumps(state).encode())
    atomic_write_bytes(tmp / RECORDS_FILE, json.dumps(records).encode())
    shutil.rmtree(final, ignore_errors=True)
    tmp.replace(final)
    atomic_write_bytes(root / LATEST_FILE, final.name.encode())
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_records(ckpt: Path) -> list[dict[str, Any]]:
    """The step records a checkpoint holds that its run's driver had not confirmed written
    to ``metrics.jsonl`` when it was taken (none for a checkpoint without the file)."""
    path = ckpt / RECORDS_FILE
    if not path.exists():
        return []
    rows = json.loads(read_verified_bytes(path))
    return [dict(r) for r in rows]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint directory the ``latest`` pointer names, or None when there is none.

    Without a verifiable pointer (a crash between a step directory's rename and the pointer's
    write, or between the pointer's rename and its ``.sha256``'s; a partial copy; a deleted
    file), the newest step directory whose state verifies is used;
    step directories of which none verifies are refused, never silently ignored."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / LATEST_FILE
    if pointer.is_file():
        try:
            name = read_verified_bytes(pointer).decode().strip()
        except CheckpointError as e:  # the pointer and its .sha256 are two renames
            log.warning("latest_pointer_unverifiable", path=str(pointer), error=str(e)[:200])
        else:
            d = root / name
            if not d.is_dir():
                raise CheckpointError(
                    f"{pointer} names {d.name!r}, which does not exist", path=str(d)
                )
            return d
    steps = sorted(d for d in root.glob("step_*") if d.is_dir())
    for d in reversed(steps):
        try:
            read_verified_bytes(d / STATE_FILE)
        except CheckpointError as e:
            log.warning("checkpoint_unverifiable", path=str(d), error=str(e)[:200])
            continue
        log.warning("latest_pointer_missing", using=str(d))
        return d
    if steps:
        raise CheckpointError(
            f"{root} holds {len(steps)} step directories but no {LATEST_FILE!r} pointer, and "
            f"none of them verifies; move them away, or start a new run (run.resume=never)",
            path=str(root),
        )
    return None


async def world_to_core(
    core: ControlCore, io: Any, now: Callable[[], float], *, resumed: bool = False
) -> list[Event]:
    """The events (and store fix-ups, done here) that bring ``core`` level with the world.

    Every instance the core knows leaves and, if it is live, joins again at the version it
    really serves: its speculative state starts afresh from what the store holds. Only an
    instance that died is a loss of the run (counted); ``resumed``: the core's instances were
    the replaced deployment's, none of them is a loss."""
    events: list[Event] = []
    infos = await _restarted(io)
    live = set(infos)
    for iid in core.instances():
        await io.ts.instance_lost(iid)  # stale ownership (a dead or restarted process)
        events.append(await _as_in_store(core, io, iid, now()))
        events.append(InstanceLost(at=now(), instance_id=iid, setup=resumed or iid in live))
    for iid, info in infos.items():
        events.append(InstanceJoined(at=now(), instance_id=iid,
                                     kv_capacity_tokens=int(info["kv_capacity_tokens"]),
                                     version=int(info["version"]), setup=True))  # fmt: skip
    await _fix_store(core, io)
    return events


async def _restarted(io: Any) -> dict[str, dict[str, Any]]:
    """Stop every live instance and start it again (``quiesce``: it waits out a sync, stops
    everything and writes back what it ran; then ``start``), all at once, within
    ``coordinator.sync_timeout_s`` + ``coordinator.call_timeout_s`` in all: ``{id: start's
    answer}``. An instance that died or failed is left out; one that does not answer in time
    (a sync that hangs) is killed and left out too, with a loss record. Without the limit,
    one instance stuck in a sync held the recovery, and the run, for good."""
    c = io.cfg.coordinator
    limit_s = c.sync_timeout_s + c.call_timeout_s
    setting = "coordinator.sync_timeout_s + coordinator.call_timeout_s"

    async def restart(handle: Any) -> dict[str, Any]:
        await handle.quiesce.remote()  # everything it ran is written back to the TS
        return dict(await handle.start.remote())

    names = list(io.rollouts)
    calls = [
        answer_within(restart(io.rollouts[i]), limit_s, f"{i!r} quiesce and start", setting)
        for i in names
    ]
    answers = await asyncio.gather(*calls, return_exceptions=True)
    infos: dict[str, dict[str, Any]] = {}
    for iid, answer in zip(names, answers, strict=True):
        if not isinstance(answer, BaseException):
            infos[iid] = answer
            continue
        if isinstance(answer, CallHung):
            why = str(answer)
            log.error("instance_hung_at_recovery", instance=iid, error=why)
            with contextlib.suppress(Exception):  # one that died meanwhile needs no kill
                kill_actor(io.rollouts[iid])
        else:  # died meanwhile: treated as gone
            why = repr(answer)[:300]
            log.warning("instance_gone_at_recovery", instance=iid, error=why)
        io.rollouts.pop(iid, None)
        io.lost.append({"instance_id": iid, "error": why})
    return infos


async def _as_in_store(core: ControlCore, io: Any, iid: str, at: float) -> Reported:
    """What the TS holds of each trajectory the core believes runs on ``iid``: finished (with
    its finish reason), back in the queue (with its response length), or dropped there."""
    st = await in_store(io.ts, core.ledger.held_by(iid), iid)
    queued = [Outcome(trajectory_id=t, generated=g) for t, g in st.queued]
    return Reported(at=at, instance_id=iid, outcomes=[*st.finished, *queued], dropped=st.dropped)


def store_settlements(effects: Sequence[fx.Effect]) -> list[fx.Effect]:
    """What of a replayed batch's ``effects`` settles trajectories in the store — drops and
    releases — to carry again after a crash: the batch's events are in the journal but its
    effects may have stopped midway, and a group the core settled is forgotten, so recovery
    could no longer tell a dropped trajectory from a trained one. An interrupt that discards
    its output becomes a drop (the instances are stopped by recovery anyway)."""
    out: list[fx.Effect] = []
    for e in effects:
        if isinstance(e, fx.Drop | fx.DropGroup | fx.Release):
            out.append(e)
        elif isinstance(e, fx.Interrupt) and not e.requeue:
            out.append(fx.Drop(trajectory_ids=e.trajectory_ids, reason=e.reason))
    return out


async def _fix_store(core: ControlCore, io: Any) -> None:
    """Groups the TS lacks are submitted; what the core let go is dropped or released."""
    for gid, g in list(core.ledger.groups.items()):
        try:
            await io.ts.group(gid)
        except TrajectoryServerError:
            log.info("group_resubmitted", group_id=gid)
            await io.carry(fx.SubmitGroups(groups=[
                fx.GroupSpec(group_id=gid, row=g.row, members=len(g.members))
            ]))  # fmt: skip
    training = set(core.training.flat_ids) if core.training is not None else set()
    queued = [e.trajectory_id for e in await io.ts.queue_view(None)]  # every level
    finished = list(await io.ts.finished_ids())  # ids only: no payload comes here
    gone = [t for t in queued + finished if _let_go(core, t) and t not in training]
    drop = [t for t in gone if t in set(queued) or core.ledger.get(t) is not None]
    release = [t for t in gone if t not in set(drop)]
    if drop:
        log.info("recover_dropped", count=len(drop))
        await io.carry(fx.Drop(trajectory_ids=drop, reason="aborted"))
    if release:  # consumed and trained before the crash: only the release was missing
        await io.carry(fx.Release(trajectory_ids=release))


def _let_go(core: ControlCore, tid: str) -> bool:
    e = core.ledger.get(tid)
    return e is None or e.where in (Where.DROPPED, Where.CONSUMED)


async def ledger_report(core: ControlCore, io: Any) -> dict[str, Any]:
    """Counts and every disagreement between the core, its protocol and the TS (``problems``
    must be empty): each live trajectory is where the TS says, and the TS holds exactly the
    trajectories the core submitted."""
    problems = list(ledger_problems(core))
    live = list(core.ledger.live())
    if live:
        locs = await io.ts.locate([e.tid for e in live])
        for e, loc in zip(live, locs, strict=True):
            want = {
                Where.QUEUED: LocationState.QUEUED,
                Where.RUNNING: LocationState.RUNNING,
                Where.FINISHED: LocationState.FINISHED,
            }.get(e.where)
            if want is not None and loc.state is not want:
                problems.append(f"{e.tid}: {e.where.value} in the core, {loc.state.value} in TS")
            if want is LocationState.RUNNING and loc.instance_id != e.instance:
                problems.append(f"{e.tid}: on {e.instance} in the core, {loc.instance_id} in TS")
    counts = core.ledger.counts()
    stats = await io.ts.stats()
    submitted = core.feed.serial * core.config.members
    if stats.total != submitted:
        problems.append(f"the TS holds {stats.total} trajectories, the core submitted {submitted}")
    dropped = counts["dropped"] + counts["unadmitted"]
    if stats.dropped != dropped:
        problems.append(f"{stats.dropped} dropped in the TS, {dropped} in the core")
    return {
        "groups": core.feed.serial,
        "trajectories": submitted,
        "consumed": counts["consumed"],
        "in_flight": counts["queued"] + counts["running"],
        "waiting_consume": counts["finished"],
        "dropped": counts["dropped"] + counts["unadmitted"],
        "dropped_reasons": dict(core.ledger.dropped_reasons),
        "problems": problems,
        "steps_done": core.steps_done,
    }


async def histories(core: ControlCore, io: Any) -> dict[str, list[list[Any]]]:
    """The TS history of every trajectory submitted so far: ``tid → [[kind, instance_id,
    version, seq], ...]`` in order."""
    out: dict[str, list[list[Any]]] = {}
    for serial in range(core.feed.serial):
        gid = f"g{serial:06d}"
        for tid in await io.ts.group(gid):
            out[tid] = [[str(e.kind), e.instance_id, e.version, e.seq]
                        for e in await io.ts.history(tid)]  # fmt: skip
    return out
