"""Synthetic, deterministic token ids and logprobs for the sim engine.

A counter-based hash (splitmix64) of (stream key, response position) gives the token at each
position, so any slice of a trajectory can be produced in one vectorised call, in any order,
and a resumed trajectory continues the very same stream. Logprobs also mix in the version
that generated the token: new weights, new numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_MASK = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        mixed: np.ndarray = x ^ (x >> np.uint64(31))
        return mixed


def stream_key(seed: int, sampling_seed: int | None, prompt_token_ids: Sequence[int]) -> int:
    """The key of a trajectory's token stream: engine seed, sampling seed and prompt."""
    # hash() of a tuple of ints is deterministic across processes (no hash randomisation for
    # ints) and runs at C speed; mixing it once more spreads the bits.
    x = (hash((seed, sampling_seed, tuple(prompt_token_ids))) + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def token_ids(key: int, start: int, stop: int, *, lo: int, hi: int) -> np.ndarray:
    """Random tokens in ``[lo, hi)`` at response positions ``start..stop-1``."""
    pos = np.arange(start, stop, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = _mix(pos * _GOLDEN ^ np.uint64(key))
    return (lo + (x % np.uint64(hi - lo)).astype(np.int64)).astype(np.int64)


def logprobs(key: int, positions: np.ndarray, versions: np.ndarray) -> np.ndarray:
    """Logprobs in ``(-4, 0]`` depending on the position and the generating version."""
    with np.errstate(over="ignore"):
        x = _mix(
            positions.astype(np.uint64) * _GOLDEN
            ^ np.uint64(key)
            ^ (versions.astype(np.uint64) * _M1)
        )
    return -4.0 * (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)
