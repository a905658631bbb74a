"""JSONL and Parquet loaders for verl-style datasets.

Columns: ``prompt`` (string, or a chat list of ``{"role", "content"}``), ground truth in
``reward_model.ground_truth`` (nested) or a top-level ``ground_truth``, optional
``data_source`` and ``extra_info``. The prompt / answer column names are configurable
(``data.prompt_key`` / ``data.answer_key``; dotted names reach into nested dicts). Every
problem is a :class:`DataError` naming the file, the row and the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from staleflow_trainer.data.records import PromptRecord
from staleflow_trainer.data.tokenize import prompt_too_long
from staleflow_trainer.errors import DataError

log = structlog.get_logger(__name__)

_MISSING = object()


def _get(row: Mapping[str, Any], dotted: str) -> Any:
    if dotted in row:
        return row[dotted]
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _to_record(row: Any, i: int, path: str, prompt_key: str, answer_key: str) -> PromptRecord:
    if not isinstance(row, Mapping):
        raise DataError(f"{path}: row {i} is not an object", path=path, row=i, field=None)
    prompt = _get(row, prompt_key)
    if prompt is _MISSING:
        raise DataError(
            f"{path}: row {i} has no {prompt_key!r} column (present: {sorted(row)})",
            path=path,
            row=i,
            field=prompt_key,
        )
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(
                f"{path}: row {i} has an empty prompt", path=path, row=i, field=prompt_key
            )
    elif isinstance(prompt, (list, tuple)):
        if not prompt:
            raise DataError(
                f"{path}: row {i} has an empty chat prompt", path=path, row=i, field=prompt_key
            )
        for m in prompt:
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise DataError(
                    f"{path}: row {i}: chat messages need 'role' and 'content', got {m!r}",
                    path=path,
                    row=i,
                    field=prompt_key,
                )
        if not any(str(m["content"]).strip() for m in prompt):
            raise DataError(
                f"{path}: row {i} has an empty chat prompt", path=path, row=i, field=prompt_key
            )
    else:
        raise DataError(
            f"{path}: row {i}: {prompt_key!r} must be a string or a chat list, got "
            f"{type(prompt).__name__}",
            path=path,
            row=i,
            field=prompt_key,
        )
    answer = _get(row, answer_key)
    if answer is _MISSING and answer_key != "ground_truth":
        answer = _get(row, "ground_truth")
    if answer is _MISSING or answer is None:
        raise DataError(
            f"{path}: row {i} has no ground truth ({answer_key!r} or 'ground_truth')",
            path=path,
            row=i,
            field=answer_key,
        )
    extra = row.get("extra_info") or {}
    if not isinstance(extra, Mapping):
        raise DataError(
            f"{path}: row {i}: extra_info must be an object", path=path, row=i, field="extra_info"
        )
    return PromptRecord(
        index=i,
        prompt=prompt,
        ground_truth=str(answer),
        data_source=str(row.get("data_source") or "unknown"),
        extra_info=dict(extra),
    )


def _iter_jsonl(path: Path) -> Iterable[tuple[int, Any]]:
    with path.open("rb") as fh:
        i = 0
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}: line {lineno} is not UTF-8 text (byte {e.start}: {e.reason})",
                    path=str(path),
                    row=i,
                ) from None
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}: line {lineno} is not valid JSON: {e.msg}", path=str(path), row=i
                ) from None
            i += 1


def _iter_parquet(path: Path) -> Iterable[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise DataError(f"{path}: cannot read Parquet: {e}", path=str(path)) from None
    yield from enumerate(table.to_pylist())


_READERS: dict[str, Callable[[Path], Iterable[tuple[int, Any]]]] = {
    ".jsonl": _iter_jsonl,
    ".json": _iter_jsonl,
    ".parquet": _iter_parquet,
}


def load_dataset(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "reward_model.ground_truth",
) -> list[PromptRecord]:
    """Load every row of a JSONL or Parquet file as :class:`PromptRecord`."""
    p = Path(path)
    reader = _READERS.get(p.suffix.lower())
    if reader is None:
        raise DataError(
            f"{p}: unsupported extension {p.suffix!r}; use one of {sorted(_READERS)}",
            path=str(p),
        )
    if not p.is_file():
        raise DataError(f"{p}: file does not exist", path=str(p))
    records = [_to_record(row, i, str(p), prompt_key, answer_key) for i, row in reader(p)]
    if not records:
        raise DataError(f"{p}: dataset is empty", path=str(p))
    log.info("dataset_loaded", path=str(p), rows=len(records))
    return records


def check_prompt_lengths(
    records: Sequence[PromptRecord],
    token_counts: Sequence[int],
    *,
    max_prompt_len: int,
    source: str | None = None,
) -> None:
    """Raise a DataError naming the file (``source``) and the first row whose prompt exceeds
    ``max_prompt_len`` tokens."""
    for rec, n in zip(records, token_counts, strict=True):
        if n > max_prompt_len:
            raise prompt_too_long(rec, n, max_prompt_len=max_prompt_len, source=source)
