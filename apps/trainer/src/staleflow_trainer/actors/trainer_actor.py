"""The trainer as an actor: one GRPO/DAPO step per consumed batch, then push the new version.

Samples arrive as plain dicts (:class:`TrainSample` fields); the new weights leave through the
parameter server (NIXL), tagged with the trainer's version, so a rollout instance can pull them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from staleflow_trainer.config import from_dict
from staleflow_trainer.trainer import Trainer, TrainSample

log = structlog.get_logger(__name__)


class TrainerActor:
    """Wrap with ``ray.remote``. ``cfg`` is the resolved app config as a plain dict."""

    def __init__(
        self,
        *,
        cfg: Mapping[str, Any],
        model_path: str,
        ps_address: Sequence[Any],
        ps_token: str | None = None,
        checkpoint_dir: str | None = None,
    ) -> None:
        app = from_dict(cfg)
        self._trainer = Trainer(
            app.trainer,
            model_path,
            max_response_len=app.rollout.sampling.max_new_tokens,
            seed=app.run.seed,
            dtype=app.model.dtype,
        )
        if checkpoint_dir is not None:
            self._trainer.load_checkpoint(checkpoint_dir)
        from param_server import ParamServerClient

        self._ps = ParamServerClient(tuple(ps_address), token=ps_token or None, name="trainer-0")
        log.info("trainer_ready", version=self._trainer.version, resumed=checkpoint_dir is not None)

    def version(self) -> int:
        return self._trainer.version

    def push(self) -> dict[str, Any]:
        """Push the current weights as version ``self.version`` to the parameter server."""
        t0 = time.perf_counter()
        res = self._ps.push(self._trainer.version, _unshared(self._trainer.state_dict()))
        return {"version": res.version, "nbytes": res.nbytes, "push_s": time.perf_counter() - t0}

    def train_step(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Train on the batch, push the new version; returns the trainer's metrics + push info."""
        batch = [TrainSample(**s) for s in samples]
        metrics: dict[str, Any] = dict(self._trainer.train_step(batch))
        pushed = self.push()
        metrics["push_s"] = pushed["push_s"]
        metrics["version"] = self._trainer.version
        return metrics

    def logprobs(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> list[float]:
        """Per-token log-probs of ``response_ids`` after ``prompt_ids`` under current weights."""
        s = TrainSample(
            group_id="probe",
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            rollout_logprobs=[0.0] * len(response_ids),
            reward=0.0,
        )
        return self._trainer.compute_logprobs([s])[0]

    def save_checkpoint(self, ckpt_dir: str) -> str:
        return str(self._trainer.save_checkpoint(Path(ckpt_dir)))

    def close(self) -> None:
        self._ps.close()


def _unshared(state: Mapping[str, Any]) -> dict[str, Any]:
    """Copy tensors that share storage with an earlier one (tied embeddings: ``lm_head.weight``
    is ``embed_tokens.weight``): NIXL must not register the same memory twice."""
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out
