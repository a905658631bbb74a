"""One rollout instance as an async actor: an engine adapter that takes its work from the
trajectory server and writes its output back there itself.

The control shell sends it ids and versions only; payloads move between this process and the
trajectory server (TS) directly:

* ``submit(version, ids)`` routes the trajectories to this instance in the TS (ownership moves
  here, V_traj is bound), reads their payloads from the answer and starts one ``generate``
  task each; ids the TS refuses are reported by the next ``poll`` as ``refused``. Ids travel
  packed (``engine_adapters.pack_ids``: the samples of one prompt as its id prefix and their
  numbers);
* results are written to the TS in batches — ``finish`` for finished trajectories,
  ``return_partial`` for interrupted ones, each carrying only the tokens generated here
  (``start`` = what the store already held) — before they are reported. A broken connection
  to the TS is reopened, a request whose answer was lost is settled by the store's view, and
  results the TS cannot be reached for are kept for a later poll (``instance_store``);
* ``wait_results(timeout_s)`` returns True as soon as a result waits to be reported or the
  control side's view of the instance is off (checked every ``DRIFT_CHECK_S`` while it
  generates), False after ``timeout_s``: the control shell polls an instance when it says so
  or was sent a command, and extrapolates its view in between;
* ``poll(ack, full)`` waits until the engine holds the work routed since the last poll
  (``admission``), writes what is pending, then returns the outcomes since the last poll (id,
  response length, finish reason or None; grouped by id prefix,
  ``rollout_wire.pack_outcomes``), each exactly once, and a snapshot taken after them as a
  delta from the last one sent (``engine_adapters.SnapshotEncoder``): the header fields that
  changed and the trajectories that started, changed pace or left, never a list of every
  running trajectory each poll; None when nothing happened (an engine that decodes at a
  steady pace included: the control side extrapolates its progress in time, see
  ``SNAPSHOT_TOLERANCE``);
* ``interrupt(ids, report)`` stops trajectories and writes their partial output back before
  returning; with ``report`` it answers with their response lengths (in the order of the ids
  sent, so no id comes back), and their outcomes do not come with the next poll;
* ``sync(version)`` interrupts everything, pulls ``version`` from the parameter server over NIXL
  and loads it in place (the engine never serves half-loaded weights; :mod:`.weight_sync`);
* ``quiesce()`` waits out a sync, interrupts everything and polls (a recovering control
  shell's first call); ``probe`` greedy-decodes a fixed prompt (tests check served weights).

An engine whose process died, or that fails every generation while it answers everything
else, ends this actor's process, so the control shell sees a dead instance
(:mod:`.engine_health`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import structlog

from engine_adapters import (
    EngineAdapter,
    EngineSnapshot,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    SnapshotEncoder,
    create_engine,
    pack_ids,
    unpack_ids,
)
from staleflow_trainer.actors.admission import admitted
from staleflow_trainer.actors.engine_health import EngineHealth
from staleflow_trainer.actors.fault_hooks import RolloutFaultHooks
from staleflow_trainer.actors.instance_store import (
    InstanceStore,
    Item,
    StoreUnreachable,
    generate_request,
)
from staleflow_trainer.actors.liveness import wait_or_timeout
from staleflow_trainer.actors.log_relay import KeepsWarnings
from staleflow_trainer.actors.rollout_wire import pack_outcomes
from staleflow_trainer.actors.weight_sync import WeightSync
from trajectory_server import Completion, Segment

log = structlog.get_logger(__name__)

#: How far the control side's view of an instance's progress may drift before a poll answer
#: corrects it: the decode-step counter (and so every running trajectory's token count) and
#: the KV use by this share of their change since the last correction (or their change over
#: one drift check), throughput by this share of the value last sent
#: (engine_adapters.SnapshotEncoder).
SNAPSHOT_TOLERANCE = 0.05
#: While it generates, the instance checks this often whether the control side's view of it is
#: off (``SnapshotEncoder.due``: a trajectory started, left or changed pace, progress drifted
#: past the tolerance); if so, ``wait_results`` answers True and the control side polls it.
#: Between those polls the control side extrapolates the view in time and sends no request.
DRIFT_CHECK_S = 0.1

#: How long an interrupt waits for the interrupted generations to come back before it writes
#: what it has (``coordinator.call_timeout_s`` must leave it this long).
INTERRUPT_WAIT_S = 30.0


def _finish(r: GenerateResult) -> FinishReason:
    """The TS finish reason of a finished result (one stopped at its token budget: length)."""
    return FinishReason.LENGTH if r.finish_reason is FinishReason.INTERRUPTED else r.finish_reason


class RolloutActor(WeightSync, EngineHealth, RolloutFaultHooks, KeepsWarnings):
    """Wrap with ``ray.remote(max_concurrency=...)``; every method is async."""

    def __init__(
        self,
        *,
        instance_id: str,
        backend: str,
        engine_kwargs: Mapping[str, Any],
        ts_address: Sequence[Any],
        ts_token: str | None,
        ps_address: Sequence[Any] | None = None,
        ps_token: str | None = None,
        generate_error_limit: int = 16,
        store_timeout_s: float = 60.0,
        lengths: Any = None,
    ) -> None:
        self._keep_warnings()
        self.instance_id = instance_id
        self._error_limit = generate_error_limit
        self._failed: set[str] = set()  # prompts failed since the last generation returned
        self._checking = False  # whether its engine serves is being asked
        self._dying = False
        self.backend = backend
        self.engine_kwargs = dict(engine_kwargs)
        self._lengths = lengths  # sim engines: the response lengths (sim.workload.GroupLengths)
        # each wait on the TS (connect, send, answer): coordinator.store_wait_s
        self._io = InstanceStore(instance_id, ts_address, ts_token, timeout_s=store_timeout_s)
        self._ps_address = tuple(ps_address) if ps_address else None
        self._ps_token = ps_token or None
        self._ps: Any = None
        self._engine: EngineAdapter | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._known: dict[str, int] = {}  # response tokens the TS held when it was routed here
        self._max_new: dict[str, int] = {}
        self._to_write: list[tuple[GenerateResult, bool]] = []  # (result, finished)
        self._outcomes: list[tuple[str, int, str | None]] = []  # (id, length, finish)
        # ids whose outcome an interrupt answered since the last poll (ended beside its delta)
        self._reported: set[str] = set()
        self._refused: list[str] = []
        self._routed: list[str] = []  # since the last poll, which waits until the engine has them
        self._errors: list[dict[str, Any]] = []
        # a full snapshot first; then the control side extrapolates progress, corrected if off
        self._encoder = SnapshotEncoder(tolerance=SNAPSHOT_TOLERANCE)
        self._write_lock = asyncio.Lock()
        self._ready = asyncio.Event()  # a result (or a correction) waits to be reported
        self._drift: asyncio.Task[None] | None = None
        self._health: asyncio.Task[None] | None = None
        self._polling = False  # a poll is being answered: no drift check meanwhile
        self._sync_lock = asyncio.Lock()
        self._syncs = 0
        self._log = log.bind(instance=instance_id)
        self._init_rollout_hooks()

    def _require(self) -> EngineAdapter:
        if self._engine is None:
            raise RuntimeError(f"rollout instance {self.instance_id!r} is not started")
        return self._engine

    async def start(self) -> dict[str, Any]:
        """Create and start the engine; returns ``instance_id``, ``version``, KV capacity."""
        if self._engine is None:
            t0 = time.perf_counter()
            engine = create_engine(self.backend, instance_id=self.instance_id, **self.engine_kwargs)
            await engine.start()
            self._engine = engine
            self._drift = asyncio.get_running_loop().create_task(self._check_drift())
            self._health = asyncio.get_running_loop().create_task(self._watch_health())
            self._log.info("rollout_started", seconds=round(time.perf_counter() - t0, 2))
        await self._io.connect()
        snap = await self._require().snapshot()
        return {
            "instance_id": self.instance_id,
            "version": snap.version,
            "kv_capacity_tokens": snap.kv_capacity_tokens,
        }

    async def submit(self, version: int, trajectory_ids: Sequence[Any]) -> int:
        """Take these queued trajectories from the TS (routing them here at ``version``, their
        V_traj for a partial) and start generating; returns how many started. The ids may
        come packed (``engine_adapters.pack_ids``)."""
        engine, ids = self._require(), unpack_ids(trajectory_ids)
        await self._maybe_hang_route(ids)  # fault tests only
        payloads, refused = await self._io.route(ids, int(version))
        for tid, error in refused:
            self._refused.append(tid)
            self._errors.append({"trajectory_id": tid, "error": error})
        started = 0
        for t in payloads:
            tid = t.trajectory_id
            if tid in self._tasks:  # already generating here (a lost route settled twice)
                continue
            # sim engines: the workload's length for this id (no length crosses the control
            # process); otherwise whatever the store's record carries
            cap = t.sampling.max_new_tokens
            target = None if self._lengths is None else self._lengths.of(tid, cap)
            target = t.target_length if target is None else target
            req = generate_request(t, target)
            self._known[tid] = len(req.generated_token_ids)
            self._max_new[tid] = int(cap)
            self._tasks[tid] = asyncio.get_running_loop().create_task(self._run(engine, req))
            self._routed.append(tid)
            started += 1
        await asyncio.sleep(0)  # let each task register with the engine before we return
        return started

    async def _run(self, engine: EngineAdapter, req: GenerateRequest) -> None:
        tid = req.trajectory_id
        failure: Exception | None = None
        try:
            result = await engine.generate(req)
            self._failed = set()
        except Exception as e:
            await self._end_if_dead(engine, e)
            # The engine refused or failed: a zero-progress interruption, so the trajectory
            # goes back to the queue with what it had; the cause is logged and reported.
            self._log.warning("generate_failed", trajectory_id=tid, error=repr(e))
            self._errors.append({"trajectory_id": tid, "error": repr(e)[:300]})
            failure = e
            result = GenerateResult(
                trajectory_id=tid,
                token_ids=req.generated_token_ids,
                logprobs=req.generated_logprobs,
                versions=req.generated_versions,
                finish_reason=FinishReason.INTERRUPTED,
            )
        finally:
            self._tasks.pop(tid, None)
        finished = result.finish_reason is not FinishReason.INTERRUPTED or len(
            result.token_ids
        ) >= self._max_new.get(tid, 1 << 30)
        self._to_write.append((result, finished))
        self._ready.set()
        if failure is not None:
            await self._count_failure(tid, failure)

    async def _snapshot(self, engine: EngineAdapter) -> EngineSnapshot:
        try:
            snap = await engine.snapshot()
        except Exception as e:
            await self._end_if_dead(engine, e)
            raise
        if snap.kv_used_tokens > snap.kv_capacity_tokens:
            snap = attrs.evolve(snap, kv_used_tokens=snap.kv_capacity_tokens)
        return snap

    async def _check_drift(self) -> None:
        """Every DRIFT_CHECK_S while generating: if the control side's view is off, ask it to
        poll (through ``wait_results``)."""
        while True:
            await asyncio.sleep(DRIFT_CHECK_S)
            engine = self._engine
            if engine is None or not self._tasks or self._ready.is_set() or self._polling:
                continue
            try:
                if self._encoder.due(await self._snapshot(engine)):
                    self._ready.set()
            except Exception as e:  # the engine is closing or failed: its calls will say so
                self._log.debug("drift_check_failed", error=repr(e)[:200])

    async def _flush(self) -> None:
        """Write every pending result to the TS (new tokens only), then queue its outcome. A
        result the TS could not be reached for stays pending, and the call fails."""
        async with self._write_lock:
            if not self._to_write:
                return
            pending, self._to_write = self._to_write, []
            done: list[Item] = []
            partial: list[Item] = []
            for r, finished in pending:
                tid = r.trajectory_id
                start = self._known.get(tid, 0)
                toks, lps, vers = r.token_ids[start:], r.logprobs[start:], r.versions[start:]
                if finished:
                    c = Completion(trajectory_id=tid, start=start, token_ids=toks, logprobs=lps,
                                   versions=vers, finish_reason=_finish(r))  # fmt: skip
                    done.append((c, r))
                else:
                    seg = Segment(trajectory_id=tid, start=start, token_ids=toks, logprobs=lps,
                                  versions=vers)  # fmt: skip
                    partial.append((seg, r))
            left: set[str] = set()
            for items, finished in ((done, True), (partial, False)):
                if left:  # the store could not be reached: keep the rest without trying
                    left.update(seg.trajectory_id for seg, _ in items)
                    continue
                written, refused, unresolved = await self._io.write(items, finished=finished)
                for _, r in written:
                    self._ended(r.trajectory_id)
                    reason = _finish(r) if finished else None
                    self._outcomes.append((r.trajectory_id, len(r.token_ids), reason))
                for (_, r), error in refused:
                    self._ended(r.trajectory_id)
                    self._errors.append({"trajectory_id": r.trajectory_id, "error": error})
                left.update(seg.trajectory_id for seg, _ in unresolved)
            if left:  # kept in the order they came, before those that came since
                self._to_write[:0] = [(r, f) for r, f in pending if r.trajectory_id in left]
                raise StoreUnreachable(
                    f"the trajectory server cannot be reached: {len(left)} results of "
                    f"{self.instance_id!r} are kept to write later",
                    instance_id=self.instance_id,
                )

    def _ended(self, tid: str) -> None:
        self._known.pop(tid, None)
        self._max_new.pop(tid, None)

    async def poll(self, ack: int | None = None, full: bool = False) -> list[Any] | None:
        """What happened since the last poll: ``[delta, outcomes, refused, errors]``, the
        trailing empty ones left out, None when there is nothing at all (no outcome, nothing
        changed). ``outcomes``: those since the last poll, each exactly once and already in
        the TS (``rollout_wire.pack_outcomes``); ``refused``: ids the TS refused to route here
        (``engine_adapters.pack_ids``); ``delta``: a snapshot taken after the outcomes, as a
        delta from the last one sent, decoded with ``engine_adapters.SnapshotDecoder`` given
        the ended ids (the outcomes' and those an ``interrupt(..., report=True)`` answer
        carried since the last poll); ``ack``, ``full``: what the decoder's ``request()``
        says. Raises ``StoreUnreachable`` if the TS cannot be reached: what it could not write
        is kept for the next poll."""
        engine = self._require()
        self._polling = True
        try:
            await self._maybe_hold_work()  # fault tests only
            routed, self._routed = self._routed, []  # the engine holds them first: admission
            await admitted(lambda: self._snapshot(engine), routed, self._tasks.__contains__)
            self._ready.clear()  # what arrives from here on sets it again
            await self._flush()
            snap = await self._snapshot(engine)
            # trajectories that ended before or while the snapshot was taken are reported
            # now, as outcomes, not as ids that left without one (and their outcome next time)
            await asyncio.sleep(0)
            await self._flush()
            outcomes, self._outcomes = self._outcomes, []
            refused, self._refused = self._refused, []
            errors, self._errors = self._errors, []
            await self._maybe_hold_poll(outcomes)  # fault tests only
            ended = {o[0] for o in outcomes} | self._reported
            self._reported = set()
            if any(r.trajectory_id in ended for r in snap.running):
                running = tuple(r for r in snap.running if r.trajectory_id not in ended)
                snap = attrs.evolve(snap, running=running)
            delta = self._encoder.encode(snap, ack=ack, full=full, ended=ended)
        finally:
            self._polling = False
        answer = [delta, pack_outcomes(outcomes), pack_ids(refused), errors]
        while answer and not answer[-1]:
            answer.pop()
        return answer or None

    async def wait_results(self, timeout_s: float) -> bool:
        """True as soon as a result waits to be reported by :meth:`poll`, or the control
        side's view of this instance is off (at once if either is already so), False after
        ``timeout_s`` without."""
        return await wait_or_timeout(self._ready, timeout_s)

    async def interrupt(
        self, trajectory_ids: Sequence[Any] | None = None, report: bool = False
    ) -> Any:
        """Stop these trajectories (None = all; the ids may come packed, see
        ``engine_adapters.pack_ids``); their partial output is in the TS when this returns,
        unless the TS cannot be reached: then it is kept and written by a later poll, whose
        answer brings their outcomes. Finished ones are skipped. Returns how many were stopped;
        their outcomes come with the next poll. With ``report``, it returns instead each id's
        outcome, in the order of the (unpacked) ids: its response length if it came back
        unfinished, ``[length, finish reason]`` if it had finished, None if its outcome was
        reported before, is kept for a later poll (or it never ran here); those outcomes do
        not come with the next poll."""
        engine = self._require()
        asked = None if trajectory_ids is None else unpack_ids(trajectory_ids)
        ids = list(self._tasks) if asked is None else [t for t in asked if t in self._tasks]
        if ids:
            try:
                await engine.interrupt(ids)
            except Exception as e:  # e.g. one finished between the check and the call
                await self._end_if_dead(engine, e)
                self._log.warning("interrupt_retry_each", error=repr(e))
                for t in ids:
                    if t in self._tasks:
                        try:
                            await engine.interrupt([t])
                        except Exception as e2:  # already gone
                            self._log.debug("interrupt_skipped", trajectory_id=t, error=repr(e2))
            tasks = [self._tasks[t] for t in ids if t in self._tasks]
            if tasks:
                await asyncio.wait(tasks, timeout=INTERRUPT_WAIT_S)
        try:
            await self._flush()
        except StoreUnreachable as e:  # kept: a later poll writes them and reports them
            self._log.warning("interrupt_results_kept", error=str(e)[:200])
        if not report:
            return len(ids)
        order = ids if asked is None else asked
        want = set(order)
        taken: dict[str, tuple[str, int, str | None]] = {}
        kept = []
        for o in self._outcomes:
            if o[0] in want and o[0] not in taken:
                taken[o[0]] = o
            else:
                kept.append(o)
        self._outcomes = kept
        self._reported.update(taken)
        return [
            None if o is None else o[1] if o[2] is None else [o[1], o[2]]
            for o in (taken.get(t) for t in order)
        ]

    async def quiesce(self) -> list[Any] | None:
        """Wait out a sync in progress (so the version reported is final), stop everything,
        and :meth:`poll`."""
        async with self._sync_lock:
            await self.interrupt(None)
        return await self.poll()

    async def probe(
        self, prompt_token_ids: Sequence[int], max_new_tokens: int = 4
    ) -> dict[str, Any]:
        """Greedy-decode a fixed prompt: ``{"version", "token_ids", "logprobs"}``."""
        engine = self._require()
        req = GenerateRequest(
            trajectory_id=f"probe-{self.instance_id}-{time.monotonic_ns()}",
            prompt_token_ids=list(prompt_token_ids),
            sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens),
        )
        r = await engine.generate(req)
        return {"version": engine.version, "token_ids": list(r.token_ids),
                "logprobs": list(r.logprobs)}  # fmt: skip

    async def stats(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "running": len(self._tasks), "syncs": self._syncs}

    async def close(self) -> None:
        for task in (self._drift, self._health):
            if task is not None:
                task.cancel()
        self._drift = self._health = None
        engine, self._engine = self._engine, None
        if engine is not None:
            await engine.close()
        if self._ps is not None:
            self._ps.close()
            self._ps = None
        await self._io.close()
