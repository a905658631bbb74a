"""Before a run starts: is there anything left to train, and a Ray start-up that survives a
slow machine.

* :func:`finished_run_message` — a run directory whose latest checkpoint already reached
  ``trainer.steps`` has nothing to train: ``staleflow train`` says so (and how to go on)
  before it deploys anything. This module imports nothing heavy, so that check takes well
  under a second.
* :func:`ray_init_with_retry` — Ray's own start-up times out now and then on a loaded machine
  (its node must register within 30 s); a timed-out start is shut down and tried again, and
  when every try timed out the error says what happened instead of Ray's traceback.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog

from staleflow_trainer.errors import StartupFailed

log = structlog.get_logger(__name__)

T = TypeVar("T")

_STEP_NAME = re.compile(r"^(?:step_)?(\d+)$")


def checkpoint_step(run_dir: str | Path) -> int | None:
    """The step of the checkpoint a resume of ``run_dir`` would use, or None when there is
    none (or it cannot be read: the deployment reports that)."""
    from staleflow_trainer.actors.reconcile import latest_checkpoint
    from staleflow_trainer.errors import CheckpointError

    try:
        d = latest_checkpoint(run_dir)
    except CheckpointError:
        return None
    m = None if d is None else _STEP_NAME.match(d.name)
    return None if m is None else int(m.group(1))


def finished_run_message(cfg: Any, *, command: str = "staleflow train CONFIG") -> str | None:
    """What to tell the user when ``cfg``'s run is already complete, or None when there is
    something to train (no checkpoint, ``run.resume=never``, or fewer steps than
    ``trainer.steps``). ``command`` is how the user started the run, for the advice."""
    if cfg.run.resume == "never":
        return None
    step = checkpoint_step(cfg.run.run_dir)
    steps = int(cfg.trainer.steps)
    if step is None or step < steps:
        return None
    run_dir = cfg.run.run_dir
    return (
        f"Nothing to train: {run_dir} already holds a finished run (its latest checkpoint is "
        f"at step {step}, trainer.steps={steps}).\n"
        f"  train further from step {step}:  {command} trainer.steps={step + steps}\n"
        f"  start over (replaces {run_dir}):  {command} run.resume=never\n"
        f"  or keep it and use another directory:  {command} run_dir=DIR"
    )


def _is_startup_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, TimeoutError) or "timed out" in text or "timeout" in text


def ray_init_with_retry(
    init: Callable[[], T],
    *,
    attempts: int = 3,
    on_retry: Callable[[str], None] | None = None,
    shutdown: Callable[[], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    backoff_s: float = 2.0,
) -> T:
    """Call ``init`` (a ``ray.init(...)``) up to ``attempts`` times while it fails with a
    start-up timeout, shutting the half-started Ray down in between; ``on_retry`` hears
    each retry. Any other error propagates at once; the last timeout becomes a
    :class:`StartupFailed` that names the cause and what to try."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    if shutdown is None:

        def shutdown() -> None:
            import ray

            ray.shutdown()

    for attempt in range(1, attempts + 1):
        try:
            return init()
        except Exception as e:
            if not _is_startup_timeout(e):
                raise
            reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else repr(e)
            log.warning("ray_start_timed_out", attempt=attempt, attempts=attempts, error=reason)
            try:
                shutdown()
            except Exception as down:  # a half-started Ray may not shut down cleanly
                log.warning("ray_shutdown_after_timeout_failed", error=repr(down)[:200])
            if attempt == attempts:
                raise StartupFailed(
                    f"Ray did not start: it timed out {attempts} times ({reason}). The machine "
                    "may be overloaded (Ray's node must register within 30 s); try again when "
                    "it is less busy, or start Ray yourself (`ray start --head`) and set "
                    "ray.address=auto",
                    component="ray",
                ) from e
            if on_retry is not None:
                on_retry(f"start-up timed out ({reason}); retrying ({attempt + 1}/{attempts})")
            sleep(backoff_s * attempt)
    raise AssertionError("unreachable")
