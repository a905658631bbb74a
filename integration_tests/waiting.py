"""Polling a deployment from a test's driver until something holds (used by the fault tests)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.2) -> Any:
    """``pred()``'s first truthy answer, asked every ``every_s`` seconds; an AssertionError
    naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
