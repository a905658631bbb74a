"""Prompt records → token ids, with the context-length check the engines need."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs

from staleflow_trainer.data.records import PromptRecord
from staleflow_trainer.errors import DataError

#: a prompt record's fields that travel with its trajectories (what a reward function reads)
PROMPT_METADATA = ("index", "ground_truth", "data_source", "extra_info")


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


def _check_row(row: int, rows: int) -> None:
    if not 0 <= row < rows:
        raise IndexError(f"prompt row {row} is not in 0..{rows - 1}")


@attrs.frozen(init=False)
class PromptLengths:
    """What the control process needs of a run's prompts: how many rows there are, each
    row's length in tokens (the core routes and budgets by it) and the tokenizer's
    end-of-sequence id (a stop token of every group's sampling). The tokens and metadata stay
    in the trajectory server's prompt table; this is 4 bytes a row, in memory and pickled.
    :meth:`EncodedPrompts.lengths` makes it."""

    eos_token_id: int | None
    _lengths: array[int] = attrs.field(repr=False)

    def __init__(self, lengths: Iterable[int], eos_token_id: int | None = None) -> None:
        self.__attrs_init__(eos_token_id, array("i", lengths))

    def __len__(self) -> int:
        return len(self._lengths)

    def length(self, row: int) -> int:
        """How many tokens row ``row``'s prompt has."""
        _check_row(row, len(self._lengths))
        return self._lengths[row]


@attrs.frozen(init=False)
class EncodedPrompts:
    """A run's prompts, loaded and tokenized once (by the driver, which checks them before
    anything starts): each row's record and token ids, and the tokenizer's end-of-sequence
    id (None: it has none). The driver puts them in the trajectory server's prompt table
    (:meth:`table`) and hands the control process their :meth:`lengths` only, so that
    neither loads the dataset or a tokenizer itself. The ids are held in one flat array (4
    bytes a token, in memory and pickled)."""

    records: tuple[PromptRecord, ...]
    eos_token_id: int | None
    _flat: array[int] = attrs.field(repr=False)
    _offsets: array[int] = attrs.field(repr=False)

    def __init__(
        self,
        records: Iterable[PromptRecord],
        token_ids: Iterable[Sequence[int]],
        eos_token_id: int | None = None,
    ) -> None:
        recs = tuple(records)
        flat, offsets = array("i"), array("q", [0])
        for ids in token_ids:
            flat.extend(ids)
            offsets.append(len(flat))
        if len(offsets) - 1 != len(recs):
            raise ValueError(f"{len(recs)} records but {len(offsets) - 1} encoded prompts")
        self.__attrs_init__(recs, eos_token_id, flat, offsets)

    def __len__(self) -> int:
        return len(self.records)

    def _span(self, row: int) -> tuple[int, int]:
        _check_row(row, len(self.records))
        return self._offsets[row], self._offsets[row + 1]

    def table(self) -> Iterator[tuple[int, array[int], dict[str, Any]]]:
        """Every row as the trajectory server's prompt table takes it: the row (its key), its
        token ids and the metadata a reward function reads (the record's ``index``,
        ``ground_truth``, ``data_source`` and ``extra_info``)."""
        for row, rec in enumerate(self.records):
            a, b = self._span(row)
            yield row, self._flat[a:b], {k: getattr(rec, k) for k in PROMPT_METADATA}

    def ids(self, row: int) -> tuple[int, ...]:
        """Row ``row``'s prompt token ids."""
        a, b = self._span(row)
        return tuple(self._flat[a:b])

    def length(self, row: int) -> int:
        """How many tokens row ``row``'s prompt has."""
        a, b = self._span(row)
        return b - a

    def lengths(self) -> PromptLengths:
        """Each row's length and the end-of-sequence id: what the control process needs."""
        return PromptLengths(map(self.length, range(len(self))), self.eos_token_id)
