"""The prompt record every loader produces (verl-style fields)."""

from __future__ import annotations

from typing import Any

import attrs


def _prompt(
    value: str | list[dict[str, str]] | tuple[Any, ...],
) -> str | tuple[tuple[str, str], ...]:
    if isinstance(value, str):
        return value
    return tuple((str(m["role"]), str(m["content"])) for m in value)


@attrs.frozen(kw_only=True)
class PromptRecord:
    """One dataset row.

    ``prompt`` is a plain string or a chat as ``((role, content), ...)``; ``index`` is the
    row's position in the file (stable id used by the data cursor and the ledger).
    """

    index: int
    prompt: str | tuple[tuple[str, str], ...] = attrs.field(converter=_prompt)
    ground_truth: str
    data_source: str = "unknown"
    extra_info: dict[str, Any] = attrs.field(factory=dict)

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)

    def chat_messages(self) -> list[dict[str, str]]:
        if isinstance(self.prompt, str):
            return [{"role": "user", "content": self.prompt}]
        return [{"role": r, "content": c} for r, c in self.prompt]

    def prompt_text(self) -> str:
        """The prompt as plain text (chat turns' contents joined by newlines)."""
        if isinstance(self.prompt, str):
            return self.prompt
        return "\n".join(c for _, c in self.prompt)
