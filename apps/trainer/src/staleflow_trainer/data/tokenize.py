"""Prompt records → token ids, with the context-length check the engines need."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from staleflow_trainer.data.records import PromptRecord
from staleflow_trainer.errors import DataError


def _where(source: str | None, row: int) -> str:
    return f"{source}: row {row}" if source else f"row {row}"


def prompt_too_long(
    record: PromptRecord, n_tokens: int, *, max_prompt_len: int, source: str | None = None
) -> DataError:
    """The error for a prompt of ``n_tokens`` > ``max_prompt_len``, naming file, row, field."""
    return DataError(
        f"{_where(source, record.index)}: prompt has {n_tokens} tokens > "
        f"data.max_prompt_len={max_prompt_len}",
        path=source,
        row=record.index,
        field="prompt",
    )


def encode_prompt(
    record: PromptRecord,
    tokenizer: Any,
    *,
    apply_chat_template: bool,
    source: str | None = None,
) -> tuple[int, ...]:
    """Token ids of one prompt (chat template applied when asked and available); errors name
    ``source`` (the dataset file) when given."""
    if apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "data.apply_chat_template=true but the tokenizer has no chat template",
                path=source,
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
            f"{_where(source, record.index)}: prompt tokenizes to nothing",
            path=source,
            row=record.index,
            field="prompt",
        )
    return out


def encode_prompts(
    records: Sequence[PromptRecord],
    tokenizer: Any,
    *,
    max_prompt_len: int,
    apply_chat_template: bool = False,
    source: str | None = None,
) -> list[tuple[int, ...]]:
    """Encode every prompt; a prompt longer than ``max_prompt_len`` tokens is a DataError
    naming the file (``source``), its row and field (checked up front so no over-long prompt
    ever reaches an engine)."""
    out = []
    for rec in records:
        ids = encode_prompt(rec, tokenizer, apply_chat_template=apply_chat_template, source=source)
        if len(ids) > max_prompt_len:
            raise prompt_too_long(rec, len(ids), max_prompt_len=max_prompt_len, source=source)
        out.append(ids)
    return out


@attrs.frozen
class EncodedPrompts:
    """A run's prompts, loaded and tokenized once (by the driver, which checks them before
    anything starts): each row's record and token ids, and the tokenizer's end-of-sequence
    id (None: it has none). The control process receives this instead of loading the
    dataset and a tokenizer itself, so it needs neither the data files nor ``transformers``,
    and starts in about a second."""

    records: tuple[PromptRecord, ...] = attrs.field(converter=tuple)
    token_ids: tuple[tuple[int, ...], ...] = attrs.field(converter=tuple)
    eos_token_id: int | None = None

    def __attrs_post_init__(self) -> None:
        if len(self.records) != len(self.token_ids):
            raise ValueError(f"{len(self.records)} records but {len(self.token_ids)} encoded "
                             "prompts")  # fmt: skip

    def __len__(self) -> int:
        return len(self.records)

    def ids(self, row: int) -> tuple[int, ...]:
        """Row ``row``'s prompt token ids."""
        return self.token_ids[row]
