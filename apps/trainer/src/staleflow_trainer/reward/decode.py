"""Response token ids to the text a reward function scores, without ``transformers`` where
that gives the same text.

A reward worker decodes every finished response (``skip_special_tokens=True``). Loading a
Hugging Face tokenizer for that imports ``transformers``, which costs each worker seconds of
CPU and hundreds of MB (see the app README). A fast Hugging Face tokenizer wraps a
``tokenizers`` (Rust) backend that does the decoding itself: when the tokenizer's class keeps
Hugging Face's own ``decode`` and ``_decode`` (some subclasses rewrite the text, e.g. merge
repeated ids) and its Python-side space clean-up does not run, the backend alone gives the
same text.

The driver loads the tokenizer anyway to check the prompts. :func:`portable_backend` gives its
backend as JSON when those conditions hold and decoding with the backend alone matches
``tokenizer.decode`` on the run's own prompts and on random id sequences over the whole
vocabulary (special tokens included); otherwise None. A :class:`ResponseDecoder` given that
JSON decodes with the backend; given None, it loads the tokenizer with ``transformers``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Sequence
from typing import Any

import structlog

log = structlog.get_logger(__name__)

#: how many of the run's prompts, and how many random id sequences (of RANDOM_LEN ids), the
#: driver decodes both ways before it lets reward workers decode without ``transformers``
CHECK_PROMPTS = 256
CHECK_RANDOM = 64
RANDOM_LEN = 48


def _decodes_with_backend_only(tokenizer: Any) -> bool:
    """Whether ``tokenizer.decode(ids, skip_special_tokens=True)`` is its backend's decode and
    nothing more: a fast tokenizer whose class keeps Hugging Face's ``decode`` and ``_decode``,
    and whose space clean-up does not run (it is off, or it is a BPE model, for which
    ``transformers`` skips it unless told to apply it anyway)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = type(tokenizer)
    if not (
        getattr(tokenizer, "is_fast", False)
        and getattr(cls, "_decode", None) is PreTrainedTokenizerFast._decode
        and getattr(cls, "decode", None) is PreTrainedTokenizerBase.decode
    ):
        return False
    if not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return True
    # what transformers does with clean-up on: skip it for BPE unless forced (a version
    # without that switch may apply it: refuse)
    forced = getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", None
    )
    model = type(tokenizer.backend_tokenizer.model).__name__
    return forced is False and model == "BPE"


def portable_backend(tokenizer: Any, prompts: Iterable[Sequence[int]] = ()) -> str | None:
    """``tokenizer``'s ``tokenizers`` backend as JSON if decoding with it alone gives the text
    ``tokenizer.decode(ids, skip_special_tokens=True)`` gives: its class decodes with the
    backend only (:func:`_decodes_with_backend_only`), and both agree on up to
    :data:`CHECK_PROMPTS` of ``prompts`` and on :data:`CHECK_RANDOM` seeded random id
    sequences; None otherwise, or if the backend cannot be serialised (custom Python
    components)."""
    if not _decodes_with_backend_only(tokenizer):
        return None
    return _checked(tokenizer, prompts)


def _checked(tokenizer: Any, prompts: Iterable[Sequence[int]]) -> str | None:
    """The backend JSON if it decodes the samples as ``tokenizer`` does, else None."""
    from tokenizers import Tokenizer

    try:
        text = str(tokenizer.backend_tokenizer.to_str())
        backend = Tokenizer.from_str(text)
        vocab = len(tokenizer)
    except Exception as e:  # e.g. a custom pre-tokenizer cannot be serialised
        log.debug("tokenizer_backend_not_portable", error=repr(e)[:200])
        return None
    rng = random.Random(0)
    samples: list[list[int]] = [list(p) for p in itertools.islice(prompts, CHECK_PROMPTS)]
    samples += [[rng.randrange(vocab) for _ in range(RANDOM_LEN)] for _ in range(CHECK_RANDOM)]
    for ids in samples:
        if backend.decode(ids, skip_special_tokens=True) != tokenizer.decode(
            ids, skip_special_tokens=True
        ):
            return None
    return text


class ResponseDecoder:
    """Decodes responses for the reward function: with the backend JSON of
    :func:`portable_backend` if given, else with the Hugging Face tokenizer at
    ``tokenizer_path`` (imports ``transformers``)."""

    def __init__(self, *, backend: str | None, tokenizer_path: str) -> None:
        self._backend: Any = None
        self._tokenizer: Any = None
        if backend is not None:
            from tokenizers import Tokenizer

            self._backend = Tokenizer.from_str(backend)
        else:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)

    @property
    def portable(self) -> bool:
        """True when it decodes with the backend alone (no ``transformers``)."""
        return self._backend is not None

    def decode(self, token_ids: Sequence[int]) -> str:
        ids = [int(t) for t in token_ids]
        if self._backend is not None:
            return str(self._backend.decode(ids, skip_special_tokens=True))
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))
