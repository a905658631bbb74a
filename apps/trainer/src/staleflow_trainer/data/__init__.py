"""Datasets: verl-style JSONL/Parquet loaders, built-in toy tasks, a checkpointable cursor."""

from typing import Any

from staleflow_trainer.data.cursor import DataCursor
from staleflow_trainer.data.loaders import check_prompt_lengths, load_dataset
from staleflow_trainer.data.records import PromptRecord
from staleflow_trainer.data.tokenize import (
    EncodedPrompts,
    PromptLengths,
    encode_prompt,
    encode_prompts,
)
from staleflow_trainer.data.toy import TOY_TASKS, toy_accuracy, toy_records, toy_score

__all__ = [
    "TOY_TASKS",
    "DataCursor",
    "EncodedPrompts",
    "PromptLengths",
    "PromptRecord",
    "check_prompt_lengths",
    "encode_prompt",
    "encode_prompts",
    "encode_records",
    "load_dataset",
    "load_records",
    "toy_accuracy",
    "toy_records",
    "toy_score",
]


def load_records(cfg: Any) -> list[PromptRecord]:  # cfg: staleflow_trainer.config.AppConfig
    """The run's prompts: ``data.path`` if set, else the built-in toy task."""
    if cfg.data.path:
        return load_dataset(
            cfg.data.path, prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key
        )
    return toy_records(cfg.data.toy_task, size=cfg.data.toy_size, seed=cfg.run.seed)


def encode_records(cfg: Any, tokenizer: Any) -> EncodedPrompts:
    """The run's prompts (:func:`load_records`) tokenized with ``tokenizer`` (a Hugging Face
    tokenizer) as the engines see them (``data.apply_chat_template``); a prompt that encodes
    to nothing or to more than ``data.max_prompt_len`` tokens is a DataError naming its row
    and field."""
    records = load_records(cfg)
    encoded = encode_prompts(
        records,
        tokenizer,
        max_prompt_len=cfg.data.max_prompt_len,
        apply_chat_template=cfg.data.apply_chat_template,
        source=str(cfg.data.path) if cfg.data.path else None,
    )
    eos = tokenizer.eos_token_id
    return EncodedPrompts(records, encoded, None if eos is None else int(eos))
