"""vLLM's sampling parameters for a rollout request, built in one place.

``generate`` and ``profile`` both build their requests here, so a profile times the decode
steps the rollout runs: the same temperature, top-p and seed, one log-probability per token
(the trainer's importance ratio needs it) and no detokenisation.
"""

from __future__ import annotations

from typing import Any

from engine_adapters._contract import SamplingParams


def vllm_sampling_params(sampling: SamplingParams, *, max_tokens: int, stop: bool = True) -> Any:
    """vLLM ``SamplingParams`` for ``sampling`` with at most ``max_tokens`` new tokens.

    ``stop=False`` drops the stop tokens, for a profile whose requests must all decode the
    same number of steps. The end-of-sequence token never stops a request by itself: the
    rollout's own ``stop_token_ids`` decide.
    """
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(
        n=1,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        max_tokens=max_tokens,
        stop_token_ids=list(sampling.stop_token_ids) if stop else [],
        ignore_eos=True,
        logprobs=1,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )
