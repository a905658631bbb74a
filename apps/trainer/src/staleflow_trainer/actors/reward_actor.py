"""A reward worker: decodes responses and scores them with the configured plug-in.

Failures (an exception, a non-score, a timeout) are retried by :class:`RewardRunner`; a
trajectory that still fails comes back ``dropped`` with the reason, and the control loop releases
its group through the protocol.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from staleflow_trainer.reward import RewardRunner


class RewardActor:
    """Wrap with ``ray.remote``. ``score`` takes and returns plain dicts."""

    def __init__(self, *, fn: str, retries: int, timeout_s: float, tokenizer_path: str) -> None:
        from transformers import AutoTokenizer

        self._runner = RewardRunner(fn, retries=retries, timeout_s=timeout_s)
        self._tok = AutoTokenizer.from_pretrained(tokenizer_path)

    def score(self, items: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """``items``: ``{"trajectory_id", "response_ids", "data_source", "ground_truth",
        "extra_info"}`` → ``{"trajectory_id", "score" | None, "dropped", "reason", "text"}``."""
        out = []
        for it in items:
            text = str(self._tok.decode(list(it["response_ids"]), skip_special_tokens=True))
            o = self._runner.score(
                trajectory_id=str(it["trajectory_id"]),
                data_source=str(it.get("data_source", "unknown")),
                solution_str=text,
                ground_truth=str(it.get("ground_truth", "")),
                extra_info=dict(it.get("extra_info") or {}),
            )
            out.append(
                {
                    "trajectory_id": o.trajectory_id,
                    "score": o.score,
                    "dropped": o.dropped,
                    "reason": o.reason,
                    "text": text,
                }
            )
        return out
