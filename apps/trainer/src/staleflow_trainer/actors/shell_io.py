"""The Ray control shell's I/O: what it sends to the trajectory server, the instances, the
reward workers and the trainer, and what comes back — ids, versions and token counts only.

:class:`ShellIO` carries out the effects that are one call or a few (submit groups, route,
interrupt, drop, release: :mod:`.effect_calls`), polls instances, scores and trains in the
background (:mod:`.background_calls`), and turns a dead instance into an ``InstanceLost`` event
with what the store held for it. An instance's
poll answer carries its snapshot as a delta (``engine_adapters.SnapshotEncoder``): one entry
when a trajectory starts or changes pace, not one per running trajectory per poll; a
``SnapshotDecoder`` per instance rebuilds the full snapshot here; an interrupt's answer carries
the interrupted trajectories' outcomes (their lengths, in the order of the ids sent), so they do
not travel again with a poll. Ids travel packed by prompt (``engine_adapters.pack_ids``). An
instance is polled only when it has something to say (see :meth:`ShellIO.poll_all`); between
polls its view is extrapolated in time (:meth:`ShellIO.views`). Finished payloads are freed in
the trajectory server with ``free`` (``release`` would send them back); the bytes that cross
this process are counted (``actors.io_bytes``). A live instance whose calls fail or hang leaves
the run: a failed poll is tried again, up to ``coordinator.instance_error_limit`` in a row; a
failed route or interrupt, or a call hung past its limit (``coordinator.poll_timeout_s`` for a
poll or route, ``coordinator.call_timeout_s`` for an interrupt), ends it at once
(:meth:`ShellIO.end_instance`). Calls to one instance go through its lane
(``actors.lanes``): a control cycle waits ``ANSWER_WAIT_S`` at most for them, and an answer
that comes later is handled in a later cycle (``EffectCalls.take_late``); the instance is
silent meanwhile (``actors.silence``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import structlog

from engine_adapters import SnapshotDecoder
from rollout_coordinator import InstanceSnapshot
from staleflow_trainer.actors.background_calls import BackgroundCalls
from staleflow_trainer.actors.effect_calls import EffectCalls
from staleflow_trainer.actors.group_submit import GroupSubmitter
from staleflow_trainer.actors.in_store import InStore, in_store
from staleflow_trainer.actors.io_bytes import ByteCounts, size
from staleflow_trainer.actors.lanes import ANSWER_WAIT_S, Lanes
from staleflow_trainer.actors.liveness import CallHung, answer_within, is_actor_death, kill_actor
from staleflow_trainer.actors.rollout_wire import poll_args, unpack_poll
from staleflow_trainer.actors.silence import Silence
from staleflow_trainer.config import AppConfig
from staleflow_trainer.control.events import InstanceLost, Outcome
from staleflow_trainer.data.tokenize import PromptLengths

log = structlog.get_logger(__name__)

#: how long (seconds) one ``wait_results`` call to an instance waits before it is made again
WATCH_S = 30

#: An instance that has been sent no command and whose watcher (``wait_results``) has not
#: called since its last poll is polled again only after this long (an instance that has no
#: ``wait_results``: only while it is idle, nothing running or waiting, at its last poll). A
#: lost instance is noticed sooner: its watcher's call fails, which asks for a poll.
QUIET_POLL_S = 30.0

#: A live instance whose poll failed is polled again this long after, and only then (its view
#: is extrapolated meanwhile), until ``coordinator.instance_error_limit`` polls in a row failed.
POLL_RETRY_S = 2.0

#: Why an instance is polled in a cycle (``ShellIO.byte_stats()["polls"]`` counts each):
POLL_REASONS = {
    "no_view": "never polled yet, or its last snapshot delta was refused (a full one is due)",
    "command": "a command (route, interrupt, sync) went to it since its last poll",
    "asked": "its watcher's wait_results answered: results wait, or its view is off",
    "retry": f"its last poll failed, POLL_RETRY_S ({POLL_RETRY_S:g} s) ago",
    "quiet": f"not polled for QUIET_POLL_S ({QUIET_POLL_S:g} s)",
    "unwatched": "it has no wait_results and had work at its last poll: polled every cycle",
}


class ShellIO(EffectCalls, BackgroundCalls):
    def __init__(
        self,
        cfg: AppConfig,
        *,
        prompts: PromptLengths,
        ts_address: tuple[Any, ...],
        ts_token: str,
        rollouts: dict[str, Any],
        trainer: Any,
        rewards: list[Any],
        reward_spec: dict[str, Any],
        held_by: Callable[[str], Sequence[str]] | None = None,
    ) -> None:
        self.cfg = cfg
        #: the trajectories the control core believes run on an instance (none: unknown)
        self.held_by: Callable[[str], Sequence[str]] = held_by or (lambda iid: ())
        self.prompts = prompts
        self.ts_address = ts_address
        self.ts_token = ts_token
        self.rollouts = rollouts
        self.trainer = trainer
        self.rewards = rewards
        self.reward_spec = reward_spec
        self.ts: Any = None
        self.rows = len(prompts)
        self.lost: list[dict[str, Any]] = []
        self.fatal: BaseException | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        #: set when background work has an answer or an instance has results: the control
        #: loop's next cycle starts then instead of at its next tick
        self.wake = asyncio.Event()
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._poll_done: dict[str, asyncio.Event] = {}  # set when the instance was polled
        self._counts = ByteCounts()  # polls sent by reason: POLL_REASONS
        self._decoders: dict[str, SnapshotDecoder] = {}
        # outcomes that interrupts' answers carried, not yet handed on as events; the ids per
        # instance whose end its next snapshot delta is decoded with (see ``snapshot``)
        self._interrupted: list[tuple[str, list[Outcome]]] = []
        self._ended: dict[str, set[str]] = {}
        # commands sent to each instance (bumped before and after each), the count and the
        # clock at its last poll, the instances idle at their last poll with no command since,
        # and those whose watcher asked for a poll (see QUIET_POLL_S)
        self._commands: dict[str, int] = {}
        self._polled: dict[str, tuple[int, float]] = {}
        self._quiet: set[str] = set()
        self._signaled: set[str] = set()
        self._answered: dict[str, float] = {}  # when an instance's poll answer arrived
        self._failed_polls: dict[str, tuple[int, float]] = {}  # in a row, and when to retry
        self.lanes = Lanes()
        self.silence = Silence()  # calls overdue: routes taken back, the core told
        # polls out: the call, its request, the ids whose end its answer's delta carries, why
        self._polls: dict[str, tuple[asyncio.Task[Any], Any, set[str], str]] = {}
        self._ending: dict[str, set[str]] = {}  # the same, for the answer to be decoded next
        self._stale: set[str] = set()  # late answers that a command has overtaken
        self._late: list[InstanceLost] = []  # instances lost by calls that ended late
        self._killed: set[str] = set()  # actors killed here, not lost yet
        self.groups = GroupSubmitter(cfg, prompts)
        self._next_reward = 0
        #: group id -> dataset row of the groups this process submitted (diagnostics)
        self.submitted: dict[str, int] = {}

    # ---- set-up --------------------------------------------------------------------------

    async def start(self) -> None:
        from trajectory_server.client import TrajectoryClient

        self.ts = await TrajectoryClient.connect(*self.ts_address, token=self.ts_token)

    def prompt_len(self, row: int) -> int:
        return self.prompts.length(row)

    def _decoder(self, iid: str) -> SnapshotDecoder:
        dec = self._decoders.get(iid)
        if dec is None:
            dec = self._decoders[iid] = SnapshotDecoder(iid)
        return dec

    def snapshot(
        self, iid: str, delta: Mapping[int, Any] | None, at: float, ended: Sequence[str]
    ) -> InstanceSnapshot | None:
        """The snapshot an instance's poll answer carries (a delta from the last one decoded,
        None: unchanged; ``ended``: the answer's outcome ids), stamped with this process's
        clock (taken no earlier than the poll that carried it, after every command sent
        before). None if it does not follow the last one decoded (the next poll asks for a
        full one), or if it came late and a command to the instance was queued after its poll
        (it lacks that command's effect)."""
        dec = self._decoder(iid)
        self._quiet.discard(iid)
        stale = iid in self._stale
        self._stale.discard(iid)
        ended = [*ended, *self._ending.pop(iid, ())]  # interrupts' answers carried these
        # the view is stamped when its answer arrived, not when the slowest poll did
        arrived = self._answered.pop(iid, None)
        stamp = at if arrived is None else at - max(0.0, time.monotonic() - arrived)
        try:
            snap = dec.decode(delta, time_s=stamp, ended=ended)
        except ValueError as e:
            log.warning("snapshot_delta_refused", instance=iid, error=str(e)[:200])
            return None
        if snap is None:
            if delta is not None:
                log.warning("snapshot_delta_out_of_order", instance=iid)
            return None
        if stale:  # decoded (the next delta follows it), but older than a command
            return None
        polled = self._polled.get(iid)
        if (
            not snap.running
            and not snap.waiting
            and polled is not None
            and polled[0] == self._commands.get(iid, 0)
        ):
            self._quiet.add(iid)  # idle, and no command went out since the poll was sent
        return InstanceSnapshot.from_engine(snap)

    def touch(self, iid: str) -> None:
        """A command goes to (or came back from) ``iid``: poll it from the next cycle on."""
        self._commands[iid] = self._commands.get(iid, 0) + 1
        self._quiet.discard(iid)

    def byte_stats(self) -> dict[str, Any]:
        """:meth:`ByteCounts.stats` (with the trajectory server's socket counts)."""
        return self._counts.stats(self.ts)

    # ---- instances -----------------------------------------------------------------------

    def _watch_all(self) -> None:
        """One waiting ``wait_results`` call per instance (that has the method): when it
        answers True, :attr:`wake` is set and the watcher waits until the instance was
        polled before it asks again."""
        for iid, h in self.rollouts.items():
            t = self._watchers.get(iid)
            if (t is None or t.done()) and hasattr(h, "wait_results"):
                polled = self._poll_done.setdefault(iid, asyncio.Event())
                self._watchers[iid] = asyncio.get_running_loop().create_task(
                    self._watch(iid, h, polled)
                )

    async def _watch(self, iid: str, h: Any, polled: asyncio.Event) -> None:
        wait = h.wait_results
        try:
            while self.rollouts.get(iid) is h:
                ready = await wait.remote(WATCH_S)
                # (not ready: its time ran out, and the next call only renews the watch)
                n = size(WATCH_S) + size(ready)
                self._counts.count("instances", n, "wait_results", watch=not ready)
                if ready:
                    polled.clear()
                    self._ask_poll(iid)  # results, or its view is off
                    await polled.wait()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a dead instance: the poll this asks for reports the loss
            log.debug("watch_stopped", instance=iid, error=repr(e)[:200])
            self._ask_poll(iid)

    def _ask_poll(self, iid: str) -> None:
        self._signaled.add(iid)
        self._quiet.discard(iid)
        self.wake.set()

    def _due(self, iid: str, now: float) -> str | None:
        """Why ``iid`` is polled this cycle (a key of :data:`POLL_REASONS`), None if not (nor
        while a call to it is out)."""
        if iid in self._polls or self.lanes.busy(iid):
            return None
        failed = self._failed_polls.get(iid)
        if failed is not None:
            return "retry" if now >= failed[1] else None
        polled = self._polled.get(iid)
        if polled is None or self._decoder(iid).k is None:
            return "no_view"
        if polled[0] != self._commands.get(iid, 0):
            return "command"
        if iid in self._signaled:
            return "asked"
        if now - polled[1] >= QUIET_POLL_S:
            return "quiet"
        if iid not in self._quiet and not hasattr(self.rollouts[iid], "wait_results"):
            return "unwatched"
        return None

    def stop_watching(self, iid: str | None = None) -> None:
        """Cancel the watcher of ``iid`` (None: of every instance)."""
        for i in list(self._watchers) if iid is None else [iid]:
            t = self._watchers.pop(i, None)
            if t is not None:
                t.cancel()

    async def poll_all(self, *, wait_all: bool = False, send: bool = True) -> dict[str, Any]:
        """Poll the instances that have something to say (for a reason of
        :data:`POLL_REASONS`, counted there) and no call out. The answers that came within
        ``ANSWER_WAIT_S`` (``wait_all``: all), to this cycle's polls or earlier ones, by
        instance (an exception: it left the run, see :meth:`end_instance`); the others' views
        are :meth:`views`. A live instance whose poll failed is left out and polled again
        ``POLL_RETRY_S`` later, until ``coordinator.instance_error_limit`` polls in a row have
        failed. ``send=False``: only the answers to polls already out."""
        self._watch_all()
        now = time.monotonic()
        due = {i: w for i in self.rollouts if send and (w := self._due(i, now)) is not None}
        iids = list(due)
        for i, why in due.items():
            self._counts.poll(why)
            self._polled[i] = (self._commands.get(i, 0), now)
            self._signaled.discard(i)
        # each request acknowledges the last snapshot delta decoded (or asks for a full one);
        # an answer may be None (nothing happened, nothing changed)
        args = {i: poll_args(self._decoder(i).request()) for i in iids}

        async def poll(i: str, h: Any) -> Any:
            try:
                answer = await self._within(h.poll.remote(*args[i]), "poll")
            except CallHung:  # it ends the instance: the calls queued behind it are not sent
                self._killed.add(i)
                raise
            self._answered[i] = time.monotonic()  # its snapshot's age is counted from here
            return answer

        for i in iids:  # its answer's delta carries the end of those interrupted before it
            task = self.lanes.run(i, functools.partial(poll, i, self.rollouts[i]))
            self._polls[i] = (task, args[i], self._ended.pop(i, set()), due[i])
        waited = [self._polls[i][0] for i in (self._polls if wait_all else iids)]
        if waited:
            await asyncio.wait(waited, timeout=None if wait_all else ANSWER_WAIT_S)
        out: dict[str, Any] = {}
        limit = self.cfg.coordinator.instance_error_limit
        for iid, (t, sent, ended, why) in list(self._polls.items()):
            if not t.done():
                if iid in due:
                    self._late_answer(iid, "poll")
                continue  # answered in a later cycle
            del self._polls[iid]
            p = t.exception() or t.result()
            idle = why == "quiet" and p is None  # it only showed the instance is alive
            if sent:
                self._counts.count("instances", size(sent), "poll", watch=idle)
            if isinstance(p, BaseException):  # the next answer carries their end
                self._ended.setdefault(iid, set()).update(ended)
            else:
                self._ending[iid] = ended
                if iid not in due and self._polled[iid][0] != self._commands.get(iid, 0):
                    self._stale.add(iid)
            if isinstance(p, BaseException) and not is_actor_death(p):
                n = self._failed_polls.get(iid, (0, 0.0))[0] + 1
                self._failed_polls[iid] = (n, time.monotonic() + POLL_RETRY_S)
                if n < limit and not isinstance(p, CallHung):  # a hung one's answer is lost
                    log.warning("instance_poll_failed", instance=iid, in_row=n, limit=limit,
                                error=repr(p)[:300])  # fmt: skip
                    continue
                what = "poll" if n == 1 or isinstance(p, CallHung) else f"{n} polls in a row"
                p = self.end_instance(iid, what, p)
            self._failed_polls.pop(iid, None)
            if iid in self._poll_done:
                self._poll_done[iid].set()  # its watcher goes on
            if not isinstance(p, BaseException):
                self._counts.poll_answer(p, watch=idle)
                p = unpack_poll(p)
            out[iid] = p
        return out

    def views(self, at: float, polled: Collection[str]) -> dict[str, InstanceSnapshot]:
        """The extrapolated snapshots, at ``at``, of the instances not in ``polled`` that had
        work at their last poll (``SnapshotDecoder.view``; none whose last poll failed or is
        still out, or that was sent a command since: it would lack the work routed there
        since, and look free): no request is sent."""
        out: dict[str, InstanceSnapshot] = {}
        for iid in self.rollouts:
            if any(iid in s for s in (polled, self._quiet, self._failed_polls, self._polls)):
                continue
            last = self._polled.get(iid)
            if last is None or last[0] != self._commands.get(iid, 0) or self.lanes.busy(iid):
                continue  # a command since its last poll: the view lacks it
            snap = self._decoder(iid).view(at)
            if snap is not None:
                out[iid] = InstanceSnapshot.from_engine(snap)
        return out

    async def lose(self, iid: str, error: BaseException, at: float) -> InstanceLost | None:
        """``iid`` died: the store puts back in the queue what it held (with the response
        length the store holds for each); the instance leaves the run (None: it had left)."""
        if iid not in self.rollouts:
            return None
        del self.rollouts[iid]
        for s in (self._killed, self._quiet, self._signaled):
            s.discard(iid)
        for d in (self._decoders, self._failed_polls, self._ended, self._ending, self._answered):
            d.pop(iid, None)
        self.lanes.forget(iid)
        self.silence.forget(iid)
        if (out := self._polls.pop(iid, None)) is not None:  # its answer is not read
            out[0].add_done_callback(lambda t: t.cancelled() or t.exception())
        self.stop_watching(iid)
        requeued = list(await self.ts.instance_lost(iid))
        # one answer for what the store put back and what the core believes ran there: the
        # latter may have its output written back (finished, or returned) with its report
        # lost, or be dropped meanwhile
        st = await in_store(self.ts, [*requeued, *self.held_by(iid)], iid)
        self.lost.append({"instance_id": iid, "requeued": requeued, "error": repr(error)[:300],
                          "queued": [t for t, _ in st.queued],  # with routes it never took
                          "finished": [o.trajectory_id for o in st.finished],
                          "dropped": [t for t, _ in st.dropped]})  # fmt: skip
        log.warning("instance_lost", instance=iid, requeued=len(requeued),
                    finished=len(st.finished), dropped=len(st.dropped),
                    error=repr(error)[:200])  # fmt: skip
        return InstanceLost(at=at, instance_id=iid, requeued=st.queued, finished=st.finished,
                            dropped=st.dropped)  # fmt: skip

    async def _within(self, call: Any, what: str) -> Any:
        """An instance's answer to ``call``; :class:`CallHung` after :meth:`_limit`."""
        key, limit_s = self._limit(what)
        return await answer_within(call, limit_s, what, f"coordinator.{key}")

    def _limit(self, what: str) -> tuple[str, float]:
        """The setting, and its value, that bounds the wait for an answer to ``what``."""
        # a well instance answers a poll or a route at once (a route: once the store handed
        # it the payloads); an interrupt may wait for its generations
        key = "poll_timeout_s" if what in ("poll", "route") else "call_timeout_s"
        return key, float(getattr(self.cfg.coordinator, key))

    def end_instance(self, iid: str, what: str, error: BaseException) -> RuntimeError:
        """``what`` (calls to live instance ``iid``) failed with ``error`` or hung
        (:class:`CallHung`): kill its actor, as a dead one is gone, and return the error to
        lose it with (:meth:`lose`)."""
        if isinstance(error, CallHung):
            log.error("instance_hung", instance=iid, call=what, error=str(error))
            why = error.why
        else:
            log.error("instance_failing", instance=iid, call=what, error=repr(error)[:300])
            why = f"failed: {error!r}"[:400]
        if (h := self.rollouts.get(iid)) is not None:
            kill_actor(h)
        self._killed.add(iid)  # the rest of its calls in this batch are not sent
        return RuntimeError(f"{what} on {iid!r} {why}; its actor was killed")

    async def refused(self, iid: str, answer: Mapping[str, Any] | None) -> InStore:
        """What the store holds of those it refused to route to ``iid`` (its poll ``answer``)."""
        return await in_store(self.ts, (answer or {}).get("refused", ()), iid)

    async def sync(self, iid: str, handle: Any, version: int) -> dict[str, Any]:
        """Have ``iid`` load ``version``; its outcome shows in the polls after this returns."""
        self.touch(iid)
        self._counts.count("instances", size(version), "sync")
        try:
            answer = dict(await handle.sync.remote(version))
            self._counts.count("instances", size(answer), "sync_answer")
            return answer
        finally:
            self.touch(iid)

    async def interrupt_all(self) -> None:
        self.stop_watching()
        for iid in self.rollouts:
            self.touch(iid)
        hs = self.rollouts.values()
        await asyncio.gather(*(self._within(h.interrupt.remote(None), "stop") for h in hs),
                             return_exceptions=True)  # fmt: skip
