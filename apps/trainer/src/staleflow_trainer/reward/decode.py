"""Response token ids to the text a reward function scores, without ``transformers`` where
that gives the same text.

A reward worker decodes every finished response (``skip_special_tokens=True``). Loading a
Hugging Face tokenizer for that imports ``transformers`` (here about 8 s of CPU and 320 MB of
memory per worker). A fast Hugging Face tokenizer wraps a ``tokenizers`` (Rust) backend that
does the decoding itself; unless the tokenizer also cleans up spaces in Python
(``clean_up_tokenization_spaces``), the backend alone gives the same text, loads in
milliseconds and takes about 20 MB.

The driver loads the tokenizer anyway to check the prompts. :func:`portable_backend` gives its
backend as JSON when decoding with the backend alone matches ``tokenizer.decode`` on the run's
own prompts and on random id sequences over the whole vocabulary (special tokens included);
otherwise None. A :class:`ResponseDecoder` given that JSON decodes with the backend; given
None, it loads the tokenizer with ``transformers`` as before.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Sequence
from typing import Any

#: how many of the run's prompts, and how many random id sequences (of RANDOM_LEN ids), the
#: driver decodes both ways before it lets reward workers decode without ``transformers``
CHECK_PROMPTS = 256
CHECK_RANDOM = 64
RANDOM_LEN = 48


def portable_backend(tokenizer: Any, prompts: Iterable[Sequence[int]] = ()) -> str | None:
    """``tokenizer``'s ``tokenizers`` backend as JSON if decoding with it alone gives the text
    ``tokenizer.decode(ids, skip_special_tokens=True)`` gives, checked on up to
    :data:`CHECK_PROMPTS` of ``prompts`` and on :data:`CHECK_RANDOM` seeded random id
    sequences; None for a tokenizer without such a backend, one that cleans up spaces in
    Python, or any difference."""
    if not getattr(tokenizer, "is_fast", False) or getattr(
        tokenizer, "clean_up_tokenization_spaces", True
    ):
        return None
    from tokenizers import Tokenizer

    text = str(tokenizer.backend_tokenizer.to_str())
    backend = Tokenizer.from_str(text)
    rng = random.Random(0)
    vocab = len(tokenizer)
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
