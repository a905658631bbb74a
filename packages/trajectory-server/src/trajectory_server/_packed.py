"""Immutable packed numeric arrays for token ids, logprobs and per-token versions.

A 10K-token trajectory held as a tuple of Python ints costs ~40 bytes a token; packed it costs
4 (ids, versions: int32) or 8 (logprobs: float64, so values round-trip bit-exactly). The bytes
are little-endian on every host and go onto the wire and into checkpoints unchanged.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, SupportsIndex, overload

from trajectory_server.errors import InvalidRecord

_BIG_ENDIAN = sys.byteorder == "big"


class _Packed:
    """Base: an immutable sequence backed by little-endian ``bytes``."""

    __slots__ = ("_data",)
    typecode: ClassVar[str]
    itemsize: ClassVar[int]
    kind: ClassVar[str]

    def __init__(self, values: Iterable[Any] = ()) -> None:
        if isinstance(values, type(self)):
            self._data: bytes = values._data
            return
        try:
            arr = array.array(self.typecode, values)
        except (TypeError, OverflowError) as exc:
            raise InvalidRecord(
                f"cannot pack values as {self.kind}: {exc}", field=self.kind, value=None
            ) from exc
        if _BIG_ENDIAN:
            arr.byteswap()
        self._data = arr.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, field: str = "") -> Any:
        """Wrap packed little-endian bytes (as produced by :meth:`to_bytes`)."""
        raw = bytes(data)
        if len(raw) % cls.itemsize:
            raise InvalidRecord(
                f"{field or cls.kind}: {len(raw)} bytes is not a multiple of {cls.itemsize}",
                field=field or cls.kind,
                value=len(raw),
            )
        obj = cls.__new__(cls)
        obj._data = raw
        return obj

    def to_bytes(self) -> bytes:
        return self._data

    def _view(self) -> memoryview:
        if _BIG_ENDIAN:  # pragma: no cover - no big-endian CI host
            arr = array.array(self.typecode, self._data)
            arr.byteswap()
            return memoryview(arr)
        return memoryview(self._data).cast(self.typecode)  # type: ignore[call-overload,no-any-return]

    def tolist(self) -> list[Any]:
        return self._view().tolist()

    def __len__(self) -> int:
        return len(self._data) // self.itemsize

    def __iter__(self) -> Iterator[Any]:
        return iter(self._view().tolist())

    @overload
    def __getitem__(self, index: SupportsIndex) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> Any: ...
    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1 and start == 0 and stop >= len(self):
                return self
            if step == 1:
                return type(self).from_bytes(
                    self._data[start * self.itemsize : max(start, stop) * self.itemsize]
                )
            return type(self)(self._view()[index].tolist())
        return self._view()[index]

    def __add__(self, other: Any) -> Any:
        if not isinstance(other, type(self)):
            return NotImplemented
        return type(self).from_bytes(self._data + other._data)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._data == other._data  # type: ignore[attr-defined,no-any-return,unused-ignore]

    def __hash__(self) -> int:
        return hash((self.typecode, self._data))

    def __repr__(self) -> str:
        n = len(self)
        head = self._view()[:6].tolist()
        more = f", ... n={n}" if n > 6 else ""
        return f"{type(self).__name__}({head!r}{more})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self).from_bytes, (self._data,))


class IntArray(_Packed):
    """Immutable int32 array (token ids, per-token versions)."""

    __slots__ = ("_min",)
    typecode = "i"
    itemsize = 4
    kind = "int32 array"

    def min(self) -> int | None:
        """Smallest element (None if empty); cached, and carried through ``+``."""
        try:
            return self._min  # type: ignore[has-type,no-any-return]
        except AttributeError:
            pass
        if not self._data:
            value = None
        elif len(self._data) >= _NUMPY_THRESHOLD and _numpy() is not None:
            value = int(_numpy().frombuffer(self._data, dtype="<i4").min())
        else:
            value = min(self._view())
        self._min = value
        return value

    def max(self) -> int | None:
        return max(self._view()) if self._data else None

    def __add__(self, other: Any) -> Any:
        out = super().__add__(other)
        if out is not NotImplemented:
            mins = [m for m in (self.min(), other.min()) if m is not None]
            out._min = min(mins) if mins else None
        return out


_NUMPY_THRESHOLD = 512
_np: Any = None


def _numpy() -> Any:
    """numpy if installed (an optional speed-up for large arrays; never required)."""
    global _np
    if _np is None:
        try:
            import numpy
        except ImportError:  # pragma: no cover - the workspace has numpy
            _np = False
        else:
            _np = numpy
    return _np or None


class FloatArray(_Packed):
    """Immutable float64 array (per-token logprobs)."""

    __slots__ = ()
    typecode = "d"
    itemsize = 8
    kind = "float64 array"


assert array.array("i").itemsize == IntArray.itemsize
assert array.array("d").itemsize == FloatArray.itemsize


def as_int_array(value: Iterable[int] | bytes | IntArray) -> IntArray:
    """attrs converter: lists, tuples, arrays and IntArray all become an IntArray."""
    if isinstance(value, IntArray):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return IntArray.from_bytes(value)  # type: ignore[no-any-return]
    return IntArray(_reject_bools(value))


def as_float_array(value: Iterable[float] | bytes | FloatArray) -> FloatArray:
    """attrs converter: lists, tuples, arrays and FloatArray all become a FloatArray."""
    if isinstance(value, FloatArray):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return FloatArray.from_bytes(value)  # type: ignore[no-any-return]
    return FloatArray(value)


def _reject_bools(values: Iterable[Any]) -> Iterable[Any]:
    if isinstance(values, list | tuple) and any(isinstance(v, bool) for v in values):
        raise InvalidRecord("token ids / versions must be ints, not bools", field="int32 array")
    return values
