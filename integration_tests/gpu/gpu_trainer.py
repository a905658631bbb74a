"""The trainer's GPU path: GRPO steps on CUDA learn the toy task like the CPU path does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from staleflow_trainer.config import TrainerConfig
from staleflow_trainer.data import DataCursor, toy_records
from staleflow_trainer.tiny_model import EOS_ID, TinyModelSpec, make_char_tokenizer, make_tiny_model
from staleflow_trainer.trainer import Trainer
from staleflow_trainer.trainer.local_rollout import sample_responses, toy_train_batch

pytestmark = [pytest.mark.gpu]


def test_grpo_on_cuda_learns_the_toy_task(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("gpu_trainer needs a CUDA GPU; none is visible")
    model_dir = make_tiny_model(tmp_path / "model", TinyModelSpec(seed=0))
    tr = Trainer(TrainerConfig(device="cuda", lr=1e-2), model_dir, max_response_len=3, seed=0)
    assert next(tr.model.parameters()).is_cuda
    tok = make_char_tokenizer()
    recs = toy_records("add", size=512, seed=0)
    cursor = DataCursor(len(recs), seed=0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rewards = []
    for step in range(60):
        idx = cursor.take(8)
        prompts = [tok(recs[i].prompt)["input_ids"] for i in idx]
        resp = sample_responses(
            tr.model, prompts, n=8, max_new_tokens=3, eos_id=EOS_ID, generator=gen
        )
        batch = toy_train_batch(resp, [recs[i] for i in idx], n=8, step=step, tokenizer=tok)
        m = tr.train_step(batch)
        assert np.isfinite(m["loss"])
        rewards.append(m["reward_mean"])
    assert not any(t.is_cuda for t in tr.state_dict().values())  # pushed weights are on CPU
    assert float(np.mean(rewards[-10:])) > float(np.mean(rewards[:10])) + 0.06
