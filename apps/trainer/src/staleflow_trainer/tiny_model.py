"""Tiny Hugging Face models created locally (no model hub): a Qwen2 plus a character tokenizer.

The character tokenizer covers exactly the toy tasks' alphabet (digits, ``+ - * = ( ) ?`` and
space), so every toy answer digit is one token and a random policy already hits the right
digit about 1 time in 20: GRPO gets signal from the first batch. Models satisfy vLLM-CPU's
constraints (its CPU attention backend refuses head sizes below 32, e.g. head_dim 16) so the same
directory serves rollout and training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import structlog

log = structlog.get_logger(__name__)

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<s>", "</s>", "<unk>")
TOY_ALPHABET: str = "0123456789+-*=()? "
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
_READY_MARKER = "staleflow_tiny_model.json"


@attrs.frozen(kw_only=True)
class TinyModelSpec:
    """Shape of a tiny Qwen2. vLLM-CPU needs ``hidden_size / num_heads`` ≥ 32."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    max_position_embeddings: int = 256
    seed: int = 0


def char_vocab() -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in TOY_ALPHABET:
        vocab[ch] = len(vocab)
    return vocab


def make_char_tokenizer() -> Any:  # transformers.PreTrainedTokenizerFast
    """A character-level fast tokenizer over :data:`TOY_ALPHABET` (one char = one token)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call,unused-ignore]
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def make_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Create (once) a random tiny Qwen2 + char tokenizer in ``out_dir``; returns the path.

    Idempotent: an existing complete model directory (marker file with the same spec) is
    reused, so a resumed run trains the same weights it started with.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    marker = out / _READY_MARKER
    wanted = attrs.asdict(spec)
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call,unused-ignore]
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call,unused-ignore]
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # a bar for a few KB
    try:
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
    marker.write_text(json.dumps(wanted))
    log.info("tiny_model_created", path=str(out), vocab=len(tokenizer), **wanted)
    return out


def resolve_model_path(cfg: Any) -> Path:  # cfg: staleflow_trainer.config.AppConfig
    """The run's model directory: ``model.path`` if set (must exist), else a tiny Qwen2 made
    (once) in ``RUN_DIR/model`` from ``model.tiny`` seeded with ``run.seed``."""
    from staleflow_trainer.errors import ConfigError

    if cfg.model.path:
        p = Path(cfg.model.path)
        if not (p / "config.json").is_file():
            raise ConfigError(
                f"model.path {str(p)!r} is not a Hugging Face model directory (no config.json)",
                key="model.path",
                allowed="a save_pretrained directory, or '' for a tiny local model",
            )
        return p
    t = cfg.model.tiny
    spec = TinyModelSpec(
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_layers=t.num_layers,
        num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads,
        max_position_embeddings=t.max_position_embeddings,
        seed=cfg.run.seed,
    )
    return make_tiny_model(Path(cfg.run.run_dir) / "model", spec)
