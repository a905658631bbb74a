"""A minimal in-process sampler (plain HF forward passes) for tests and quick experiments.

Not the rollout path of the real system (that is the engine adapters); it exists so the
trainer's learning can be checked without vLLM: sample ``n`` responses per prompt at a
temperature, record each sampled token's log-probability, stop at EOS or ``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from staleflow_trainer.data.records import PromptRecord
from staleflow_trainer.data.toy import toy_score
from staleflow_trainer.trainer.batch import TrainSample


@attrs.frozen(kw_only=True)
class SampledResponse:
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    truncated: bool


@torch.no_grad()
def sample_responses(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    n: int,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int = 0,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[SampledResponse]:
    """``len(prompts) * n`` responses, prompt-major (all ``n`` of prompt 0 first)."""
    was_training = model.training
    model.eval()
    rows = [tuple(int(t) for t in p) for p in prompts for _ in range(n)]
    longest = max(len(r) for r in rows)
    # left-pad so every row's next token sits in the last column
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, longest - len(r) :] = torch.tensor(r)
        attn[i, longest - len(r) :] = 1
    done = torch.zeros(len(rows), dtype=torch.bool)
    out_ids: list[list[int]] = [[] for _ in rows]
    out_lp: list[list[float]] = [[] for _ in rows]
    for _ in range(max_new_tokens):
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits
        logp = torch.log_softmax(logits[:, -1].float() / max(temperature, 1e-6), dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        for i in range(len(rows)):
            if not done[i]:
                out_ids[i].append(int(tok[i]))
                out_lp[i].append(float(logp[i, tok[i]]))
                if int(tok[i]) == eos_id:
                    done[i] = True
        if bool(done.all()):
            break
        ids = torch.cat([ids, tok[:, None]], dim=1)
        attn = torch.cat([attn, (~done).long()[:, None] | 1], dim=1)
    model.train(was_training)
    return [
        SampledResponse(
            prompt_ids=r,
            response_ids=tuple(o),
            logprobs=tuple(lp),
            truncated=len(o) >= max_new_tokens and (not o or o[-1] != eos_id),
        )
        for r, o, lp in zip(rows, out_ids, out_lp, strict=True)
    ]


def toy_train_batch(
    responses: Sequence[SampledResponse],
    records: Sequence[PromptRecord],
    *,
    n: int,
    step: int,
    tokenizer: Any,
) -> list[TrainSample]:
    """The local loop's training batch: response ``k`` answers ``records[k // n]`` (prompt-major,
    as :func:`sample_responses` returns them), scored by :func:`toy_score` against its ground
    truth; group ids ``"<step>-<prompt index>"``."""
    return [
        TrainSample(
            group_id=f"{step}-{k // n}",
            prompt_ids=r.prompt_ids,
            response_ids=r.response_ids,
            rollout_logprobs=r.logprobs,
            reward=toy_score(
                tokenizer.decode(list(r.response_ids), skip_special_tokens=True),
                records[k // n].ground_truth,
            ),
            truncated=r.truncated,
        )
        for k, r in enumerate(responses)
    ]
