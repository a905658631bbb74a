"""``SamplingParams``: every field checked at construction, a bad value refused with
``InvalidRequest`` naming the field and what it allows; good values kept as given."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest

from engine_adapters import FinishReason, InvalidRequest, SamplingParams


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("temperature", True, "finite number >= 0"),
        ("temperature", math.inf, "finite number >= 0"),
        ("temperature", math.nan, "finite number >= 0"),
        ("temperature", -0.1, "finite number >= 0"),
        ("temperature", "1.0", "finite number >= 0"),
        ("temperature", None, "finite number >= 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.01, "(0, 1]"),
        ("top_p", True, "(0, 1]"),
        ("top_p", math.nan, "(0, 1]"),
        ("max_new_tokens", True, "int >= 1"),
        ("max_new_tokens", 8.0, "int >= 1"),
        ("max_new_tokens", 0, "int >= 1"),
        ("max_new_tokens", "8", "int >= 1"),
        ("stop_token_ids", (2, True), "ints"),
        ("stop_token_ids", [2.0], "ints"),
        ("stop_token_ids", ["2"], "ints"),
        ("stop_token_ids", 2, "sequence of ints"),
        ("seed", True, "None or an int"),
        ("seed", 1.0, "None or an int"),
        ("seed", "1", "None or an int"),
    ],
)
def test_a_bad_value_is_refused_naming_the_field(field: str, value: Any, allowed: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field
    assert str(err.value).startswith(field) and allowed in str(err.value)


def test_a_bad_value_is_refused_by_evolve_too() -> None:
    with pytest.raises(InvalidRequest) as err:
        attrs.evolve(SamplingParams(), seed=False)
    assert err.value.field == "seed"


def test_good_values_are_kept_as_given() -> None:
    stops = (2, 7)
    s = SamplingParams(temperature=0, top_p=1, max_new_tokens=1, stop_token_ids=stops, seed=-5)
    assert (s.temperature, s.top_p, s.max_new_tokens, s.seed) == (0, 1, 1, -5)
    assert s.stop_token_ids is stops  # a tuple of ints is kept, not copied
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=iter([5])).stop_token_ids == (5,)
    assert SamplingParams(temperature=0.7, top_p=0.9).temperature == 0.7
    assert SamplingParams() == SamplingParams(
        temperature=1.0, top_p=1.0, max_new_tokens=256, stop_token_ids=(), seed=None
    )


def test_finish_reasons() -> None:
    assert [r.value for r in FinishReason] == ["stop", "length", "interrupted"]
