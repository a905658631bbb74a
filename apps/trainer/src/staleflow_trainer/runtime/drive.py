"""The driver's loop over a started :class:`~staleflow_trainer.runtime.deployment.Deployment`:
it drives the control actor's run until ``trainer.steps``, streams its step records into the
run directory (metrics, timeline, trackers, the progress bar), relays the actors' warnings,
replaces lost rollout instances (``rollout.replace_lost``) and a control actor that died."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from staleflow_trainer.actors.liveness import is_actor_death
from staleflow_trainer.actors.log_relay import WarningRelay, relayed_actors, replay
from staleflow_trainer.actors.reconcile import checkpoint_records
from staleflow_trainer.errors import StaleflowError
from staleflow_trainer.report.metrics import MetricsWriter, TimelineWriter
from staleflow_trainer.report.progress import ProgressBar
from staleflow_trainer.report.trackers import trackers_from_config
from staleflow_trainer.runtime.deployment import START_TIMEOUT_S, Deployment
from staleflow_trainer.runtime.prepare import ray_prints_worker_logs
from staleflow_trainer.runtime.replacements import Replacer

log = structlog.get_logger("staleflow_trainer.runtime.deployment")
#: control-actor lines the driver does not relay: it logs their news itself
_OURS = frozenset({"instance_lost", "run_stopped"})


def drive(
    dep: Deployment, on_record: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Drive ``dep``'s coordinator loop until ``trainer.steps``; its summary."""
    import ray

    cfg = dep.cfg
    resumed = dep.resume_dir is not None
    writer = MetricsWriter(
        dep.run_dir,
        tensorboard=cfg.metrics.tensorboard,
        resume_step=dep.steps_at_start if resumed else None,
        trackers=trackers_from_config(cfg, resume=resumed),
        backfill=checkpoint_records(dep.resume_dir) if dep.resume_dir else (),
    )
    timeline = TimelineWriter(dep.run_dir)
    coord: Any = None
    run_ref: Any = None
    last_step = dep.steps_at_start
    summary: Any = None
    replacer = dep.replacer = Replacer(dep, cfg.rollout.replace_lost, START_TIMEOUT_S)
    relay = WarningRelay(lambda: relayed_actors(dep), log, enabled=not ray_prints_worker_logs())

    def emit(outs: list[dict[str, Any]], bar: Any) -> None:
        nonlocal last_step
        for out in outs:
            for rec in out["records"]:
                if int(rec["step"]) <= last_step:
                    continue  # re-sent by a coordinator recovered from its journal
                last_step = int(rec["step"])
                writer.log_step(rec)
                if bar is not None:
                    bar.update(int(rec["step"]), rec)
                if on_record is not None:
                    on_record(rec)
            timeline.extend(out["timeline"])
            replay(out.get("logs", []), log, skip=_OURS)

    try:
        with ProgressBar(
            cfg.trainer.steps,
            enabled=cfg.metrics.progress_bar,
            start_step=dep.steps_at_start,
            log_every=cfg.metrics.log_every,
        ) as bar:
            while True:
                if coord is not dep.coordinator:  # started, or replaced
                    coord = dep.coordinator
                    run_ref = coord.run.remote()
                ready, _ = ray.wait([run_ref], timeout=0.5)
                outs, dep._pending_out = dep._pending_out, []
                try:
                    outs.append(ray.get(coord.drain.remote(last_step)))
                except Exception as e:
                    if not is_actor_death(e) or coord is not dep.coordinator:
                        raise
                    emit(outs, bar)
                    dep.replace_crashed_coordinator(e)
                    continue
                emit(outs, bar)
                relay.poll()  # the other actors' warnings
                if not ready:  # losses logged, replaced (replace_lost); none left: raises
                    replacer.update(outs[-1]["instances"])
                if ready and coord is dep.coordinator:
                    try:
                        summary = ray.get(run_ref)
                    except Exception as e:  # ComponentLost etc. propagate
                        if not is_actor_death(e):
                            # as the control actor raised it, not wrapped in Ray's remote
                            # traceback (which the CLI would print in full)
                            cause = getattr(e, "cause", None)
                            if isinstance(cause, StaleflowError):
                                raise cause from e
                            raise
                        dep.replace_crashed_coordinator(e)
                        continue
                    break
        emit([ray.get(coord.drain.remote(last_step))], None)
        relay.poll(wait_s=2.0)
    finally:
        replacer.close()
        writer.close()
        timeline.close()
    return dict(summary)
