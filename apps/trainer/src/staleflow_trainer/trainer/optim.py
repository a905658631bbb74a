"""AdamW with linear LR warm-up."""

from __future__ import annotations

import torch

from staleflow_trainer.config import TrainerConfig


def make_optimizer(model: torch.nn.Module, cfg: TrainerConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        weight_decay=cfg.weight_decay,
        eps=1e-8,
    )


def make_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """LR factor ``(k+1)/warmup`` for the first ``warmup_steps`` steps, then 1."""
    warmup = cfg.warmup_steps

    def factor(step: int) -> float:
        return 1.0 if warmup <= 0 else min(1.0, (step + 1) / warmup)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
