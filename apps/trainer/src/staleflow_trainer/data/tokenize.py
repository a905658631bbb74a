"""Prompt records → token ids, with the context-length check the engines need."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from staleflow_trainer.data.records import PromptRecord
from staleflow_trainer.errors import DataError


def encode_prompt(
    record: PromptRecord, tokenizer: Any, *, apply_chat_template: bool
) -> tuple[int, ...]:
    """Token ids of one prompt (chat template applied when asked and available)."""
    if apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "data.apply_chat_template=true but the tokenizer has no chat template",
                row=record.index,
                field="prompt",
            )
        ids = tokenizer.apply_chat_template(
            record.chat_messages(), add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
    else:
        ids = tokenizer(record.prompt_text(), add_special_tokens=False)["input_ids"]
    out = tuple(int(i) for i in ids)
    if not out:
        raise DataError(
            f"row {record.index}: prompt tokenizes to nothing", row=record.index, field="prompt"
        )
    return out


def encode_prompts(
    records: Sequence[PromptRecord],
    tokenizer: Any,
    *,
    max_prompt_len: int,
    apply_chat_template: bool = False,
) -> list[tuple[int, ...]]:
    """Encode every prompt; a prompt longer than ``max_prompt_len`` tokens is a DataError
    naming its row (checked up front so no over-long prompt ever reaches an engine)."""
    out = []
    for rec in records:
        ids = encode_prompt(rec, tokenizer, apply_chat_template=apply_chat_template)
        if len(ids) > max_prompt_len:
            raise DataError(
                f"row {rec.index}: prompt has {len(ids)} tokens > data.max_prompt_len="
                f"{max_prompt_len}",
                row=rec.index,
                field="prompt",
            )
        out.append(ids)
    return out
