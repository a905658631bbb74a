"""Run files: per-step JSONL metrics, the instance timeline, TensorBoard and (optionally) W&B.

``RUN_DIR/metrics.jsonl`` holds one JSON object per training step. Its keys are defined in
one place, :mod:`staleflow_trainer.control.report` (the metrics contract); the required ones
(:data:`REQUIRED_KEYS`) are ``step``, ``version``, ``tokens_per_s`` (trained tokens per second
of the step), ``max_staleness``, ``mean_staleness``, ``reward_mean`` and ``trainer_wait_s``.
Every numeric key also goes to TensorBoard (``RUN_DIR/tensorboard``, nested keys as
``trainer/loss``, ``instance_busy_frac/r000``; view it with ``tensorboard --logdir
RUN_DIR/tensorboard``) and, with ``metrics.wandb.enabled``, to Weights & Biases
(:mod:`staleflow_trainer.report.trackers`).

``RUN_DIR/timeline.jsonl`` holds one interval per line: ``instance``, ``state``
(``busy`` / ``syncing`` / ``idle``), ``start_s``, ``end_s``, ``version``.

What is shown while a run goes (progress bar, a line per step, start-up phases) is in
:mod:`staleflow_trainer.report.progress`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import structlog

from staleflow_trainer.control.report import staleness_summary
from staleflow_trainer.errors import StaleflowError
from staleflow_trainer.report.progress import ProgressBar  # re-exported: the driver's import path

log = structlog.get_logger(__name__)

__all__ = [
    "METRICS_FILE",
    "REQUIRED_KEYS",
    "TIMELINE_FILE",
    "MetricsError",
    "MetricsWriter",
    "ProgressBar",
    "TimelineWriter",
    "busy_fractions",
    "read_jsonl",
    "scalars",
    "staleness_summary",
]

METRICS_FILE = "metrics.jsonl"
TIMELINE_FILE = "timeline.jsonl"
REQUIRED_KEYS: tuple[str, ...] = (
    "step",
    "version",
    "tokens_per_s",
    "max_staleness",
    "mean_staleness",
    "reward_mean",
    "trainer_wait_s",
)
TIMELINE_STATES: tuple[str, ...] = ("busy", "syncing", "idle")


class MetricsError(StaleflowError):
    """A metrics record is missing required keys or holds non-JSON values."""


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _json_safe(value.item())
    return value


def _flatten(prefix: str, value: Any, out: dict[str, float]) -> None:
    if isinstance(value, bool):
        out[prefix] = float(value)
    elif isinstance(value, (int, float)):
        if math.isfinite(value):
            out[prefix] = float(value)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{prefix}/{k}", v, out)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All JSON objects of a JSONL file (a torn last line from a crash is skipped)."""
    p = Path(path)
    if not p.exists():
        return []
    rows = []
    lines = p.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                log.warning("metrics_torn_line_skipped", path=str(p))
                continue
            raise
    return rows


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The numeric values of a record, nested keys joined by ``/`` (``trainer/loss``), what
    TensorBoard and W&B receive (``step`` is the x axis, not a scalar)."""
    out: dict[str, float] = {}
    for k, v in row.items():
        if k != "step":
            _flatten(k, v, out)
    return out


class MetricsWriter:
    """Appends per-step records to ``metrics.jsonl``, TensorBoard and the given trackers.

    ``resume_step``: when resuming from a checkpoint taken after step ``k``, records with
    ``step > k`` (written after that checkpoint by the crashed run) are removed first, so the
    file again has exactly one record per step. ``trackers``: objects with ``log(scalars,
    step)`` and ``close()`` (:func:`staleflow_trainer.report.trackers.trackers_from_config`); they
    are closed with the writer. ``backfill``: the checkpoint's records of
    steps ``<= k`` that the file lacks (a driver killed before it wrote them) are added.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        resume_step: int | None = None,
        trackers: Sequence[Any] = (),
        backfill: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_step is not None and (self.path.exists() or backfill):
            old = read_jsonl(self.path) if self.path.exists() else []
            kept = [r for r in old if int(r.get("step", -1)) <= resume_step]
            have = {int(r.get("step", -1)) for r in kept}
            gap = {int(r["step"]): dict(r) for r in backfill
                   if int(r["step"]) <= resume_step and int(r["step"]) not in have}  # fmt: skip
            if gap:
                log.warning("metrics_gap_filled", steps=sorted(gap), from_checkpoint=True)
            kept = sorted([*kept, *(_json_safe(r) for r in gap.values())],
                          key=lambda r: int(r.get("step", -1)))  # fmt: skip
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(self.path)
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self._fh = self.path.open("a", encoding="utf-8")
        self._tb = None
        self.trackers = list(trackers)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.tensorboard_dir))

    @property
    def tensorboard_dir(self) -> Path:
        return self.run_dir / "tensorboard"

    def log_step(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """Validate and write one step's record; returns what was written."""
        missing = [k for k in REQUIRED_KEYS if k not in record]
        if missing:
            raise MetricsError(f"metrics record lacks required keys {missing}")
        row: dict[str, Any] = _json_safe(dict(record))
        try:
            line = json.dumps(row, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise MetricsError(f"metrics record is not JSON-serialisable: {e}") from e
        self._fh.write(line + "\n")
        self._fh.flush()
        if self._tb is None and not self.trackers:
            return row
        step = int(row["step"])
        values = scalars(row)
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
            hist = row.get("staleness_hist") or {}
            stale = [int(s) for s, c in hist.items() for _ in range(int(c))]
            if stale:
                import numpy as np

                self._tb.add_histogram("staleness", np.asarray(stale), step)
            self._tb.flush()
        for t in self.trackers:
            t.log(values, step)
        return row

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        trackers, self.trackers = self.trackers, []
        for t in trackers:
            t.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class TimelineWriter:
    """Appends instance-state intervals to ``timeline.jsonl``."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / TIMELINE_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")

    def interval(
        self, instance: str, state: str, start_s: float, end_s: float, *, version: int = 0
    ) -> None:
        if state not in TIMELINE_STATES:
            raise MetricsError(f"timeline state {state!r}; allowed: {TIMELINE_STATES}")
        if end_s < start_s:
            raise MetricsError(f"timeline interval ends before it starts ({start_s}>{end_s})")
        row = {
            "instance": instance,
            "state": state,
            "start_s": start_s,
            "end_s": end_s,
            "version": version,
        }
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()

    def extend(self, rows: Iterable[Mapping[str, Any]]) -> None:
        for r in rows:
            self.interval(
                str(r["instance"]),
                str(r["state"]),
                float(r["start_s"]),
                float(r["end_s"]),
                version=int(r.get("version", 0)),
            )

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()


def busy_fractions(
    rows: Iterable[Mapping[str, Any]], *, start_s: float, end_s: float
) -> dict[str, float]:
    """Per-instance fraction of ``[start_s, end_s]`` spent ``busy`` (from timeline rows)."""
    span = end_s - start_s
    busy: dict[str, float] = {}
    for r in rows:
        inst = str(r["instance"])
        busy.setdefault(inst, 0.0)
        if r["state"] != "busy":
            continue
        lo, hi = max(float(r["start_s"]), start_s), min(float(r["end_s"]), end_s)
        if hi > lo:
            busy[inst] += hi - lo
    return {k: (v / span if span > 0 else 0.0) for k, v in sorted(busy.items())}
