"""Run-level checkpoints: one directory per step, committed atomically, latest pointer, pruning.

Layout::

    RUN_DIR/checkpoints/step_00000010/   trainer.pt (+ .sha256), protocol.json, ... (any files)
    RUN_DIR/checkpoints/latest           "10"  (+ latest.sha256)

:meth:`RunCheckpoints.write` lets the caller fill a temporary directory with every
component's state (model/optimizer via :meth:`Trainer.save_checkpoint`, protocol, trajectory
store, data cursor via :func:`save_json`), then renames it into place and only then moves the
``latest`` pointer — a crash at any point leaves the previous checkpoint intact and usable.
Every file written with :func:`save_json` / ``save_torch`` carries a SHA-256 that is checked
on load.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from staleflow_trainer.atomic_files import atomic_write_bytes, read_verified_bytes
from staleflow_trainer.errors import CheckpointError

log = structlog.get_logger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def save_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as JSON atomically with a SHA-256 side file."""
    return atomic_write_bytes(path, json.dumps(obj, sort_keys=True).encode())


def load_json(path: str | Path) -> Any:
    """Read a file written by :func:`save_json` (CheckpointError if missing or corrupt)."""
    data = read_verified_bytes(path)
    try:
        return json.loads(data)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not JSON: {e}", path=str(path)) from e


class RunCheckpoints:
    """The checkpoints of one run directory."""

    def __init__(self, run_dir: str | Path, *, keep: int = 2) -> None:
        if keep < 1:
            raise CheckpointError(f"keep must be >= 1, got {keep}")
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def write(self, step: int, fill: Callable[[Path], None]) -> Path:
        """Create checkpoint ``step``: ``fill(tmp_dir)`` writes the files, then commit."""
        if step < 0:
            raise CheckpointError(f"step must be >= 0, got {step}")
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".step_{step:08d}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            fill(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        final = self.step_dir(step)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        atomic_write_bytes(self.root / "latest", str(step).encode())
        self._prune()
        log.info("checkpoint_committed", step=step, path=str(final))
        return final

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(
            int(m.group(1)) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name))
        )

    def latest(self) -> tuple[int, Path] | None:
        """The last committed checkpoint, or None if there is none."""
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        step = int(read_verified_bytes(pointer).decode())
        path = self.step_dir(step)
        if not path.is_dir():
            raise CheckpointError(f"latest points at missing {path}", path=str(path))
        return step, path

    def resolve_resume(self, mode: str) -> tuple[int, Path] | None:
        """Apply ``run.resume``: ``auto`` → latest or None; ``must`` → latest or error;
        ``never`` → None (a fresh run)."""
        if mode == "never":
            return None
        found = self.latest()
        if found is None and mode == "must":
            raise CheckpointError(f"run.resume=must but {self.root} has no checkpoint")
        if mode not in ("auto", "must"):
            raise CheckpointError(f"unknown resume mode {mode!r}; use auto, must or never")
        return found

    def _prune(self) -> None:
        latest = self.latest()
        keep_from = self.steps()[-self.keep :]
        for step in self.steps():
            if step not in keep_from and (latest is None or step != latest[0]):
                shutil.rmtree(self.step_dir(step), ignore_errors=True)
