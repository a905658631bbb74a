"""Run observability: per-step JSONL metrics, an instance timeline, TensorBoard, a progress bar.

``RUN_DIR/metrics.jsonl`` holds one JSON object per training step. Required keys (the
documented contract, :data:`REQUIRED_KEYS`): ``step``, ``version``, ``tokens_per_s``,
``max_staleness``, ``mean_staleness``, ``reward_mean``, ``trainer_wait_s``. Conventional
extra keys written by the app: ``staleness_hist`` ({staleness: count} of the consumed
batch), ``instance_busy`` ({instance: busy fraction}), ``syncs``, ``migrations``,
``interrupts``, ``queue_depths`` ({name: depth}), ``time_s`` plus the trainer's metrics.

``RUN_DIR/timeline.jsonl`` holds one interval per line: ``instance``, ``state``
(``busy`` / ``syncing`` / ``idle``), ``start_s``, ``end_s``, ``version``.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import structlog

from staleflow_trainer.errors import StaleflowError

log = structlog.get_logger(__name__)

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


def staleness_summary(stalenesses: Sequence[int]) -> dict[str, Any]:
    """``max_staleness``, ``mean_staleness`` and ``staleness_hist`` of a consumed batch."""
    if not stalenesses:
        return {"max_staleness": 0, "mean_staleness": 0.0, "staleness_hist": {}}
    hist = Counter(int(s) for s in stalenesses)
    return {
        "max_staleness": max(hist),
        "mean_staleness": sum(stalenesses) / len(stalenesses),
        "staleness_hist": {str(k): hist[k] for k in sorted(hist)},
    }


def step_record(
    *,
    step: int,
    version: int,
    tokens: int,
    elapsed_s: float,
    stalenesses: Sequence[int],
    rewards: Sequence[float],
    trainer_wait_s: float,
    **extra: Any,
) -> dict[str, Any]:
    """Build a per-step record with every required key.

    ``tokens`` are the response tokens produced for the consumed batch, ``elapsed_s`` the
    wall (or virtual) time since the previous step; extra keyword arguments are added as is
    (e.g. ``instance_busy=…, syncs=…, queue_depths=…`` and the trainer's metrics).
    """
    record: dict[str, Any] = {
        "step": step,
        "version": version,
        "tokens_per_s": tokens / elapsed_s if elapsed_s > 0 else 0.0,
        "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "trainer_wait_s": trainer_wait_s,
        **staleness_summary(stalenesses),
    }
    record.update(extra)
    return record


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


class MetricsWriter:
    """Appends per-step records to ``metrics.jsonl`` and (optionally) TensorBoard.

    ``resume_step``: when resuming from a checkpoint taken after step ``k``, records with
    ``step > k`` (written after that checkpoint by the crashed run) are removed first, so the
    file again has exactly one record per step. ``backfill``: the checkpoint's records of
    steps ``<= k`` that the file lacks (a driver killed before it wrote them) are added.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        resume_step: int | None = None,
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
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

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
        if self._tb is not None:
            step = int(row["step"])
            scalars: dict[str, float] = {}
            for k, v in row.items():
                if k != "step":
                    _flatten(k, v, scalars)
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            hist = row.get("staleness_hist") or {}
            values = [int(s) for s, c in hist.items() for _ in range(int(c))]
            if values:
                import numpy as np

                self._tb.add_histogram("staleness", np.asarray(values), step)
            self._tb.flush()
        return row

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

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


class ProgressBar:
    """A rich progress bar over training steps showing reward, staleness and tokens/s."""

    def __init__(self, total_steps: int, *, enabled: bool = True, start_step: int = 0) -> None:
        self._progress = None
        self._task = None
        self._tokens = 0.0  # consumed tokens and the time span seen, for the run's mean rate
        self._first_time: float | None = None
        self._last_time: float | None = None
        if not enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
        )
        self._task = self._progress.add_task(
            "train", total=total_steps, completed=start_step, info=""
        )

    def __enter__(self) -> ProgressBar:
        if self._progress is not None:
            self._progress.start()
        return self

    def run_tokens_per_s(self, record: Mapping[str, Any]) -> float | None:
        """Fold one step record in; the mean consumed tokens/s since the first step's end
        (None until two records with ``tokens`` and ``time_s`` were seen). A single step's
        ``tokens_per_s`` is 0 when its batch was generated during the previous step."""
        tokens, t = record.get("tokens"), record.get("time_s")
        if tokens is None or t is None:
            return None
        if self._first_time is None:
            self._first_time = float(t)  # the first batch's tokens were made before it
            return None
        self._tokens += float(tokens)
        self._last_time = float(t)
        span = self._last_time - self._first_time
        return self._tokens / span if span > 0 else None

    def update(self, step: int, record: Mapping[str, Any]) -> None:
        mean = self.run_tokens_per_s(record)
        if self._progress is None:
            return
        info = (
            f"reward {record.get('reward_mean', 0.0):.3f}  "
            f"stale max {record.get('max_staleness', 0)} mean "
            f"{record.get('mean_staleness', 0.0):.2f}  "
            f"{record.get('tokens_per_s', 0.0):.0f} tok/s"
            + (f" (run {mean:.0f})" if mean is not None else "")
        )
        assert self._task is not None
        self._progress.update(self._task, completed=step, info=info)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
