"""A tiny Qwen2 model + byte-level BPE tokenizer built locally (no model hub).

``make_tiny_qwen2(path)`` writes a Hugging Face model directory (``config.json``,
``model.safetensors``, tokenizer files) that both ``transformers`` and vLLM load. Weights are a
pure function of the arguments (``seed`` included), so two calls with equal arguments produce
byte-identical tensors; a ``tiny_model.json`` marker lets a second call on the same directory
return at once.

Why these defaults: vLLM's CPU attention only supports head sizes 32, 64, 80, … (head_dim 16
fails at engine start), and vLLM's qwen2 derives head_dim as ``hidden_size // heads``, so
hidden 64 / 2 heads gives head_dim 32. ``max_position_embeddings`` 1024 leaves room for the
prompts the engine tests and the profiler use.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2

# Head sizes vLLM's CPU attention backend accepts; others (e.g. 16) fail at start-up with
# "Unsupported CPU attention configuration".
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

_MARKER = "tiny_model.json"
_WORDS = [
    "the",
    "answer",
    "is",
    "yes",
    "no",
    "true",
    "false",
    "plus",
    "minus",
    "times",
    "equals",
    "sum",
    "of",
    "and",
    "result",
    "number",
    "think",
    "step",
    "first",
    "then",
    "so",
    "because",
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
]


def builtin_corpus(*, lines: int = 2000, seed: int = 0) -> list[str]:
    """A small deterministic corpus: arithmetic with digits, and a few words."""
    import random

    rng = random.Random(seed)
    out: list[str] = []
    for i in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = "+-*"[i % 3]
        value = a + b if op == "+" else a - b if op == "-" else a * b
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 8)))
        out.append(f"{a}{op}{b}={value}")
        out.append(f"{words}: {a} {op} {b} = {value}.")
    out.append(" ".join(str(d) for d in range(100)))
    return out


def _check(name: str, value: int, *, minimum: int) -> None:
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def make_tiny_qwen2(
    path: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    corpus: Iterable[str] | None = None,
) -> Path:
    """Create (or reuse) a tiny Qwen2 model directory at ``path`` and return it.

    ``vocab_size`` is the model's embedding size; the BPE tokenizer is trained up to that many
    entries (a small corpus may yield fewer, which is fine: token ids stay below
    ``vocab_size``). Special tokens: ``<|endoftext|>`` = 0 (eos), ``<|bos|>`` = 1,
    ``<|pad|>`` = 2. Raises ``ValueError`` naming the argument on bad sizes.
    """
    _check("vocab_size", vocab_size, minimum=256 + len(SPECIAL_TOKENS))
    _check("hidden_size", hidden_size, minimum=1)
    _check("num_layers", num_layers, minimum=1)
    _check("num_heads", num_heads, minimum=1)
    _check("num_kv_heads", num_kv_heads, minimum=1)
    _check("intermediate_size", intermediate_size, minimum=1)
    _check("max_position_embeddings", max_position_embeddings, minimum=16)
    if hidden_size % num_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})"
        )
    head_dim = hidden_size // num_heads
    if head_dim < 32:
        raise ValueError(
            f"head_dim = hidden_size // num_heads = {head_dim}; vLLM's CPU attention needs "
            f"one of {CPU_HEAD_SIZES} (e.g. hidden_size=64, num_heads=2)"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})"
        )

    params: dict[str, Any] = {
        "seed": seed,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "corpus": "builtin" if corpus is None else "custom",
    }
    path = Path(path)
    marker = path / _MARKER
    if corpus is None and marker.exists():
        try:
            if json.loads(marker.read_text()) == params:
                return path
        except (OSError, ValueError):
            pass  # unreadable marker: rebuild
    path.mkdir(parents=True, exist_ok=True)

    texts = list(corpus) if corpus is not None else builtin_corpus(seed=seed)
    tokenizer = _train_tokenizer(texts, vocab_size=vocab_size)
    tokenizer.save_pretrained(path)

    model = _build_model(
        seed=seed,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(path)
    marker.write_text(json.dumps(params, sort_keys=True))
    return path


def _train_tokenizer(texts: Sequence[str], *, vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call,unused-ignore]
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=None,
    )


def _build_model(*, seed: int, **cfg: Any) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_layers"],
        num_attention_heads=cfg["num_heads"],
        num_key_value_heads=cfg["num_kv_heads"],
        max_position_embeddings=cfg["max_position_embeddings"],
        tie_word_embeddings=cfg["tie_word_embeddings"],
        bos_token_id=cfg["bos_token_id"],
        eos_token_id=cfg["eos_token_id"],
        pad_token_id=cfg["pad_token_id"],
        dtype="float32",
    )
    # Seeded without disturbing the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call,unused-ignore]
    return model.float().eval()  # type: ignore[no-untyped-call,unused-ignore]
