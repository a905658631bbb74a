"""Input checks shared by the protocols (internal): ids, reasons, ints."""

from __future__ import annotations

from typing import Any

from .errors import InvalidId


def check_id(value: Any, field: str) -> None:
    cls = type(value)
    if cls is not str and cls is not int:
        if isinstance(value, str | int) and not isinstance(value, bool):
            return  # subclasses (e.g. IntEnum) are fine
        raise InvalidId(
            f"{field}={value!r} is invalid: allowed a str or an int", field=field, value=value
        )


def check_reason(reason: Any) -> None:
    if not isinstance(reason, str) or not reason:
        raise InvalidId(
            f"reason={reason!r} is invalid: allowed a non-empty str",
            field="reason",
            value=reason,
        )


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
