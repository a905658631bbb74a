"""Experiment trackers beside ``metrics.jsonl`` and TensorBoard: Weights & Biases, off by
default.

Turn it on with ``metrics.wandb.enabled=true`` (install the extra: ``pip install
'staleflow-trainer[wandb]'``). Every step's numeric metrics are logged with the step as x
axis, under the same names as in TensorBoard (``tokens_per_s``, ``trainer/loss``, ...); the
resolved config is the run's W&B config. ``metrics.wandb.mode=offline`` writes under
``RUN_DIR/wandb`` for a later ``wandb sync``. A resumed run continues the same W&B run (its id
is kept in ``RUN_DIR/wandb-run-id``).
"""

from __future__ import annotations

import importlib
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from staleflow_trainer.errors import ConfigError

log = structlog.get_logger(__name__)

RUN_ID_FILE = "wandb-run-id"


def _import_wandb() -> Any:
    try:
        return importlib.import_module("wandb")
    except ImportError as e:
        raise ConfigError(
            "metrics.wandb.enabled=true but the wandb package is not installed "
            "(pip install 'staleflow-trainer[wandb]')",
            key="metrics.wandb.enabled",
            allowed="false, or install wandb",
        ) from e


class WandbTracker:
    """One W&B run; :meth:`log` per step, :meth:`close` at the end."""

    def __init__(
        self,
        *,
        run_dir: str | Path,
        project: str,
        name: str = "",
        mode: str | None = None,
        config: Mapping[str, Any] | None = None,
        resume: bool = False,
    ) -> None:
        wandb = _import_wandb()
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else ""
        if not run_id:
            run_id = secrets.token_hex(4)
            id_file.write_text(run_id + "\n")
        kwargs: dict[str, Any] = {
            "project": project,
            "name": name or run_dir.resolve().name,
            "id": run_id,
            "resume": "allow",
            "dir": str(run_dir),
            "config": dict(config or {}),
        }
        if mode is not None:
            kwargs["mode"] = mode
        self.run = wandb.init(**kwargs)
        self.run_id = run_id
        log.info("wandb_run_started", project=project, id=run_id, mode=mode or "default")

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


def trackers_from_config(cfg: Any, *, resume: bool = False) -> list[Any]:
    """The trackers ``cfg.metrics`` turns on (none by default), for
    :class:`staleflow_trainer.report.metrics.MetricsWriter`."""
    w = cfg.metrics.wandb
    if not w.enabled:
        return []
    from staleflow_trainer.config import to_dict

    return [
        WandbTracker(
            run_dir=cfg.run.run_dir,
            project=w.project,
            name=w.name,
            mode=w.mode,
            config=to_dict(cfg),
            resume=resume,
        )
    ]
