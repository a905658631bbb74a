"""Engine statistics: the scheduler's own numbers and a sliding token-rate window.

vLLM hands ``SchedulerStats`` (running / waiting requests, KV-cache usage) to every stat logger
after each engine step. :func:`stat_logger_factory` builds a logger that stores the latest one
in an :class:`EngineStats` owned by the adapter; the adapter reads it in ``snapshot()``.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class SchedulerView:
    """The latest scheduler numbers reported by the engine (all zero before the first step)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    time_s: float = 0.0


class EngineStats:
    """Latest scheduler view + a sliding window of generated-token counts + the number of
    engine steps that produced output (the snapshot's ``decode_steps``)."""

    def __init__(self, *, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self.scheduler = SchedulerView()
        self._tokens: collections.deque[tuple[float, int]] = collections.deque()
        self._in_window = 0
        self._since = clock()
        self.steps = 0

    def record_step(self) -> None:
        self.steps += 1

    def record_scheduler(self, stats: Any) -> None:
        self.scheduler = SchedulerView(
            num_running=int(stats.num_running_reqs),
            num_waiting=int(stats.num_waiting_reqs)
            + int(getattr(stats, "num_skipped_waiting_reqs", 0)),
            kv_cache_usage=float(stats.kv_cache_usage),
            time_s=self._clock(),
        )

    def record_tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = self._clock()
        self._tokens.append((now, n))
        self._in_window += n
        self._expire(now)

    def throughput(self) -> float:
        """Generated tokens per second over the last ``window_s`` seconds."""
        now = self._clock()
        self._expire(now)
        # Right after start the window is not full yet: divide by the time actually covered.
        span = max(min(self.window_s, now - self._since), 1e-3)
        return self._in_window / span

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self._tokens and self._tokens[0][0] < horizon:
            self._in_window -= self._tokens.popleft()[1]


def stat_logger_factory(sink: EngineStats) -> Callable[[Any, int], Any]:
    """A vLLM ``PerEngineStatLoggerFactory`` whose loggers write into ``sink``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _SchedulerStatsLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                sink.record_scheduler(scheduler_stats)
            if iteration_stats is not None:  # a step that produced output
                sink.record_step()

        def log_engine_initialized(self) -> None:
            pass

    return _SchedulerStatsLogger
