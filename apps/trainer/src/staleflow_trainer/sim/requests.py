"""Engine requests for the length-only simulator, built without per-token conversion.

``GenerateRequest``'s converters rebuild every token tuple element by element; for a resumed
trajectory with 20K generated tokens that is ~4 ms, and the simulator issues tens of thousands
of requests per run. The sim engine only reads the lengths of ``generated_*`` and the prompt's
values (its token-stream key and a vocabulary check). So this module builds requests whose
fields already hold what the converters would produce — tuples of ints/floats — and runs the
same validation as ``GenerateRequest.__attrs_post_init__``, skipping only the redundant
conversion. Prompts are shared per length (:class:`PromptTokens`, with a cached array view for
the engine's hashing); their token values are synthetic, as are all simulated tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine_adapters import GenerateRequest, SamplingParams

_FIRST_TOKEN = 16  # above the sim engine's special tokens
_SPAN = 1000


class PromptTokens(tuple):  # type: ignore[type-arg]
    """A synthetic prompt (a real tuple of token ids) with a cached numpy view."""

    __slots__ = ()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = _ARRAYS[len(self)]
        return arr if dtype is None else arr.astype(dtype, copy=False)


_PROMPTS: dict[int, PromptTokens] = {}
_ARRAYS: dict[int, np.ndarray] = {}
_ZEROS: dict[int, tuple[int, ...]] = {}
_FZEROS: dict[int, tuple[float, ...]] = {}


def prompt_tokens(length: int) -> PromptTokens:
    p = _PROMPTS.get(length)
    if p is None:
        p = PromptTokens(_FIRST_TOKEN + (i % _SPAN) for i in range(length))
        _ARRAYS[length] = np.fromiter(p, dtype=np.int64, count=length)
        _PROMPTS[length] = p
    return p


def _zeros(n: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    z = _ZEROS.get(n)
    if z is None:
        z = (_FIRST_TOKEN,) * n
        if len(_ZEROS) > 4096:
            _ZEROS.clear()
            _FZEROS.clear()
        _ZEROS[n] = z
        _FZEROS[n] = (0.0,) * n
    return z, _FZEROS[n]


def build_request(
    trajectory_id: str,
    prompt_len: int,
    generated: int,
    target_length: int,
    sampling: SamplingParams,
) -> GenerateRequest:
    """A validated ``GenerateRequest`` for a (possibly resumed) length-only trajectory."""
    tokens, logprobs = _zeros(generated)
    req = object.__new__(GenerateRequest)
    put = object.__setattr__
    put(req, "trajectory_id", trajectory_id)
    put(req, "prompt_token_ids", prompt_tokens(prompt_len))
    put(req, "sampling", sampling)
    put(req, "generated_token_ids", tokens)
    put(req, "generated_logprobs", logprobs)
    put(req, "generated_versions", (0,) * generated if generated else ())
    put(req, "target_length", target_length)
    req.__attrs_post_init__()  # the class's own checks (ids, lengths, max_new_tokens)
    return req
