"""The trainer as an actor: one GRPO/DAPO step per consumed batch, then push the new version.

Samples arrive as plain dicts (:class:`TrainSample` fields); the new weights leave through the
parameter server (NIXL), tagged with the trainer's version, so a rollout instance can pull them.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from staleflow_trainer.actors.log_relay import KeepsWarnings
from staleflow_trainer.actors.ts_link import StoreLink
from staleflow_trainer.actors.work_wire import batch_members
from staleflow_trainer.config import from_dict
from staleflow_trainer.trainer import Trainer, TrainSample
from staleflow_trainer.trainer.stream import finish_streamed, stream_part

log = structlog.get_logger(__name__)

_RETRY_EVERY_S = 0.5


class TrainerActor(KeepsWarnings):
    """Wrap with ``ray.remote``. ``cfg`` is the resolved app config as a plain dict."""

    def __init__(
        self,
        *,
        cfg: Mapping[str, Any],
        model_path: str,
        ps_address: Sequence[Any],
        ps_token: str | None = None,
        checkpoint_dir: str | None = None,
        ts_address: Sequence[Any] | None = None,
        ts_token: str | None = None,
    ) -> None:
        self._keep_warnings()
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
        self._ts = StoreLink(ts_address, ts_token) if ts_address else None
        self._push_retry_s = float(app.param_server.push_retry_s)
        self._step_delay_s = float(app.trainer.step_delay_s)
        self._stream = bool(app.trainer.stream_batch)
        self._push_failures: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._step_lock = threading.Lock()
        # (consumed version, metrics, pushed) of the last step: replayed, not retrained
        self._last_step: tuple[int, dict[str, Any], bool] | None = None
        # (consumed version, trajectory ids) of the last steps actually trained (not replayed)
        self._replays = 0
        self._trained: collections.deque[tuple[int, list[str]]] = collections.deque(maxlen=256)
        log.info("trainer_ready", version=self._trainer.version, resumed=checkpoint_dir is not None)

    def version(self) -> int:
        return self._trainer.version

    def busy(self) -> bool:
        """True while a training step (or its push) runs, or a streamed part."""
        return self._step_lock.locked()

    def push(self) -> dict[str, Any]:
        """Push the current weights as version ``self.version`` to the parameter server.

        A push the server refuses or that breaks (a storage worker is down: ``PushFailed`` /
        ``WorkerLost`` / ``TransferFailed``) is retried every ``_RETRY_EVERY_S`` for up to
        ``param_server.push_retry_s``; each failure is logged and recorded
        (:meth:`push_failures`). A version is published only by a commit that completed, so a
        failed attempt never leaves a partial version for an instance to load.
        """
        from param_server.errors import ParamServerError, PushConflict

        t0 = time.perf_counter()
        version = self._trainer.version
        deadline = time.monotonic() + self._push_retry_s
        attempts = 0
        while True:
            attempts += 1
            try:
                res = self._ps.push(version, _unshared(self._trainer.state_dict()))
                break
            except PushConflict as e:
                # an earlier attempt may have committed after all: then the version is there
                if self._ps.status().get("latest") == version:
                    nbytes = sum(
                        t.numel() * t.element_size() for t in self._trainer.state_dict().values()
                    )
                    return {"version": version, "nbytes": nbytes, "push_s": time.perf_counter() - t0,
                            "push_attempts": attempts}  # fmt: skip
                self._record_failure(version, attempts, e)
                raise
            except ParamServerError as e:
                self._record_failure(version, attempts, e)
                if time.monotonic() >= deadline:
                    raise
                time.sleep(_RETRY_EVERY_S)
        return {
            "version": res.version,
            "nbytes": res.nbytes,
            "push_s": time.perf_counter() - t0,
            "push_attempts": attempts,
        }

    def _record_failure(self, version: int, attempt: int, e: Exception) -> None:
        with self._lock:
            self._push_failures.append(
                {"version": version, "attempt": attempt, "error": f"{type(e).__name__}: {e}"}
            )
        log.warning("push_failed", version=version, attempt=attempt, error=str(e))

    def push_failures(self) -> list[dict[str, Any]]:
        """Every failed push attempt so far: ``{"version", "attempt", "error"}``."""
        with self._lock:
            return list(self._push_failures)

    def state_digest(self) -> dict[str, Any]:
        """SHA-256 of the model weights and of the optimizer state, plus the version (tests
        compare them across a checkpoint and a resume)."""
        return state_digest(self._trainer)

    def train_step(
        self,
        samples: Sequence[Mapping[str, Any]],
        *,
        consumed_version: int | None = None,
        groups: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """Train on the batch, push the new version; returns the trainer's metrics + push info.

        ``consumed_version`` (the protocol version of the consumed batch) makes the call
        idempotent across a coordinator crash: a step for a batch this trainer already trained
        returns that step's metrics (pushing again if its push had not completed) instead of
        training twice, and one still running is waited for (steps run one at a time).
        ``groups``: with ``trainer.stream_batch``, the batch's group ids, where ``samples``
        leaves out groups already streamed in.
        """
        with self._step_lock:
            v = self._trainer.version
            last = self._last_step
            if consumed_version is not None and last is not None and last[0] == consumed_version:
                metrics = dict(last[1])
                if not last[2]:  # trained, but the push never completed
                    metrics.update(self._push_metrics())
                    self._last_step = (consumed_version, metrics, True)
                self._replays += 1
                log.info("train_step_replayed", consumed_version=consumed_version, version=v)
                return metrics
            if consumed_version is not None and consumed_version != v:
                raise RuntimeError(
                    f"train_step for consumed version {consumed_version}, but the trainer is at "
                    f"version {v} (last step trained {None if last is None else last[0]})"
                )
            if not samples and not groups:
                raise RuntimeError(
                    f"train_step for consumed version {consumed_version} without samples, and "
                    "this trainer has no record of that step"
                )
            batch = [TrainSample(**s) for s in samples]
            if self._stream:
                metrics = dict(finish_streamed(self._trainer, batch, groups))
            else:
                metrics = dict(self._trainer.train_step(batch))
            if self._step_delay_s > 0:  # trainer.step_delay_s: a slower trainer, by config
                time.sleep(self._step_delay_s)
            metrics["version"] = self._trainer.version
            self._last_step = (v, metrics, False)
            metrics.update(self._push_metrics())
            self._last_step = (v, metrics, True)
            return metrics

    def train_batch(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """Train a consumed batch named by ids (``work_wire.train_batch``: ``version``,
        ``group_ids``, each group's ``members`` packed, ``staleness`` and ``rewards`` per
        member): the payloads are read from the trajectory server here, never through the
        control shell.
        Idempotent per consumed version like :meth:`train_step` (a replayed batch whose
        payloads the store already released answers from the record of that step)."""
        version = int(batch["version"])
        with self._step_lock:
            last = self._last_step
            st = self._trainer.stream  # groups already streamed in are not read again
            streamed = set(st.groups) if st is not None and st.version == version else set()
        if last is not None and last[0] == version:
            return self.train_step([], consumed_version=version)
        groups = [str(g) for g in batch["group_ids"]]
        # parts only ever add groups; one the batch lacks makes the step train it whole
        skip = streamed if streamed <= set(groups) else set()
        samples = self._read_samples(batch, skip=skip)
        replays = self._replays
        metrics = self.train_step(
            samples, consumed_version=version, groups=groups if self._stream else None
        )
        if self._replays == replays:
            with self._lock:
                ids = [t for members in batch_members(batch) for t in members]
                self._trained.append((version, ids))
        return metrics

    def stream_batch_part(self, part: Mapping[str, Any]) -> dict[str, Any]:
        """Groups settled in the batch of consumed version ``part["version"]`` before it is
        complete (``trainer.stream_batch``; the wire of :meth:`train_batch`): their log-probs,
        forward and backward now, the optimizer step with that version's :meth:`train_batch`.
        A part for another version than the one this trainer trains next (its step is over)
        is ignored, as is a group already streamed in. Returns ``{"streamed": samples}``."""
        version = int(part["version"])
        if not self._stream or version != self._trainer.version:
            return {"streamed": 0}  # (checked again under the lock)
        samples = [TrainSample(**s) for s in self._read_samples(part)]
        with self._step_lock:
            if version != self._trainer.version:
                return {"streamed": 0}
            n = stream_part(self._trainer, samples)
        log.debug("batch_part_streamed", version=version, samples=n)
        return {"streamed": n}

    def trained(self) -> list[tuple[int, list[str]]]:
        """``(consumed version, trajectory ids)`` of the most recent batches this trainer
        actually trained (a replayed step is not listed twice)."""
        with self._lock:
            return list(self._trained)

    def _read_samples(
        self, batch: Mapping[str, Any], *, skip: Collection[str] = ()
    ) -> list[dict[str, Any]]:
        """The samples of ``batch``'s groups, but those in ``skip``, from the trajectory
        server."""
        if self._ts is None:
            raise RuntimeError("the trainer has no trajectory-server address")
        groups = batch_members(batch)
        ids = [
            t
            for gid, members in zip(batch["group_ids"], groups, strict=True)
            if str(gid) not in skip
            for t in members
        ]

        async def read(ts: Any) -> dict[str, Any]:
            return {ft.trajectory.trajectory_id: ft for ft in await ts.finished(ids)}

        finished = self._ts.run(read)
        samples = []
        for gid, members, stale, rewards in zip(
            batch["group_ids"], groups, batch["staleness"], batch["rewards"],
            strict=True,
        ):  # fmt: skip
            if str(gid) in skip:
                continue
            for tid, s, r in zip(members, stale, rewards, strict=True):
                ft = finished[str(tid)]
                t = ft.trajectory
                samples.append(
                    {
                        "group_id": str(gid),
                        "prompt_ids": list(t.prompt_token_ids),
                        "response_ids": list(t.generated_token_ids),
                        "rollout_logprobs": list(t.generated_logprobs),
                        "reward": float(r),
                        "truncated": str(ft.finish_reason) == "length",
                        "v_traj": int(t.v_traj or 0),
                        "staleness": int(s),
                    }
                )
        return samples

    def _push_metrics(self) -> dict[str, Any]:
        pushed = self.push()
        return {
            "push_s": pushed["push_s"],
            "push_attempts": pushed["push_attempts"],
            "version": self._trainer.version,
        }

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
        if self._ts is not None:
            self._ts.close()


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


def state_digest(trainer: Trainer) -> dict[str, Any]:
    """:func:`digest_of` the trainer's live model and optimizer."""
    return digest_of(trainer.state_dict(), trainer.optimizer.state_dict(), trainer.version)


def digest_of(model: Any, optimizer: Any, version: int) -> dict[str, Any]:
    """SHA-256 over model tensors and over optimizer tensors/scalars (a checkpoint's
    ``trainer.pt`` payload gives the same digest as the trainer it restores)."""
    import hashlib

    import torch

    def feed(h: Any, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous().reshape(-1)
            h.update(str(t.dtype).encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, Mapping):
            for k in sorted(obj, key=str):
                h.update(str(k).encode())
                feed(h, obj[k])
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                feed(h, v)
        else:
            h.update(repr(obj).encode())

    m, o = hashlib.sha256(), hashlib.sha256()
    feed(m, {k: v for k, v in model.items() if k != "lm_head.weight"})
    feed(o, optimizer)
    return {"version": int(version), "model": m.hexdigest(), "optimizer": o.hexdigest()}
