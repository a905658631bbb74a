"""A training step streamed in parts: work on the groups of the next batch as they complete.

Theory of operation
-------------------
With ``trainer.stream_batch`` the trainer does not wait for the whole batch before it starts:
while the buffer it trains next fills, each group that has settled there (the staleness
protocol's ``next_batch_groups``: it will be in the batch) is streamed in. For those samples
the trainer computes the advantages (per group), the "old" log-probs and the importance
weights with the weights of the version being trained — nothing has updated them yet — and
runs forward and backward, adding the gradients up. When the batch is complete the rest
follows the same way and one optimizer step ends the step.

The update is the one an unstreamed step takes: the gradient of a token-mean loss is the sum
of every token's gradient over the batch's token count, so each part's loss is summed (token
count 1) and the accumulated gradient is divided by the batch's token count once, before
clipping. Only the order of the floating-point additions differs. It needs one optimizer
update per step (``trainer.mini_batches`` 1: a second update would change the weights the
late groups' old log-probs must come from), one process (no FSDP), and a dtype with float32's
range (the summed gradient of a large batch could overflow float16).

A part that fails halfway (out of memory) drops every part of the step and their gradients:
nothing of it is counted twice when the step's batch is trained.

A part for another version (one that arrives after its step ended), or a group already
streamed in, is ignored. A consumed batch that lacks a group streamed in (it cannot happen
under the protocol's rule, but a trainer must never train what was not consumed) discards
the parts and trains the batch whole.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import numpy as np
import structlog
import torch

from staleflow_trainer.errors import TrainerError
from staleflow_trainer.trainer.batch import TrainSample

if TYPE_CHECKING:
    from staleflow_trainer.trainer.core import Trainer

log = structlog.get_logger(__name__)


class StreamedStep:
    """What the parts of one step streamed in so far add up to (the gradients live in the
    model's parameters)."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.groups: set[str] = set()
        self.t0 = time.perf_counter()
        self.busy_s = 0.0  # seconds spent on the parts
        self.loss_sum = 0.0  # token-summed loss
        self.clipped = 0.0  # tokens where the clipped branch was taken
        self.ratio_sum = 0.0  # the importance ratio summed over the tokens
        self.rewards: list[float] = []
        self.scores: list[float] = []
        self.adv_abs: list[float] = []
        self.response_lens: list[int] = []
        self.tokens = 0
        self.tis_sum = 0.0
        self.tis_capped = 0
        self.kl_sum = 0.0


def _check(trainer: Trainer) -> None:
    if trainer.cfg.mini_batches != 1:
        raise TrainerError(
            "a streamed step needs trainer.mini_batches 1 (one optimizer update per step)",
            field="mini_batches",
        )
    if trainer.world_size > 1:
        raise TrainerError("a streamed step runs in one process (no FSDP)", field="fsdp")


def stream_part(trainer: Trainer, samples: Sequence[TrainSample]) -> int:
    """Stream whole groups of the batch the trainer trains next (at its current version) in;
    returns how many samples it took (groups already streamed in are skipped)."""
    _check(trainer)
    st = trainer.stream
    if st is None or st.version != trainer.version:
        trainer.optimizer.zero_grad(set_to_none=True)
        st = trainer.stream = StreamedStep(trainer.version)
    new = [s for s in samples if s.group_id not in st.groups]
    if not new:
        return 0
    t0 = time.perf_counter()
    try:
        _accumulate(trainer, st, new)
    except BaseException:
        # gradients of a part that failed halfway must not stay: the step starts over
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.stream = None
        raise
    st.busy_s += time.perf_counter() - t0
    return len(new)


def _accumulate(trainer: Trainer, st: StreamedStep, new: list[TrainSample]) -> None:
    adv = trainer.checked_advantages(new)
    full, old, weights = trainer.old_logprobs(new)
    clipped = ratio_sum = 0.0
    for chunk in trainer.micro_chunks(list(range(len(new)))):
        out = trainer.backward_chunk(full, chunk, old, adv, weights, num_tokens=1)
        clipped += out.clip_frac * out.tokens
        ratio_sum += out.ratio_mean * out.tokens
        st.loss_sum += float(out.loss.item())
    st.clipped += clipped
    st.ratio_sum += ratio_sum
    mask = full.response_mask
    with torch.no_grad():
        w = weights[mask]
        st.tis_sum += float(w.sum())
        st.tis_capped += int((w >= trainer.cfg.tis_cap).sum())
        st.kl_sum += float((full.rollout_logprobs - old)[mask].sum())
    st.tokens += int(mask.sum().item())
    st.rewards.extend(s.reward for s in new)
    st.scores.extend(float(x) for x in trainer.scores(new))
    st.adv_abs.extend(float(x) for x in adv.abs())
    st.response_lens.extend(len(s.response_ids) for s in new)
    st.groups.update(s.group_id for s in new)


def finish_streamed(
    trainer: Trainer, batch: Sequence[TrainSample], groups: Collection[str] | None = None
) -> dict[str, float]:
    """The step on the consumed batch whose groups are ``groups`` (default: those of
    ``batch``): streams ``batch``'s samples in where their group is not in yet (``batch`` may
    leave out groups already streamed in), then takes the optimizer step. Returns the step's
    metrics (those of an unstreamed step, with ``pg_clipfrac`` and ``ratio_mean`` as means
    over the batch's tokens, plus
    ``streamed_samples``, the samples streamed in before the batch was complete, and
    ``stream_busy_s``, the seconds spent on them)."""
    early = trainer.stream
    in_batch = set(groups) if groups is not None else {s.group_id for s in batch}
    if early is not None and early.version != trainer.version:
        early = trainer.stream = None  # the parts of a step that ended
    if early is not None and not early.groups <= in_batch:
        log.warning(
            "stream_discarded",
            version=trainer.version,
            not_in_batch=sorted(early.groups - in_batch)[:5],
        )
        early = trainer.stream = None
    streamed = 0 if early is None else len(early.rewards)
    busy_s = 0.0 if early is None else early.busy_s
    t_finish = time.perf_counter()
    stream_part(trainer, batch)  # the rest (it starts the step afresh where nothing is in)
    st = trainer.stream
    assert st is not None  # stream_part always leaves the step's parts
    trainer.stream = None
    missing = in_batch - st.groups
    if missing:
        raise TrainerError(
            f"the consumed batch's groups {sorted(missing)[:3]} were neither streamed in nor "
            "given: no optimizer step taken",
            field="batch",
        )
    scale = 1.0 / max(st.tokens, 1)  # no response token: a zero gradient, as unstreamed
    for p in trainer.model.parameters():
        if p.grad is not None:
            p.grad.mul_(scale)
    loss = st.loss_sum * scale
    grad_norm = trainer.optimizer_step(loss, "the streamed step")
    lr = trainer.finish_step()
    n = len(st.rewards)
    rewards = torch.tensor(st.rewards)
    return {
        "loss": loss,
        "pg_clipfrac": st.clipped * scale,
        "ratio_mean": st.ratio_sum * scale,
        "grad_norm": grad_norm,
        "lr": lr,
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if n > 1 else 0.0,
        "score_mean": float(np.mean(st.scores)),
        "adv_abs_mean": float(np.mean(st.adv_abs)),
        "response_len_mean": float(np.mean(st.response_lens)),
        "tokens": float(st.tokens),
        "tis_mean": st.tis_sum / st.tokens if st.tokens else 1.0,
        "tis_capped_frac": st.tis_capped * scale,
        "rollout_old_kl": st.kl_sum * scale,
        # the time the step took once its batch was complete (the parts before are hidden)
        "train_time_s": time.perf_counter() - t_finish,
        "streamed_samples": float(streamed),
        "stream_busy_s": busy_s,
        "version": float(trainer.version),
    }
