"""Built-in math answer checker.

The answer of a response is, in order of preference: the content of the last ``\\boxed{…}``,
the number after the last ``####`` (GSM8K style), or the last number in the text. Answers
compare numerically when both parse as numbers (``1,000`` = ``1000`` = ``1e3``, ``3/4`` =
``0.75``, trailing ``%``/``$`` ignored; relative tolerance 1e-6), else as normalised strings.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?|-?\.\d+")


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The response's final answer as a string, or None if it has none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1]
        m = _NUMBER.search(tail)
        if m:
            return m.group(0).strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


def parse_number(s: str) -> float | None:
    """``"1,234.5"`` → 1234.5, ``"3/4"`` → 0.75, ``"50%"`` → 50.0; None if not a number."""
    t = s.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip("%").rstrip(".")
    t = t.replace("\\frac{", "").replace("}{", "/").replace("}", "") if "\\frac" in t else t
    if not t:
        return None
    try:
        if "/" in t:
            return float(Fraction(t))
        return float(t)
    except (ValueError, ZeroDivisionError):
        return None


def _normalise(s: str) -> str:
    return re.sub(r"\s+", "", s).strip("$.").lower()


def answers_match(pred: str, truth: str, *, rel_tol: float = 1e-6) -> bool:
    a, b = parse_number(pred), parse_number(truth)
    if a is not None and b is not None:
        return abs(a - b) <= rel_tol * max(1.0, abs(b))
    return _normalise(pred) == _normalise(truth)


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None
) -> float:
    """verl-convention reward: 1.0 if the extracted answer matches ``ground_truth``, else 0."""
    pred = extract_answer(solution_str)
    if pred is None:
        return 0.0
    return 1.0 if answers_match(pred, str(ground_truth)) else 0.0
