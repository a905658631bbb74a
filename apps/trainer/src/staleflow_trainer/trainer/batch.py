"""The training sample record and its collation into padded tensors."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from staleflow_trainer.errors import TrainerError


def _ints(v: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(x) for x in v)


def _floats(v: Sequence[float]) -> tuple[float, ...]:
    return tuple(float(x) for x in v)


@attrs.frozen(kw_only=True)
class TrainSample:
    """One finished, rewarded trajectory as the trainer consumes it.

    ``rollout_logprobs[i]`` is the log-probability the rollout engine gave ``response_ids[i]``
    (possibly under an older model version); ``truncated`` marks responses that hit
    ``max_new_tokens`` (finish reason ``length``); ``staleness`` = consuming buffer − V_traj.
    """

    group_id: str
    prompt_ids: tuple[int, ...] = attrs.field(converter=_ints)
    response_ids: tuple[int, ...] = attrs.field(converter=_ints)
    rollout_logprobs: tuple[float, ...] = attrs.field(converter=_floats)
    reward: float
    truncated: bool = False
    v_traj: int = 0
    staleness: int = 0

    def __attrs_post_init__(self) -> None:
        if not self.prompt_ids:
            raise TrainerError(f"group {self.group_id}: empty prompt_ids", field="prompt_ids")
        if len(self.response_ids) != len(self.rollout_logprobs):
            raise TrainerError(
                f"group {self.group_id}: {len(self.response_ids)} response ids but "
                f"{len(self.rollout_logprobs)} rollout logprobs",
                field="rollout_logprobs",
            )
        if not math.isfinite(self.reward):
            raise TrainerError(f"group {self.group_id}: reward {self.reward!r}", field="reward")
        if any(lp > 1e-4 or not math.isfinite(lp) for lp in self.rollout_logprobs):
            raise TrainerError(
                f"group {self.group_id}: rollout logprobs must be finite and <= 0",
                field="rollout_logprobs",
            )


@attrs.frozen(kw_only=True)
class Collated:
    """Right-padded tensors for a list of samples.

    Position ``t`` of the ``[N, L-1]`` tensors scores token ``t+1`` of ``input_ids``;
    ``response_mask`` marks the positions whose target is a response token.
    """

    input_ids: torch.Tensor  # [N, L]
    attention_mask: torch.Tensor  # [N, L]
    targets: torch.Tensor  # [N, L-1]
    response_mask: torch.Tensor  # [N, L-1] bool
    rollout_logprobs: torch.Tensor  # [N, L-1] float (0 where masked)


def collate(samples: Sequence[TrainSample], *, pad_id: int = 0) -> Collated:
    if not samples:
        raise TrainerError("cannot collate an empty batch", field="batch")
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    length = max(max(len(x) for x in seqs), 2)
    n = len(samples)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    resp_mask = torch.zeros((n, length - 1), dtype=torch.bool)
    rollout = torch.zeros((n, length - 1), dtype=torch.float32)
    for i, (s, seq) in enumerate(zip(samples, seqs, strict=True)):
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[i, : len(seq)] = 1
        p, r = len(s.prompt_ids), len(s.response_ids)
        if r:
            resp_mask[i, p - 1 : p - 1 + r] = True
            rollout[i, p - 1 : p - 1 + r] = torch.tensor(s.rollout_logprobs)
    return Collated(
        input_ids=input_ids,
        attention_mask=attention,
        targets=input_ids[:, 1:].clone(),
        response_mask=resp_mask,
        rollout_logprobs=rollout,
    )


def token_logprobs(model: torch.nn.Module, c: Collated) -> torch.Tensor:
    """``[N, L-1]`` log-probabilities of each next token under ``model``."""
    out = model(input_ids=c.input_ids, attention_mask=c.attention_mask, use_cache=False)
    logits = out.logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, c.targets[..., None]).squeeze(-1)
