from __future__ import annotations

import threading
import time

import pytest

from staleflow_trainer.errors import RewardError
from staleflow_trainer.reward import (
    RewardRunner,
    answers_match,
    compute_score,
    extract_answer,
    load_reward_fn,
    normalise_result,
)
from staleflow_trainer.reward.math_checker import compute_score as math_score


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{3}{4}} and then 7", "\\frac{3}{4}"),
        ("first 3 then 5 #### 1,234", "1,234"),
        ("we get 12, then 13.", "13"),
        ("nothing here", None),
    ],
)
def test_extract_answer(text: str, answer: str | None) -> None:
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    ("pred", "truth", "ok"),
    [
        ("1,234", "1234", True),
        ("\\frac{3}{4}", "0.75", True),
        ("3/4", "0.75", True),
        ("50%", "50", True),
        ("$5", "5.0", True),
        ("1e3", "1000", True),
        ("13", "12", False),
        ("x+1", "x + 1", True),
        ("x+2", "x+1", False),
    ],
)
def test_answers_match(pred: str, truth: str, ok: bool) -> None:
    assert answers_match(pred, truth) is ok


def test_math_compute_score_and_default_dispatch() -> None:
    assert math_score("gsm8k", "The total is 18 eggs. #### 18", "18") == 1.0
    assert math_score("gsm8k", "The total is 17", "18") == 0.0
    assert math_score("gsm8k", "no number", "18") == 0.0
    assert compute_score("toy_add", "6", "7") == pytest.approx(0.1)  # toy rule, not math
    assert compute_score("gsm8k", "6", "7") == 0.0


def test_load_reward_fn_paths() -> None:
    assert load_reward_fn("staleflow_trainer.reward.default:compute_score") is compute_score
    assert load_reward_fn("staleflow_trainer.reward.default.compute_score") is compute_score
    for bad in ("", "nomodule_xyz:f", "staleflow_trainer.reward.default:nope", "os.sep", "x"):
        with pytest.raises(RewardError) as info:
            load_reward_fn(bad)
        assert info.value.fn == bad


def test_normalise_result() -> None:
    assert normalise_result(1) == (1.0, {})
    assert normalise_result(True) == (1.0, {})
    assert normalise_result({"score": 0.5, "acc": 1}) == (0.5, {"acc": 1})
    for bad in ({"acc": 1}, "1.0", None, float("nan")):
        with pytest.raises(RewardError):
            normalise_result(bad)


def test_runner_success_with_dict() -> None:
    r = RewardRunner(lambda ds, s, gt, extra: {"score": 1.0, "pred": s}, retries=0)
    out = r.score(trajectory_id="t1", data_source="d", solution_str="7", ground_truth="7")
    assert out.score == 1.0 and out.extra == {"pred": "7"} and out.attempts == 1
    assert not out.dropped and out.reason is None


def test_runner_retries_then_succeeds() -> None:
    calls = []

    def flaky(ds: str, s: str, gt: str, extra: dict) -> float:
        calls.append(1)
        if len(calls) < 3:
            raise ValueError("transient")
        return 0.25

    out = RewardRunner(flaky, retries=2).score(
        trajectory_id="t", data_source="d", solution_str="", ground_truth=""
    )
    assert out.score == 0.25 and out.attempts == 3 and len(calls) == 3


def test_runner_drops_a_raising_reward_with_reason() -> None:
    calls = []

    def broken(ds: str, s: str, gt: str, extra: dict) -> float:
        calls.append(1)
        raise KeyError("boom")

    out = RewardRunner(broken, retries=2).score(
        trajectory_id="t9", data_source="d", solution_str="", ground_truth=""
    )
    assert out.dropped and out.score is None and out.attempts == 3 and len(calls) == 3
    assert out.trajectory_id == "t9"
    assert out.reason is not None and "KeyError" in out.reason and "boom" in out.reason


def test_runner_drops_a_hanging_reward_after_timeout() -> None:
    release = threading.Event()

    def hang(ds: str, s: str, gt: str, extra: dict) -> float:
        release.wait(5)
        return 1.0

    runner = RewardRunner(hang, retries=1, timeout_s=0.1)
    t0 = time.perf_counter()
    out = runner.score(trajectory_id="t", data_source="d", solution_str="", ground_truth="")
    release.set()
    assert out.dropped and out.reason is not None and out.reason.startswith("timeout")
    assert out.attempts == 2 and runner.abandoned_calls == 2
    assert time.perf_counter() - t0 < 3.0


def test_runner_non_score_is_a_failure() -> None:
    out = RewardRunner(lambda *a: "high", retries=0).score(
        trajectory_id="t", data_source="d", solution_str="", ground_truth=""
    )
    assert out.dropped and "number" in (out.reason or "")
    with pytest.raises(RewardError):
        RewardRunner(compute_score, retries=-1)
    with pytest.raises(RewardError):
        RewardRunner("nomodule_xyz:f")
