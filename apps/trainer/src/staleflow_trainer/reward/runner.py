"""Run a reward function with a timeout and retries; failures become drops with a reason.

A call that raises, returns a non-score, or exceeds ``timeout_s`` is retried up to
``retries`` more times; after that the outcome is ``dropped`` with the last reason, and the
caller releases the trajectory's group through the protocol. The plug-in runs in a child
process (:class:`~staleflow_trainer.reward.worker.RewardWorker`): a call that exceeds
``timeout_s`` kills it (counted in ``timeouts``) and the next call starts a fresh one, so a
hanging plug-in costs one process at a time, never a thread per call. Use it inside a
reward-worker actor, one runner per worker.

A score is any real number (``int``, ``float``, ``bool``, numpy scalars, anything real with
``__float__``) or a dict with a ``"score"`` key; it must be finite and within float32 range,
the precision the trainer computes advantages in.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
from collections.abc import Mapping
from typing import Any

import attrs
import structlog

from staleflow_trainer.errors import RewardError
from staleflow_trainer.reward.plugin import RewardFn
from staleflow_trainer.reward.worker import RewardWorker

log = structlog.get_logger(__name__)


@attrs.frozen(kw_only=True)
class RewardOutcome:
    trajectory_id: str
    score: float | None  # None when dropped
    extra: dict[str, Any] = attrs.field(factory=dict)  # non-"score" keys of a dict result
    attempts: int = 1
    dropped: bool = False
    reason: str | None = None  # why dropped (last failure)
    elapsed_s: float = 0.0


#: The largest reward the trainer's float32 arithmetic holds.
MAX_ABS_REWARD = 3.4028234663852886e38


def _as_real(value: Any) -> float | None:
    """``value`` as a float if it is a real number (numpy scalars, 0-d arrays and tensors
    included), else None. Strings and complex numbers are not real numbers here."""
    if isinstance(value, bool | numbers.Real):
        return float(value)
    if isinstance(value, str | bytes | numbers.Complex) or not hasattr(value, "__float__"):
        return None
    if getattr(getattr(value, "dtype", None), "kind", "f") == "c":  # a complex numpy value
        return None
    try:
        return float(value)
    except Exception:  # e.g. an array or tensor of several elements
        return None


def normalise_result(value: Any) -> tuple[float, dict[str, Any]]:
    """A real number or a dict with ``"score"`` → (score, extra). RewardError otherwise: not a
    number, not finite, or beyond float32 range."""
    extra: dict[str, Any] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            raise RewardError(f"reward dict has no 'score' key (keys: {sorted(value)})")
        extra = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    score = _as_real(value)
    if score is None:
        raise RewardError(
            f"reward must be a real number or a dict with 'score', got {value!r:.200} "
            f"({type(value).__name__})"
        )
    if not math.isfinite(score):
        raise RewardError(f"reward is not finite: {score!r}")
    if abs(score) > MAX_ABS_REWARD:
        raise RewardError(
            f"reward {score!r} is beyond float32 range (|reward| <= {MAX_ABS_REWARD:.4g}), the "
            "precision the trainer computes in"
        )
    return score, extra


def _dotted_path(fn: RewardFn | str) -> str:
    """The path the worker process imports ``fn`` by: a string as given, a function by its
    module and qualified name (so it must be defined at module level)."""
    if isinstance(fn, str):
        return fn
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or not name or "<" in name:
        raise RewardError(
            f"reward function {fn!r} must be importable by a dotted path 'pkg.module:function' "
            "(a module-level function): it runs in a separate process",
            fn=repr(fn),
        )
    return f"{module}:{name}"


class RewardRunner:
    """Calls ``fn(data_source, solution_str, ground_truth, extra_info)`` safely in a worker
    process. ``fn``: a dotted path, or a module-level function (passed by its path)."""

    def __init__(self, fn: RewardFn | str, *, retries: int = 2, timeout_s: float = 10.0) -> None:
        if retries < 0:
            raise RewardError(f"retries must be >= 0, got {retries}")
        if not timeout_s > 0:
            raise RewardError(f"timeout_s must be > 0, got {timeout_s}")
        self.fn_name = _dotted_path(fn)
        self.retries = retries
        self.timeout_s = timeout_s
        self.timeouts = 0
        self._lock = threading.Lock()
        self._worker = RewardWorker(self.fn_name)
        self._worker.start()  # a plug-in that cannot be imported fails here, not per call

    @classmethod
    def from_config(cls, cfg: Any) -> RewardRunner:  # cfg: config.RewardConfig
        return cls(cfg.fn, retries=cfg.retries, timeout_s=cfg.timeout_s)

    @property
    def worker(self) -> RewardWorker:
        return self._worker

    def close(self) -> None:
        """Stop the worker process (a later call starts a new one)."""
        with self._lock:
            self._worker.kill()

    def _call_once(self, args: tuple[Any, ...]) -> tuple[float, dict[str, Any]]:
        with self._lock:
            try:
                return self._worker.call(args, timeout_s=self.timeout_s)
            except TimeoutError:
                self.timeouts += 1
                raise

    def score(
        self,
        *,
        trajectory_id: str,
        data_source: str,
        solution_str: str,
        ground_truth: str,
        extra_info: Mapping[str, Any] | None = None,
    ) -> RewardOutcome:
        args = (data_source, solution_str, ground_truth, dict(extra_info or {}))
        t0 = time.perf_counter()
        reason = "unknown"
        for attempt in range(1, self.retries + 2):
            try:
                score, extra = self._call_once(args)
            except (RewardError, TimeoutError) as e:
                reason = f"{'timeout' if isinstance(e, TimeoutError) else 'error'}: {e}"
                log.warning(
                    "reward_attempt_failed",
                    trajectory_id=trajectory_id,
                    attempt=attempt,
                    reason=reason,
                    fn=self.fn_name,
                )
                continue
            return RewardOutcome(
                trajectory_id=trajectory_id,
                score=score,
                extra=extra,
                attempts=attempt,
                elapsed_s=time.perf_counter() - t0,
            )
        log.warning("reward_dropped", trajectory_id=trajectory_id, reason=reason, fn=self.fn_name)
        return RewardOutcome(
            trajectory_id=trajectory_id,
            score=None,
            attempts=self.retries + 1,
            dropped=True,
            reason=reason,
            elapsed_s=time.perf_counter() - t0,
        )
