"""Rewards: verl-convention plug-ins by dotted path, a math answer checker, a safe runner."""

from staleflow_trainer.reward.default import compute_score
from staleflow_trainer.reward.math_checker import answers_match, extract_answer
from staleflow_trainer.reward.plugin import load_reward_fn
from staleflow_trainer.reward.runner import RewardOutcome, RewardRunner, normalise_result

__all__ = [
    "RewardOutcome",
    "RewardRunner",
    "answers_match",
    "compute_score",
    "extract_answer",
    "load_reward_fn",
    "normalise_result",
]
