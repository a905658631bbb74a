from __future__ import annotations

import threading
from fractions import Fraction

import numpy as np
import pytest
import torch

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


T = "staleflow_trainer.reward.testing:"


def test_normalise_result() -> None:
    assert normalise_result(1) == (1.0, {})
    assert normalise_result(True) == (1.0, {})
    assert normalise_result({"score": 0.5, "acc": 1}) == (0.5, {"acc": 1})
    for bad in ({"acc": 1}, "1.0", None, float("nan"), 1e39, 1 + 2j, [1.0]):
        with pytest.raises(RewardError):
            normalise_result(bad)


@pytest.mark.parametrize(
    "value", [np.float32(0.5), np.float64(0.5), np.array(0.5), torch.tensor(0.5), Fraction(1, 2)]
)
def test_any_real_number_is_a_score(value: object) -> None:
    """numpy scalars (verl-style plug-ins return them), 0-d arrays/tensors, fractions."""
    assert normalise_result(value) == (0.5, {})
    assert normalise_result({"score": value}) == (0.5, {})


def test_runner_success_with_dict_and_numpy() -> None:
    r = RewardRunner(T + "echo", retries=0)
    out = r.score(trajectory_id="t1", data_source="d", solution_str="7", ground_truth="7")
    assert out.score == 1.0 and out.extra == {"pred": "7"} and out.attempts == 1
    assert not out.dropped and out.reason is None
    r.close()
    out = RewardRunner(T + "numpy_half", retries=0).score(
        trajectory_id="t", data_source="d", solution_str="", ground_truth=""
    )
    assert out.score == 0.5 and not out.dropped


def test_runner_retries_then_succeeds() -> None:
    out = RewardRunner(T + "flaky", retries=2).score(
        trajectory_id="t", data_source="d", solution_str="x", ground_truth=""
    )
    assert out.score == 0.25 and out.attempts == 3


def test_runner_drops_a_raising_reward_with_reason() -> None:
    out = RewardRunner(T + "broken", retries=2).score(
        trajectory_id="t9", data_source="d", solution_str="", ground_truth=""
    )
    assert out.dropped and out.score is None and out.attempts == 3
    assert out.trajectory_id == "t9"
    assert out.reason is not None and "KeyError" in out.reason and "boom" in out.reason


def test_runner_drops_a_reward_beyond_float32() -> None:
    out = RewardRunner(T + "huge", retries=0).score(
        trajectory_id="t", data_source="d", solution_str="", ground_truth=""
    )
    assert out.dropped and "float32" in (out.reason or "")


@pytest.mark.fault
def test_hanging_reward_holds_no_thread_per_call() -> None:
    """Each timed-out call kills the worker process; threads do not pile up and at most one
    worker process is alive, however many calls hang."""
    runner = RewardRunner(T + "hang", retries=1, timeout_s=0.3)
    threads = threading.active_count()
    pids = set()
    for i in range(4):
        out = runner.score(trajectory_id=f"t{i}", data_source="d", solution_str="", ground_truth="")
        assert out.dropped and out.reason is not None and out.reason.startswith("timeout")
        assert out.attempts == 2
        pids.add(runner.worker.pid)
    assert threading.active_count() <= threads
    assert runner.timeouts == 8 and runner.worker.killed == 8
    runner.close()
    assert runner.worker.pid is None


@pytest.mark.fault
def test_a_dead_worker_process_is_replaced() -> None:
    runner = RewardRunner(T + "die", retries=1, timeout_s=30)
    out = runner.score(trajectory_id="t", data_source="d", solution_str="", ground_truth="")
    assert out.dropped and "died" in (out.reason or "")
    assert runner.worker.started == 2  # at construction, and after the first death
    runner.close()


def test_runner_non_score_is_a_failure() -> None:
    out = RewardRunner(T + "word", retries=0).score(
        trajectory_id="t", data_source="d", solution_str="", ground_truth=""
    )
    assert out.dropped and "number" in (out.reason or "")
    with pytest.raises(RewardError):
        RewardRunner(compute_score, retries=-1)
    with pytest.raises(RewardError):
        RewardRunner("nomodule_xyz:f")
    with pytest.raises(RewardError, match="dotted path"):
        RewardRunner(lambda *a: 1.0)
