"""Packed arrays: immutable, exact, compact; the numpy speed-up and the fallback agree."""

from __future__ import annotations

import pickle

import pytest

from trajectory_server import FloatArray, IntArray, _packed
from trajectory_server.errors import InvalidRecord


def test_values_round_trip_exactly() -> None:
    a = IntArray([0, -1, 2**31 - 1, -(2**31)])
    assert a.tolist() == [0, -1, 2**31 - 1, -(2**31)]
    assert IntArray.from_bytes(a.to_bytes()) == a
    f = FloatArray([0.1, -0.0, float("-inf"), 1e-300])
    assert FloatArray.from_bytes(f.to_bytes()).tolist() == [0.1, -0.0, float("-inf"), 1e-300]
    assert len(a.to_bytes()) == 16 and len(f.to_bytes()) == 32
    assert pickle.loads(pickle.dumps(a)) == a


def test_sequence_behaviour() -> None:
    a = IntArray(range(10))
    assert len(a) == 10 and a[3] == 3 and a[-1] == 9
    assert a[2:5] == IntArray([2, 3, 4])
    assert a[::3].tolist() == [0, 3, 6, 9]
    assert a[:] is a
    assert (a[:2] + a[8:]).tolist() == [0, 1, 8, 9]
    assert list(IntArray([5, 6])) == [5, 6]
    assert IntArray([1]) != FloatArray([1.0])
    assert "n=10" in repr(a)


def test_bad_values_rejected() -> None:
    with pytest.raises(InvalidRecord):
        IntArray([2**31])
    with pytest.raises(InvalidRecord):
        IntArray([1.5])  # type: ignore[list-item]
    with pytest.raises(InvalidRecord):
        _packed.as_int_array([True, 2])
    with pytest.raises(InvalidRecord):
        IntArray.from_bytes(b"\x00" * 5)
    with pytest.raises(InvalidRecord):
        FloatArray(["x"])  # type: ignore[list-item]


@pytest.mark.parametrize("numpy", [True, False])
def test_min_with_and_without_numpy(monkeypatch: pytest.MonkeyPatch, numpy: bool) -> None:
    if not numpy:
        monkeypatch.setattr(_packed, "_np", False)
    big = IntArray([7] * 1000 + [3] + [9] * 1000)
    assert big.min() == 3
    assert IntArray().min() is None
    joined = IntArray([5] * 600) + IntArray([4, 8])
    assert joined.min() == 4
    assert (IntArray() + IntArray()).min() is None
