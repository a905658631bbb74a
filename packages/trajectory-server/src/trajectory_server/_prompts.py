"""The store's prompt table: prompts put once under an integer key, so a group is submitted by
its key (``TrajectoryStore.submit_group(..., prompt_key=k)``) and its prompt tokens and
metadata need not travel with every submission.

Whoever holds the dataset (a data loader, a driver process) puts the prompts; whoever decides
which prompt runs next (a controller) then sends keys only. A key put again replaces what it
held. The table is not part of the store's checkpoint: put the prompts again after a restore.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from trajectory_server._packed import IntArray, as_int_array
from trajectory_server._records import _metadata, is_int
from trajectory_server.errors import InvalidRecord

__all__ = ["PromptTable"]

#: the largest key: a dataset row index fits easily
MAX_KEY = 2**62


def check_prompt_key(key: object) -> None:
    """A prompt table key: an int in [0, ``MAX_KEY``]."""
    if not is_int(key) or not 0 <= key <= MAX_KEY:  # type: ignore[operator]
        raise InvalidRecord(
            f"a prompt key must be an int in [0, 2**62], got {key!r:.40}",
            field="prompt_key",
            value=key,
        )


class PromptTable:
    """Prompt token ids and metadata by integer key (see the module docstring)."""

    __slots__ = ("_rows",)

    def __init__(self) -> None:
        self._rows: dict[int, tuple[IntArray, dict[str, Any]]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def put(self, items: Iterable[tuple[int, Iterable[int], Mapping[str, Any] | None]]) -> int:
        """Put ``(key, prompt token ids, metadata or None)`` items, all or none (a bad item
        refuses them all); returns how many were put."""
        checked: dict[int, tuple[IntArray, dict[str, Any]]] = {}
        for item in items:
            try:
                key, ids, metadata = item
            except (TypeError, ValueError):
                raise InvalidRecord(
                    f"each prompt is (key, token ids, metadata), got {item!r:.60}", field="prompts"
                ) from None
            check_prompt_key(key)
            try:
                tokens = as_int_array(ids)
            except (InvalidRecord, TypeError, ValueError, OverflowError) as exc:
                raise InvalidRecord(
                    f"prompt {key}: token ids must be ints in the int32 range ({exc})",
                    field="prompt_token_ids",
                ) from None
            if not len(tokens):
                raise InvalidRecord(
                    f"prompt {key} is empty; a prompt needs >= 1 token", field="prompt_token_ids"
                )
            checked[key] = (tokens, _metadata(metadata))
        self._rows.update(checked)
        return len(checked)

    def get(self, key: Any) -> tuple[IntArray, dict[str, Any]]:
        """The prompt token ids and metadata put under ``key``."""
        if not is_int(key):
            raise InvalidRecord(
                f"prompt_key must be an int, got {type(key).__name__}", field="prompt_key"
            )
        got = self._rows.get(key)
        if got is None:
            raise InvalidRecord(
                f"no prompt under key {key!r:.40} ({len(self._rows)} put; put_prompts first)",
                field="prompt_key",
                value=key,
            )
        return got
