"""The GRPO/DAPO trainer: one optimizer step per consumed batch; version = steps taken.

A step: (1) rewards (+ DAPO overlong penalty) → group-normalized advantages; (2) "old"
log-probs recomputed by the current model in one no-grad forward; (3) for each of
``mini_batches`` updates: clip-higher surrogate × truncated IS weight
``min(exp(old − rollout), tis_cap)``, token-mean, accumulated over micro-batches, grad-norm
clip, AdamW, (4) LR scheduler step. ``version`` goes ``k → k+1``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from staleflow_trainer.config import TrainerConfig
from staleflow_trainer.errors import CheckpointError, TrainerError
from staleflow_trainer.trainer import fsdp as fsdp_mod
from staleflow_trainer.trainer.batch import TrainSample, collate, token_logprobs
from staleflow_trainer.trainer.checkpoint import load_torch, save_torch
from staleflow_trainer.trainer.loss import (
    group_advantages,
    overlong_penalty,
    policy_loss,
    tis_weights,
)
from staleflow_trainer.trainer.optim import make_optimizer, make_scheduler
from staleflow_trainer.trainer.stream import StreamedStep

log = structlog.get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHECKPOINT_FILE = "trainer.pt"


def select_device(choice: str) -> torch.device:
    """``auto`` → cuda if available, else cpu. ``cuda`` without a GPU is an error."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise TrainerError("trainer.device=cuda but no CUDA device is available", field="device")
    return torch.device(choice)


