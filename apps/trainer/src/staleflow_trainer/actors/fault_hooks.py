"""Fault hooks: crash the control actor at a named point, or hold it between steps; hold a
rollout instance's poll answer once its finished output is in the trajectory server.

Fault tests drive these over Ray; a normal run never arms them. A crash is the process
exiting with no cleanup (what a crashed process leaves behind), after appending the point's
name to ``CRASH_RECORD`` in the run directory, so a test can tell the injected exit from any
other death: the reply to :meth:`FaultHooks.inject_crash` may be lost when the loop reaches
the point before Ray delivers it.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from staleflow_trainer.actors.liveness import child_processes

#: where :meth:`FaultHooks.inject_crash` can make the process exit
CRASH_POINTS = ("after_journal", "mid_effects", "before_checkpoint")
#: in the run directory: one line per injected crash, the point's name
CRASH_RECORD = "injected_crashes.txt"


class FaultHooks:
    """Mixed into the control actor, which provides ``core``, ``_run_dir`` and ``_log``."""

    core: Any
    _trains_running: int
    _run_dir: Path
    _log: Any

    def _init_fault_hooks(self) -> None:
        self._crash_at: str | None = None
        self._hold_armed = False
        self._held_at: dict[str, Any] | None = None
        self._hold_release = asyncio.Event()

    def _maybe_crash(self, point: str) -> None:
        if self._crash_at == point:
            self._log.warning("injected_crash", point=point)
            with open(self._run_dir / CRASH_RECORD, "a", encoding="utf-8") as f:
                f.write(point + "\n")
            os._exit(17)

    async def inject_crash(self, point: str) -> None:
        """Make this process exit at the next ``point`` (one of :data:`CRASH_POINTS`)."""
        if point not in CRASH_POINTS:
            raise ValueError(f"point must be one of {CRASH_POINTS}, got {point!r}")
        self._crash_at = point

    async def hold_after_next_step(self) -> None:
        """Hold the loop right after the next step's record (its checkpoint written if due,
        no other step started) until :meth:`release_hold`."""
        self._hold_armed = True

    async def _hold(self, row: Mapping[str, Any]) -> None:
        from staleflow_trainer.actors.reconcile import latest_checkpoint  # the rollout: unused

        self._hold_release.clear()
        self._held_at = {"steps_done": int(row["step"]), "version": int(row["version"]),
                         "train_in_flight": self._trains_running > 0,
                         "train_decided": self.core.training is not None,
                         "checkpoint": str(latest_checkpoint(self._run_dir))}  # fmt: skip
        self._log.info("held_between_steps", **self._held_at)
        await self._hold_release.wait()
        self._held_at = None

    async def held(self) -> dict[str, Any] | None:
        return None if self._held_at is None else dict(self._held_at)

    async def release_hold(self) -> None:
        self._hold_release.set()


class RolloutFaultHooks:
    """Mixed into the rollout actor: :meth:`hold_poll_after_finish` makes the next poll that
    reports a finished trajectory write its output to the trajectory server and then never
    answer — the window in which a killed instance leaves finished work its control actor has
    not seen. :meth:`hold_poll_with_work` holds a poll before it writes anything, while the
    instance has work the TS has not got back — an instance killed mid-generation.
    :meth:`kill_engine` kills the engine under a live actor — an engine process that crashed;
    :meth:`hang_next_sync` makes the next sync never return — an engine that hangs;
    :meth:`hang_next_route` makes the next route never return, before it takes anything from
    the TS — an instance that froze as the route reached it."""

    _tasks: Mapping[str, Any]
    _to_write: Sequence[tuple[Any, bool]]
    _engine: Any

    def _init_rollout_hooks(self) -> None:
        self._hold_poll_armed = False
        self._hold_work_armed = False
        self._poll_held: list[str] | None = None
        self._hang_sync_armed = False
        self._sync_hanging = False
        self._hang_route_armed = False
        self._route_held: list[str] | None = None

    async def hold_poll_after_finish(self) -> None:
        """Hold the next poll answer that carries a finished trajectory (written to the TS)
        until this process dies; :meth:`poll_held` then names them."""
        self._hold_poll_armed = True

    async def hold_poll_with_work(self) -> None:
        """Hold the next poll made while a generation runs here or a result waits to be
        written, before it writes anything, until this process dies; :meth:`poll_held` then
        names that work (the TS still has it running here). The control loop waits on the
        poll meanwhile."""
        self._hold_work_armed = True

    async def poll_held(self) -> list[str] | None:
        """The trajectories of the poll being held (None: none held): the finished ones
        (:meth:`hold_poll_after_finish`) or those it holds work of (:meth:`hold_poll_with_work`)."""
        return None if self._poll_held is None else list(self._poll_held)

    async def _maybe_hold_work(self) -> None:
        if not self._hold_work_armed or not (self._tasks or self._to_write):
            return
        self._hold_work_armed = False
        self._poll_held = sorted({*self._tasks, *(r.trajectory_id for r, _ in self._to_write)})
        await asyncio.Event().wait()  # until the process is killed

    async def _maybe_hold_poll(self, outcomes: Sequence[Sequence[Any]]) -> None:
        if not self._hold_poll_armed:
            return
        finished = [str(o[0]) for o in outcomes if o[2] is not None]
        if finished:
            self._hold_poll_armed = False
            self._poll_held = finished
            await asyncio.Event().wait()  # until the process is killed

    async def hang_next_sync(self) -> None:
        """The next sync never returns (until this process dies), its engine untouched."""
        self._hang_sync_armed = True

    async def sync_hanging(self) -> bool:
        """Whether a sync hangs here now (:meth:`hang_next_sync`)."""
        return self._sync_hanging

    async def _maybe_hang_sync(self) -> None:
        if self._hang_sync_armed:
            self._hang_sync_armed = False
            self._sync_hanging = True
            await asyncio.Event().wait()  # until the process is killed

    async def hang_next_route(self) -> None:
        """The next route (``submit``) never returns (until this process dies), before it asks
        the TS for anything: its trajectories stay queued there."""
        self._hang_route_armed = True

    async def route_held(self) -> list[str] | None:
        """The ids of the route being held (None: none held, :meth:`hang_next_route`)."""
        return None if self._route_held is None else list(self._route_held)

    async def _maybe_hang_route(self, ids: Sequence[str]) -> None:
        if self._hang_route_armed:
            self._hang_route_armed = False
            self._route_held = list(ids)
            await asyncio.Event().wait()  # until the process is killed

    async def kill_engine(self) -> list[int]:
        """Kill this instance's engine as a crash would and leave the rest to the instance: a
        sim engine dies in place (``SimAdapter.kill``); otherwise every engine process of this
        one gets SIGKILL (:func:`engine_processes`). Returns the pids killed (none for a sim
        engine); raises if there was no engine process to kill, so a fault test fails at once,
        naming this process's children, instead of waiting for a loss that cannot come."""
        kill = getattr(self._engine, "kill", None)
        if callable(kill):
            kill()
            return []
        pids = engine_processes(self._engine)
        if not pids:
            raise RuntimeError(
                f"kill_engine: no engine process under pid {os.getpid()} "
                f"(its children: {child_processes()})"
            )
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return pids


def engine_processes(adapter: Any) -> list[int]:
    """The pids of the live engine processes under a vLLM adapter: those vLLM's own process
    manager holds (``AsyncLLM.engine_core.resources.engine_manager.processes``), and any child
    of this process whose command line names EngineCore (vLLM sets that title once the process
    has started). Either alone can miss one: the manager's path is vLLM's internals, and the
    title depends on ``setproctitle`` being installed."""
    pids: set[int] = set()
    try:
        manager = adapter.engine.engine_core.resources.engine_manager
        pids.update(p.pid for p in manager.processes if p.is_alive() and p.pid is not None)
    except (AttributeError, TypeError, RuntimeError):  # not a vLLM adapter, or other internals
        pass
    pids.update(pid for pid, cmd in child_processes() if "EngineCore" in cmd)
    return sorted(pids)
