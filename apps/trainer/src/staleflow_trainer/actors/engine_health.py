"""A rollout instance whose engine is gone ends its own process.

An engine whose process died (``engine_adapters.EngineDead``: found by a call, or by the
health check every ``HEALTH_CHECK_S``) ends the rollout actor's process, with an error in its
log (relayed to the driver's), once what already finished is in the trajectory server (TS). The
control shell then sees a dead instance, as if the actor had been killed: what the TS held there
goes back to the queue and the run goes on without it. Without it, an instance whose vLLM
EngineCore died would never answer its sync again and would hold its work. An engine that
answers everything but fails every generation is treated the same way once
``generate_error_limit`` prompts failed in a row (:meth:`EngineHealth._count_failure`).

:class:`EngineHealth` is mixed into :class:`~staleflow_trainer.actors.rollout.RolloutActor`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from engine_adapters import EngineAdapter, EngineDead, InvalidRequest, id_prefix
from staleflow_trainer.actors.liveness import child_processes
from staleflow_trainer.actors.log_relay import FETCH_EVERY_S, handed_over

#: How often the instance asks its engine whether its process is alive (``check_health``).
HEALTH_CHECK_S = 1.0
#: This process's exit status when its engine died.
ENGINE_DEAD_EXIT = 75
#: Before it ends, a dying instance writes what already finished to the TS for this long at most.
DYING_FLUSH_S = 5.0
#: A dying instance then waits this long at most for the driver to fetch its last warning and
#: error lines (``log_relay``: it asks every ``FETCH_EVERY_S``), the reason it ends among them.
LAST_LINES_S = 2 * FETCH_EVERY_S
#: How long an instance whose generations keep failing waits for its engine's snapshot.
SNAPSHOT_CHECK_S = 10.0


class EngineHealth:
    """Mixed into the rollout actor, which sets these attributes and provides ``_flush``."""

    _engine: EngineAdapter | None
    _error_limit: int
    _failed: set[str]
    _checking: bool
    _dying: bool
    _known: dict[str, int]
    _tasks: dict[str, asyncio.Task[None]]
    _log: Any

    if TYPE_CHECKING:  # RolloutActor's

        async def _flush(self) -> None: ...

    async def _count_failure(self, tid: str, error: Exception) -> None:
        """A generation failed on a live engine. An engine whose every generation fails while
        it answers everything else (a server that reports its metrics but fails each request)
        looks idle, so work keeps being routed to it and comes back with no progress. It is
        treated as unable to serve once generations of ``generate_error_limit`` different
        prompts failed in a row (none returning between; one bad prompt fails all its samples,
        wherever it runs) and its snapshot, asked once then (``SNAPSHOT_CHECK_S`` at most),
        shows no trajectory that generated here: an engine that still generates for others,
        or that does not answer at all (the control side's failing polls judge that one), is
        not. An error of the request itself (``InvalidRequest``: a prompt too long) says
        nothing of the engine and is not counted."""
        if isinstance(error, InvalidRequest) or self._dying:
            return
        failed = self._failed
        failed.add(id_prefix(tid) or tid)
        if len(failed) < self._error_limit or self._checking or self._engine is None:
            return
        self._checking = True
        try:
            async with asyncio.timeout(SNAPSHOT_CHECK_S):
                snap = await self._engine.snapshot()
        except Exception:
            return
        finally:
            self._checking = False
        known = self._known
        if self._failed is not failed or any(  # one returned since, or it generates
            r.generated_tokens > known.get(r.trajectory_id, 0) for r in snap.running
        ):
            return
        await self._die(
            EngineDead(
                f"generations of {len(failed)} prompts failed in a row on a live engine "
                f"that generates nothing (coordinator.generate_error_limit="
                f"{self._error_limit}; the last: {error!r:.200})"
            )
        )

    async def _watch_health(self) -> None:
        """Every HEALTH_CHECK_S: an engine whose process died ends this process (see the
        module docstring). Calls alone would not find it: vLLM leaves a weight load that was
        in flight when its EngineCore died waiting forever."""
        while self._engine is not None:
            await asyncio.sleep(HEALTH_CHECK_S)
            engine = self._engine
            if engine is not None:
                try:
                    await engine.check_health()
                except EngineDead as e:
                    await self._die(e)
                except Exception as e:  # a check that itself failed: the next one may not
                    self._log.warning("health_check_failed", error=repr(e)[:200])

    async def _end_if_dead(self, engine: EngineAdapter, error: BaseException) -> None:
        """An engine call raised ``error``: if the engine is dead (the error says so, or its
        health check does: a dead server's calls may fail with a plain connection error), end
        this process; else return, and the caller handles a live engine's error."""
        if isinstance(error, EngineDead):
            await self._die(error)
        try:
            await engine.check_health()
        except EngineDead as e:
            await self._die(e)

    async def _die(self, error: EngineDead) -> NoReturn:
        """The engine is gone for good: end this process, so the control shell sees a dead
        instance (its work goes back to the queue) rather than one that fails every call.
        What already finished is written to the TS first, if that takes at most
        ``DYING_FLUSH_S`` (the control side then learns from the TS that it finished), its last
        lines are left for the driver to fetch (``LAST_LINES_S``), and the process's children
        (an engine process that may still hold memory) are killed."""
        if self._dying:  # the first call ends the process
            await asyncio.get_running_loop().create_future()
        self._dying = True
        try:  # whatever happens meanwhile (a cancelled flush included), the process ends
            self._log.error("engine_dead", error=str(error), running=len(self._tasks),
                            exit_status=ENGINE_DEAD_EXIT)  # fmt: skip
            with contextlib.suppress(Exception):
                async with asyncio.timeout(DYING_FLUSH_S):
                    await self._flush()
            with contextlib.suppress(Exception):  # the driver fetches the lines that say why
                await handed_over(LAST_LINES_S)
            for pid, _ in child_processes():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(ENGINE_DEAD_EXIT)