class Trainer:
    """Owns the policy model, optimizer and scheduler.

    ``model_path`` is a Hugging Face directory (``save_pretrained``). ``max_response_len`` is
    the rollout's ``max_new_tokens`` (needed by the overlong penalty). ``version`` is the
    model version the weights represent; it starts at ``initial_version`` and each
    :meth:`train_step` adds one.
    """

    def __init__(
        self,
        cfg: TrainerConfig,
        model_path: str | Path,
        *,
        max_response_len: int,
        seed: int = 0,
        dtype: str = "float32",
        pad_token_id: int | None = None,
        initial_version: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.max_response_len = max_response_len
        self.device = select_device(cfg.device)
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        torch.manual_seed(seed)
        model: Any = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=_DTYPES[dtype])
        self.model: Any = model.to(self.device)
        self.model.train()
        self.pad_token_id = (
            pad_token_id if pad_token_id is not None else (self.model.config.pad_token_id or 0)
        )
        self.rank, self.world_size = 0, 1
        if cfg.fsdp:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise TrainerError(
                    "trainer.fsdp=true needs torch.distributed initialised (one process per GPU)",
                    field="fsdp",
                )
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            fsdp_mod.shard_model(self.model)
        self.optimizer = make_optimizer(self.model, cfg)
        self.scheduler = make_scheduler(self.optimizer, cfg)
        self.version = initial_version
        self.steps_done = 0
        #: the parts of the next step streamed in so far (``trainer.stream_batch``)
        self.stream: StreamedStep | None = None

    # ------------------------------------------------------------------------------- training

    def _check_batch(self, batch: Sequence[TrainSample]) -> None:
        if not batch:
            raise TrainerError("train_step needs a non-empty batch", field="batch")
        if self.world_size > 1 and len(batch) % self.world_size:
            raise TrainerError(
                f"batch of {len(batch)} does not split across {self.world_size} ranks",
                field="batch",
            )
        if len(batch) % self.cfg.mini_batches:
            raise TrainerError(
                f"batch of {len(batch)} is not divisible into {self.cfg.mini_batches} mini-batches",
                field="batch",
            )

    def scores(self, batch: Sequence[TrainSample]) -> torch.Tensor:
        """Rewards plus the DAPO overlong penalty (if enabled), ``[N]``."""
        ov = self.cfg.overlong
        out = []
        for s in batch:
            r = s.reward
            if ov.enabled:
                length = len(s.response_ids) + (1 if s.truncated else 0)
                r += overlong_penalty(
                    length,
                    max_len=self.max_response_len,
                    buffer_len=ov.buffer_len,
                    factor=ov.penalty_factor,
                )
            out.append(r)
        # float64: a reward float32 cannot hold must not become inf before it is checked
        return torch.tensor(out, dtype=torch.float64)

    def advantages(self, batch: Sequence[TrainSample]) -> torch.Tensor:
        ids: dict[str, int] = {}
        index = torch.tensor([ids.setdefault(s.group_id, len(ids)) for s in batch])
        return group_advantages(self.scores(batch), index, eps=self.cfg.adv_eps)

    def checked_advantages(self, batch: Sequence[TrainSample]) -> torch.Tensor:
        """:meth:`advantages` in float32, refused (TrainerError) where one is not finite."""
        adv = self.advantages(batch)
        _require_finite("reward-based advantage", adv)
        adv = adv.to(torch.float32)
        _require_finite("advantage (in float32)", adv)
        return adv

    def micro_chunks(self, idx: list[int]) -> list[list[int]]:
        size = self.cfg.micro_batch_size or len(idx)
        return [idx[i : i + size] for i in range(0, len(idx), size)]

    @torch.no_grad()
    def compute_logprobs(self, batch: Sequence[TrainSample]) -> list[list[float]]:
        """Per-token log-probs of each sample's response under the current weights."""
        out: list[list[float]] = []
        for chunk in self.micro_chunks(list(range(len(batch)))):
            samples = [batch[i] for i in chunk]
            c = _dev(collate(samples, pad_id=self.pad_token_id), self.device)
            lp = token_logprobs(self.model, c)
            for row, s in enumerate(samples):
                p, r = len(s.prompt_ids), len(s.response_ids)
                out.append(lp[row, p - 1 : p - 1 + r].tolist())
        return out

    def train_step(self, batch: Sequence[TrainSample]) -> dict[str, float]:
        """One optimizer step on ``batch`` (all samples of the consumed buffer, this rank's
        share under FSDP). Returns scalar metrics."""
        self._check_batch(batch)
        t0 = time.perf_counter()
        cfg = self.cfg
        adv_all = self.checked_advantages(batch)
        if self.world_size > 1:
            local = fsdp_mod.local_slice(
                list(range(len(batch))), rank=self.rank, world_size=self.world_size
            )
        else:
            local = list(range(len(batch)))
        samples = [batch[i] for i in local]
        adv = adv_all[local]
        full, old, weights = self.old_logprobs(samples)
        mask = full.response_mask
        per_mini = len(samples) // cfg.mini_batches
        losses, clipfracs, ratios, grad_norms = [], [], [], []
        for m in range(cfg.mini_batches):
            mini = list(range(m * per_mini, (m + 1) * per_mini))
            mini_tokens = int(mask[mini].sum().item())
            if self.world_size > 1:
                import torch.distributed as dist

                t = torch.tensor([mini_tokens], device=self.device)
                dist.all_reduce(t)
                mini_tokens = int(t.item())
            self.optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for chunk in self.micro_chunks(mini):
                out = self.backward_chunk(full, chunk, old, adv, weights, num_tokens=mini_tokens)
                total += float(out.loss.item())
                clipfracs.append(out.clip_frac)
                ratios.append(out.ratio_mean)
            grad_norms.append(self.optimizer_step(total, f"mini-batch {m}"))
            losses.append(total)
        lr = self.finish_step()
        n_tok = int(mask.sum().item())
        with torch.no_grad():
            w_masked = weights[mask]
            kl = (full.rollout_logprobs - old)[mask]
        rewards = torch.tensor([s.reward for s in batch])
        metrics = {
            "loss": float(np.mean(losses)),
            "pg_clipfrac": float(np.mean(clipfracs)),
            "ratio_mean": float(np.mean(ratios)),
            "grad_norm": float(np.mean(grad_norms)),
            "lr": lr,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if len(batch) > 1 else 0.0,
            "score_mean": float(self.scores(batch).mean()),
            "adv_abs_mean": float(adv_all.abs().mean()),
            "response_len_mean": float(np.mean([len(s.response_ids) for s in batch])),
            "tokens": float(n_tok),
            "tis_mean": float(w_masked.mean()) if n_tok else 1.0,
            "tis_capped_frac": float((w_masked >= cfg.tis_cap).float().mean()) if n_tok else 0.0,
            "rollout_old_kl": float(kl.mean()) if n_tok else 0.0,
            "train_time_s": time.perf_counter() - t0,
            "version": float(self.version),
        }
        return metrics

    def old_logprobs(
        self, samples: Sequence[TrainSample]
    ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The collated samples, their "old" log-probs (the trainer's policy before this step's
        update) and their truncated importance weights."""
        full = collate(samples, pad_id=self.pad_token_id)
        with torch.no_grad():
            old = torch.zeros_like(full.rollout_logprobs)
            for chunk in self.micro_chunks(list(range(len(samples)))):
                c = _select(full, chunk)
                old[chunk] = token_logprobs(self.model, _dev(c, self.device)).cpu().float()
        weights = (
            tis_weights(old, full.rollout_logprobs, cap=self.cfg.tis_cap)
            if self.cfg.use_tis
            else torch.ones_like(old)
        )
        return full, old, weights

    def backward_chunk(
        self,
        full: Any,
        chunk: list[int],
        old: torch.Tensor,
        adv: torch.Tensor,
        weights: torch.Tensor,
        *,
        num_tokens: int,
    ) -> Any:
        """Forward and backward of one micro-batch; gradients add up in the parameters."""
        cfg = self.cfg
        c = _dev(_select(full, chunk), self.device)
        lp = token_logprobs(self.model, c)
        out = policy_loss(
            lp,
            old[chunk].to(self.device),
            adv[chunk].to(self.device),
            c.response_mask,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            weights=weights[chunk].to(self.device),
            num_tokens=num_tokens,
        )
        # FSDP averages gradients over ranks; each rank's loss is already a share of the
        # global token mean, so undo the averaging.
        (out.loss * self.world_size).backward()  # type: ignore[no-untyped-call,unused-ignore]
        return out

    def optimizer_step(self, loss: float, where: str) -> float:
        """Clip the accumulated gradients and take the optimizer step; returns the gradient
        norm. A non-finite loss or norm takes no step (TrainerError)."""
        cfg = self.cfg
        if cfg.grad_clip > 0:
            gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        else:
            gn = _grad_norm(self.model)
        if not (math.isfinite(loss) and math.isfinite(float(gn))):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainerError(
                f"non-finite loss ({loss!r}) or gradient norm ({float(gn)!r}) in {where}: no "
                "optimizer step taken; check the rewards and trainer.lr",
                field="loss",
            )
        self.optimizer.step()
        return float(gn)

    def finish_step(self) -> float:
        """After the step's last optimizer update: weights checked, scheduler stepped, version
        advanced. Returns the learning rate the step used."""
        self.require_finite_weights()
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.scheduler.step()
        self.version += 1
        self.steps_done += 1
        return lr

    # ------------------------------------------------------------------------ weights / state

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU weights for pushing to the param server (HF names).

        On a CPU trainer the tensors alias the live parameters (no copy): push (or copy)
        them before the next :meth:`train_step`. Tensors that share storage (tied
        embeddings: ``lm_head.weight`` is ``embed_tokens.weight``) are returned as separate
        copies, so transports that register memory (NIXL) never see the same buffer twice.
        """
        if self.cfg.fsdp:
            state = fsdp_mod.full_state_dict(self.model)
        else:
            state = {
                k: v.detach().to("cpu").contiguous() for k, v in self.model.state_dict().items()
            }
        seen: set[int] = set()
        out: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            ptr = t.untyped_storage().data_ptr()
            out[name] = t.clone() if ptr in seen else t
            seen.add(ptr)
        return out

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write the current weights as a HF model directory (config + safetensors)."""
        self.model.save_pretrained(out_dir, state_dict=self.state_dict())
        return Path(out_dir)

    def require_finite_weights(self) -> None:
        """TrainerError naming the first parameter holding a NaN or an infinity: such weights
        are never pushed or checkpointed."""
        for name, p in self.model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p  # an FSDP shard: this rank's
            if not bool(torch.isfinite(local).all()):
                raise TrainerError(
                    f"parameter {name!r} holds non-finite values after training; the run stops "
                    "rather than push or checkpoint them",
                    field="weights",
                )

    def save_checkpoint(self, ckpt_dir: str | Path) -> Path:
        """Model, optimizer, scheduler, version, step and RNG states → ``ckpt_dir/trainer.pt``
        (refused when a weight is not finite)."""
        self.require_finite_weights()
        payload = {
            "model": self.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
            "steps_done": self.steps_done,
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": _np_state(),
            },
        }
        return save_torch(payload, Path(ckpt_dir) / CHECKPOINT_FILE)

    def load_checkpoint(self, ckpt_dir: str | Path) -> None:
        """Restore exactly what :meth:`save_checkpoint` wrote (checksum verified)."""
        payload = load_torch(Path(ckpt_dir) / CHECKPOINT_FILE)
        try:
            missing, unexpected = self.model.load_state_dict(payload["model"], strict=False)
        except RuntimeError as e:
            raise CheckpointError(
                f"checkpoint does not fit the model: {e}", path=str(ckpt_dir)
            ) from e
        if [m for m in missing if m != "lm_head.weight"] or unexpected:
            raise CheckpointError(
                f"checkpoint/model mismatch: missing={missing}, unexpected={unexpected}",
                path=str(ckpt_dir),
            )
        self.optimizer.load_state_dict(payload["optimizer"])
        self.scheduler.load_state_dict(payload["scheduler"])
        self.version = int(payload["version"])
        self.steps_done = int(payload["steps_done"])
        self.stream = None
        torch.set_rng_state(payload["rng"]["torch"])
        _np_set_state(payload["rng"]["numpy"])


def _select(c: Any, idx: list[int]) -> Any:
    from staleflow_trainer.trainer.batch import Collated

    return Collated(
        input_ids=c.input_ids[idx],
        attention_mask=c.attention_mask[idx],
        targets=c.targets[idx],
        response_mask=c.response_mask[idx],
        rollout_logprobs=c.rollout_logprobs[idx],
    )


def _dev(c: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return c
    from staleflow_trainer.trainer.batch import Collated

    return Collated(
        input_ids=c.input_ids.to(device),
        attention_mask=c.attention_mask.to(device),
        targets=c.targets.to(device),
        response_mask=c.response_mask.to(device),
        rollout_logprobs=c.rollout_logprobs.to(device),
    )


def _require_finite(what: str, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        raise TrainerError(
            f"a {what} is not finite (a reward too large for the trainer's arithmetic?); no "
            "optimizer step taken",
            field="reward",
        )


def _grad_norm(model: torch.nn.Module) -> torch.Tensor:
    grads = [p.grad.detach().norm() for p in model.parameters() if p.grad is not None]
    return torch.norm(torch.stack(grads)) if grads else torch.tensor(0.0)


def _np_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "name": name,
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached": float(cached),
    }


def _np_set_state(s: Mapping[str, Any]) -> None:
    np.random.set_state(
        (s["name"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["cached"])
    )
