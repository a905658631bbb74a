"""Datasets: verl-style JSONL/Parquet loaders, built-in toy tasks, a checkpointable cursor."""

from typing import Any

from staleflow_trainer.data.cursor import DataCursor
from staleflow_trainer.data.loaders import check_prompt_lengths, load_dataset
from staleflow_trainer.data.records import PromptRecord
from staleflow_trainer.data.tokenize import encode_prompt, encode_prompts
from staleflow_trainer.data.toy import TOY_TASKS, toy_accuracy, toy_records, toy_score

__all__ = [
    "TOY_TASKS",
    "DataCursor",
    "PromptRecord",
    "check_prompt_lengths",
    "encode_prompt",
    "encode_prompts",
    "load_dataset",
    "load_records",
    "toy_accuracy",
    "toy_records",
    "toy_score",
]


def load_records(cfg: Any) -> list[PromptRecord]:  # cfg: staleflow_trainer.config.AppConfig
    """The run's prompts: ``data.path`` if set, else the built-in toy task."""
    if cfg.data.path:
        return load_dataset(
            cfg.data.path, prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key
        )
    return toy_records(cfg.data.toy_task, size=cfg.data.toy_size, seed=cfg.run.seed)
