"""PyTorch GRPO/DAPO trainer: loss math, batch collation, checkpoints, FSDP2 path."""

from staleflow_trainer.trainer.batch import TrainSample
from staleflow_trainer.trainer.core import Trainer, select_device
from staleflow_trainer.trainer.loss import (
    group_advantages,
    overlong_penalty,
    policy_loss,
    should_drop_group,
    tis_weights,
)

__all__ = [
    "TrainSample",
    "Trainer",
    "group_advantages",
    "overlong_penalty",
    "policy_loss",
    "select_device",
    "should_drop_group",
    "tis_weights",
]
