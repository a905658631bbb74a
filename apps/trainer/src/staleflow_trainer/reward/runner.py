"""Run a reward function with a timeout and retries; failures become drops with a reason.

A call that raises, returns a non-score, or exceeds ``timeout_s`` is retried up to
``retries`` more times; after that the outcome is ``dropped`` with the last reason, and the
caller releases the trajectory's group through the protocol. A hanging call cannot be killed
from Python; it is abandoned on a daemon thread (counted in ``abandoned_calls``) and the
runner moves on. Use it inside a reward-worker actor, one runner per worker.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from typing import Any

import attrs
import structlog

from staleflow_trainer.errors import RewardError
from staleflow_trainer.reward.plugin import RewardFn, load_reward_fn

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


def normalise_result(value: Any) -> tuple[float, dict[str, Any]]:
    """A float, int, bool or a dict with ``"score"`` → (score, extra). RewardError otherwise."""
    extra: dict[str, Any] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            raise RewardError(f"reward dict has no 'score' key (keys: {sorted(value)})")
        extra = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, (int, float)):
        raise RewardError(f"reward must be a number or a dict with 'score', got {value!r}")
    score = float(value)
    if not math.isfinite(score):
        raise RewardError(f"reward is not finite: {score!r}")
    return score, extra


class RewardRunner:
    """Calls ``fn(data_source, solution_str, ground_truth, extra_info)`` safely."""

    def __init__(self, fn: RewardFn | str, *, retries: int = 2, timeout_s: float = 10.0) -> None:
        if retries < 0:
            raise RewardError(f"retries must be >= 0, got {retries}")
        if not timeout_s > 0:
            raise RewardError(f"timeout_s must be > 0, got {timeout_s}")
        self.fn_name = fn if isinstance(fn, str) else getattr(fn, "__qualname__", repr(fn))
        self.fn = load_reward_fn(fn) if isinstance(fn, str) else fn
        self.retries = retries
        self.timeout_s = timeout_s
        self.abandoned_calls = 0

    @classmethod
    def from_config(cls, cfg: Any) -> RewardRunner:  # cfg: config.RewardConfig
        return cls(cfg.fn, retries=cfg.retries, timeout_s=cfg.timeout_s)

    def _call_once(self, args: tuple[Any, ...]) -> tuple[float, dict[str, Any]]:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = self.fn(*args)
            except BaseException as e:  # the plug-in's failure is data here, not a crash
                box["error"] = e

        t = threading.Thread(target=target, name="reward-call", daemon=True)
        t.start()
        t.join(self.timeout_s)
        if t.is_alive():
            self.abandoned_calls += 1
            raise TimeoutError(f"reward call exceeded timeout_s={self.timeout_s}")
        if "error" in box:
            err = box["error"]
            raise RewardError(f"{type(err).__name__}: {err}") from err
        return normalise_result(box.get("value"))

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
