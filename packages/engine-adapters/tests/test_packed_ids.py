"""Packed ids (``pack_ids`` / ``unpack_ids``): the samples of one prompt travel as its id
prefix and their numbers, unpack to the same ids, and malformed ones are refused."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_adapters import pack_ids, unpack_ids


@given(
    st.lists(
        st.one_of(
            st.builds(lambda g, n: f"g{g}/{n}", st.integers(0, 3), st.integers(0, 20)),
            st.sampled_from(["plain", "g1", "g1/01", "x/y/3", "7", "a/"]),
        ),
        max_size=30,
    )
)
def test_packed_ids_unpack_to_the_same_ids_grouped_by_prefix(ids: list[str]) -> None:
    packed = pack_ids(ids)
    got = unpack_ids(packed)
    assert sorted(got) == sorted(ids)  # the same ids, as many times each
    assert unpack_ids(got) == got  # a plain list of ids unpacks to itself
    # grouped: the samples of one prompt send their prefix once, other ids go whole
    numbered = [re.fullmatch(r"(.*)/(0|[1-9][0-9]*)", t) for t in ids]
    prefixes = {m.group(1) for m in numbered if m}
    whole = sum(1 for m in numbered if not m)
    assert sum(isinstance(x, str) for x in packed) == len(prefixes) + whole


def test_packed_ids_are_compact_and_malformed_ones_are_refused() -> None:
    ids = [f"g000123/{i}" for i in range(0, 8, 2)]
    assert pack_ids(ids) == ["g000123", 0, 2, 4, 6]
    assert unpack_ids(["a", "g7", 1, "b"]) == ["a", "g7/1", "b"]
    with pytest.raises(ValueError, match="follows no prefix"):
        unpack_ids([3, "g7"])
    with pytest.raises(ValueError, match="follows no prefix"):
        unpack_ids(["g7", True])
