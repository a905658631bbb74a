"""Load a reward function by dotted path: ``pkg.module:function`` or ``pkg.module.function``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from staleflow_trainer.errors import RewardError

RewardFn = Callable[..., Any]


def load_reward_fn(path: str) -> RewardFn:
    """Import and return the callable named by ``path`` (RewardError if it cannot)."""
    if not path or path.strip() != path:
        raise RewardError(f"reward function path {path!r} is empty or padded", fn=path)
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise RewardError(
            f"reward function path {path!r} must look like 'pkg.module:function'", fn=path
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardError(f"cannot import reward module {module_name!r}: {e}", fn=path) from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardError(f"{module_name!r} has no attribute {attr!r}", fn=path)
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardError(f"{path!r} is not callable", fn=path)
    fn: Callable[..., Any] = obj
    return fn
