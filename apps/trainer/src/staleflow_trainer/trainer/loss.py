"""GRPO / DAPO loss math, free of models and optimizers so it can be checked by hand.

Theory of operation
-------------------
* **Advantages** are group-normalized (GRPO): ``A_i = (r_i - mean_g) / (std_g + eps)`` over the
  ``n`` responses of one prompt; ``std`` is the unbiased sample std (as verl); a group of one
  gets ``A = 0``. Every token of a response carries its response's advantage.
* **Overlong penalty** (DAPO soft punishment) is added to the reward *before* normalization:
  0 up to ``max_len - buffer``, then linearly down to ``-factor`` at ``max_len``.
* **Policy loss** per token is PPO's clipped surrogate with DAPO's clip-higher
  (``1 - clip_low``, ``1 + clip_high``), weighted by **truncated importance sampling**
  ``w = min(exp(old - rollout), tis_cap)`` (detached) that corrects for the rollout policy
  (possibly several versions stale) differing from the trainer's "old" policy, and
  aggregated as a **token mean** over every response token in the batch.
* **Dynamic sampling** (DAPO): a group whose rewards are all equal has zero advantage and
  teaches nothing; :func:`should_drop_group` tells the app to drop it through the protocol.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch


def group_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, *, eps: float = 1e-6
) -> torch.Tensor:
    """Per-sample advantages ``(r - mean_g) / (std_g + eps)``.

    ``rewards`` is ``[N]`` floats, ``group_index`` ``[N]`` ints (dense group ids 0..G-1).
    """
    if rewards.shape != group_index.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards and group_index must be 1-D of equal shape, got {tuple(rewards.shape)} "
            f"and {tuple(group_index.shape)}"
        )
    rewards = rewards.to(torch.float64)
    num_groups = int(group_index.max().item()) + 1 if rewards.numel() else 0
    counts = torch.zeros(num_groups, dtype=torch.float64).index_add_(
        0, group_index, torch.ones_like(rewards)
    )
    sums = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, rewards)
    means = sums / counts
    centered = rewards - means[group_index]
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, centered**2)
    # unbiased std; groups of one have no spread and get advantage 0 (centered == 0)
    std = torch.sqrt(sq / torch.clamp(counts - 1, min=1))
    return (centered / (std[group_index] + eps)).to(torch.float32)


def overlong_penalty(response_len: int, *, max_len: int, buffer_len: int, factor: float) -> float:
    """DAPO soft overlong punishment (≤ 0) for a response of ``response_len`` tokens."""
    if response_len > max_len:
        return -factor
    start = max_len - buffer_len
    if buffer_len <= 0 or response_len <= start:
        return 0.0
    return (start - response_len) / buffer_len * factor


def should_drop_group(rewards: Sequence[float], *, tol: float = 0.0) -> bool:
    """DAPO dynamic sampling: drop a group whose rewards are all equal (within ``tol``)."""
    if len(rewards) == 0:
        return True
    return max(rewards) - min(rewards) <= tol


def tis_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, *, cap: float
) -> torch.Tensor:
    """Token-level truncated importance weights ``min(exp(old - rollout), cap)`` (no grad)."""
    with torch.no_grad():
        return torch.clamp(torch.exp(old_logprobs - rollout_logprobs), max=cap)


@attrs.frozen(kw_only=True)
class PolicyLossOutput:
    loss: torch.Tensor  # scalar, differentiable
    clip_frac: float  # fraction of tokens where the clipped branch was taken
    ratio_mean: float
    tokens: int


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    weights: torch.Tensor | None = None,
    num_tokens: int | None = None,
) -> PolicyLossOutput:
    """Clip-higher PPO surrogate, token-mean aggregated.

    All tensors are ``[B, T]`` (``advantages`` may be ``[B]`` and is broadcast over tokens);
    ``mask`` marks response tokens. ``num_tokens`` is the token-mean denominator — pass the
    whole batch's token count when the batch is split into gradient-accumulation micro-batches,
    so the sum over micro-batches equals the full-batch token mean.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    maskf = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs)
    surrogate = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(surrogate, clipped)
    if weights is not None:
        per_token = per_token * weights
    denom = int(maskf.sum().item()) if num_tokens is None else num_tokens
    denom = max(denom, 1)
    loss = (per_token * maskf).sum() / denom
    with torch.no_grad():
        n_tok = int(maskf.sum().item())
        took_clip = (clipped > surrogate).to(maskf.dtype) * maskf
        clip_frac = float(took_clip.sum().item()) / max(n_tok, 1)
        ratio_mean = float((ratio * maskf).sum().item()) / max(n_tok, 1)
    return PolicyLossOutput(loss=loss, clip_frac=clip_frac, ratio_mean=ratio_mean, tokens=n_tok)
