from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from staleflow_trainer.config import OverlongConfig, TrainerConfig
from staleflow_trainer.data import DataCursor, toy_records
from staleflow_trainer.errors import CheckpointError, TrainerError
from staleflow_trainer.tiny_model import EOS_ID, make_char_tokenizer
from staleflow_trainer.trainer import Trainer, TrainSample
from staleflow_trainer.trainer.fsdp import local_slice, shard_plan
from staleflow_trainer.trainer.local_rollout import sample_responses, toy_train_batch

PROMPT = (7, 14, 8, 17)  # "3+4="


def _batch(reward_of: dict[int, float] | None = None, lp: float = -3.0) -> list[TrainSample]:
    """Two groups of 4; responses are one digit + EOS; '7' (id 11) is rewarded."""
    reward_of = reward_of or {11: 1.0}
    out = []
    for g, digits in enumerate(([11, 10, 9, 12], [11, 11, 5, 6])):
        for d in digits:
            out.append(
                TrainSample(
                    group_id=f"g{g}",
                    prompt_ids=PROMPT,
                    response_ids=(d, EOS_ID),
                    rollout_logprobs=(lp, lp),
                    reward=reward_of.get(d, 0.0),
                )
            )
    return out


def _trainer(path: Path, **kw: object) -> Trainer:
    cfg = TrainerConfig(device="cpu", **kw)  # type: ignore[arg-type]
    return Trainer(cfg, path, max_response_len=3, seed=0)


def test_train_step_raises_logprob_of_rewarded_response(tiny_model_dir: Path) -> None:
    tr = _trainer(tiny_model_dir, lr=1e-2)
    batch = _batch()
    before = tr.compute_logprobs(batch)
    m = tr.train_step(batch)
    after = tr.compute_logprobs(batch)
    assert tr.version == 1 and m["version"] == 1.0
    assert after[0][0] > before[0][0]  # the rewarded '7' became more likely
    assert after[1][0] < before[1][0]  # an unrewarded '6' became less likely
    for key in ("loss", "grad_norm", "lr", "reward_mean", "tis_mean", "pg_clipfrac", "tokens"):
        assert key in m
    assert m["reward_mean"] == pytest.approx(3 / 8)
    assert m["tokens"] == 16.0


def test_repeated_steps_reduce_loss_on_a_fixed_batch(tiny_model_dir: Path) -> None:
    tr = _trainer(tiny_model_dir, lr=1e-2)
    batch = _batch()
    start = sum(
        lp[0] for lp, s in zip(tr.compute_logprobs(batch), batch, strict=True) if s.reward > 0
    )
    for _ in range(5):
        tr.train_step(batch)
    end = sum(
        lp[0] for lp, s in zip(tr.compute_logprobs(batch), batch, strict=True) if s.reward > 0
    )
    assert end > start + 0.5


def test_tis_weights_are_applied_and_capped(tiny_model_dir: Path) -> None:
    # rollout logprobs far below the trainer's: every weight hits the cap
    low = _trainer(tiny_model_dir, tis_cap=2.0).train_step(_batch(lp=-20.0))
    assert low["tis_mean"] == pytest.approx(2.0) and low["tis_capped_frac"] == 1.0
    off = _trainer(tiny_model_dir, use_tis=False).train_step(_batch(lp=-20.0))
    assert off["tis_mean"] == 1.0
    # same data, gradients scaled by the cap → larger grad norm with TIS on
    assert low["grad_norm"] == pytest.approx(2.0 * off["grad_norm"], rel=1e-4)


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)`:UserWarning")
def test_micro_batches_match_whole_batch(tiny_model_dir: Path) -> None:
    """Gradient accumulation over micro-batches gives the whole batch's gradient."""
    grads = []
    for micro in (0, 2):
        tr = _trainer(tiny_model_dir, grad_clip=0.0, micro_batch_size=micro)
        tr.optimizer.step = lambda *a, **k: None  # type: ignore[method-assign]  # keep weights
        tr.train_step(_batch())
        grads.append(
            {k: p.grad.clone() for k, p in tr.model.named_parameters() if p.grad is not None}
        )
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for k, g in grads[0].items():
        assert torch.allclose(g, grads[1][k], atol=1e-6, rtol=1e-4), k


def test_overlong_penalty_changes_scores(tiny_model_dir: Path) -> None:
    tr = _trainer(tiny_model_dir, overlong=OverlongConfig(enabled=True, buffer_len=1))
    s = TrainSample(
        group_id="g",
        prompt_ids=PROMPT,
        response_ids=(11, 11, 11),
        rollout_logprobs=(-1.0, -1.0, -1.0),
        reward=1.0,
        truncated=True,
    )
    assert tr.scores([s]).tolist() == [0.0]  # 1.0 + (-1.0) for exceeding max_len


def test_batch_validation(tiny_model_dir: Path) -> None:
    tr = _trainer(tiny_model_dir, mini_batches=3)
    with pytest.raises(TrainerError, match="mini-batches"):
        tr.train_step(_batch())
    with pytest.raises(TrainerError):
        tr.train_step([])
    assert tr.version == 0
    with pytest.raises(TrainerError, match="rollout logprobs"):
        TrainSample(
            group_id="g",
            prompt_ids=PROMPT,
            response_ids=(1, 2),
            rollout_logprobs=(-1.0,),
            reward=0.0,
        )
    with pytest.raises(TrainerError, match="reward"):
        TrainSample(
            group_id="g",
            prompt_ids=PROMPT,
            response_ids=(1,),
            rollout_logprobs=(-1.0,),
            reward=float("nan"),
        )
    with pytest.raises(TrainerError):
        TrainSample(
            group_id="g", prompt_ids=PROMPT, response_ids=(1,), rollout_logprobs=(0.5,), reward=0.0
        )


def test_checkpoint_round_trip_is_exact(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = {"lr": 1e-2, "warmup_steps": 3}
    ref = _trainer(tiny_model_dir, **cfg)
    ref.train_step(_batch())
    ref.save_checkpoint(tmp_path / "ck")
    ref.train_step(_batch())
    ref.train_step(_batch({10: 1.0}))
    resumed = _trainer(tiny_model_dir, **cfg)
    resumed.load_checkpoint(tmp_path / "ck")
    assert resumed.version == 1
    resumed.train_step(_batch())
    m = resumed.train_step(_batch({10: 1.0}))
    assert resumed.version == ref.version == 3
    assert m["lr"] == pytest.approx(1e-2)  # warm-up schedule continued, not restarted
    for (k, va), vb in zip(ref.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(va, vb), k


def test_corrupt_checkpoint_is_rejected(tiny_model_dir: Path, tmp_path: Path) -> None:
    tr = _trainer(tiny_model_dir)
    path = tr.save_checkpoint(tmp_path / "ck")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    fresh = _trainer(tiny_model_dir)
    with pytest.raises(CheckpointError, match="SHA-256"):
        fresh.load_checkpoint(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="missing"):
        fresh.load_checkpoint(tmp_path / "nothing")
    assert fresh.version == 0


def test_state_dict_has_no_shared_storage(tiny_model_dir: Path) -> None:
    sd = _trainer(tiny_model_dir).state_dict()
    assert "lm_head.weight" in sd and torch.equal(
        sd["lm_head.weight"], sd["model.embed_tokens.weight"]
    )
    ptrs = [t.untyped_storage().data_ptr() for t in sd.values()]
    assert len(ptrs) == len(set(ptrs))


def test_save_pretrained_reloads(tiny_model_dir: Path, tmp_path: Path) -> None:
    tr = _trainer(tiny_model_dir, lr=1e-2)
    tr.train_step(_batch())
    out = tr.save_pretrained(tmp_path / "hf")
    again = Trainer(TrainerConfig(device="cpu"), out, max_response_len=3)
    for (k, va), vb in zip(tr.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(va, vb), k


def test_grpo_learns_the_toy_task(tiny_model_dir: Path) -> None:
    """Plain GRPO loop (local sampler, no vLLM): reward rises on the built-in toy task."""
    tok = make_char_tokenizer()
    recs = toy_records("add", size=512, seed=0)
    cursor = DataCursor(len(recs), seed=0)
    tr = _trainer(tiny_model_dir, lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    rewards = []
    for step in range(60):
        idx = cursor.take(8)
        prompts = [tok(recs[i].prompt)["input_ids"] for i in idx]
        resp = sample_responses(
            tr.model, prompts, n=8, max_new_tokens=3, eos_id=EOS_ID, generator=gen
        )
        batch = toy_train_batch(resp, [recs[i] for i in idx], n=8, step=step, tokenizer=tok)
        rewards.append(tr.train_step(batch)["reward_mean"])
    first, last = float(np.mean(rewards[:10])), float(np.mean(rewards[-10:]))
    assert last > first + 0.06, (first, last)


def test_fsdp_plan_and_slicing(tiny_model_dir: Path) -> None:
    tr = _trainer(tiny_model_dir)
    assert shard_plan(tr.model) == ["model.layers.0", "model.layers.1", ""]
    assert local_slice(list(range(8)), rank=1, world_size=4) == [2, 3]
    with pytest.raises(TrainerError, match="split"):
        local_slice(list(range(6)), rank=0, world_size=4)
    with pytest.raises(TrainerError):
        local_slice([1], rank=2, world_size=2)
    with pytest.raises(TrainerError):
        shard_plan(torch.nn.Linear(2, 2))


def test_fsdp2_single_rank_gloo(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The FSDP2 code path runs end to end on one CPU rank (gloo)."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        tr = Trainer(
            TrainerConfig(fsdp=True, device="auto", lr=1e-2), tiny_model_dir, max_response_len=3
        )
        assert type(tr.model).__name__.startswith("FSDP")
        plain = _trainer(tiny_model_dir, lr=1e-2)
        tr.train_step(_batch())
        plain.train_step(_batch())
        sd = tr.state_dict()
        for k, v in plain.state_dict().items():
            assert torch.allclose(sd[k], v, atol=1e-6), k
    finally:
        dist.destroy_process_group()
    with pytest.raises(TrainerError, match="distributed"):
        Trainer(TrainerConfig(fsdp=True), tiny_model_dir, max_response_len=3)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_reward_fails_loudly_and_leaves_weights(
    tiny_model_dir: Path, bad: float
) -> None:
    """A reward the trainer cannot compute with must not turn the weights into NaN: the step
    is refused with a TrainerError and the weights (and version) stay as they were."""
    tr = _trainer(tiny_model_dir, lr=1e-2)
    before = {k: v.clone() for k, v in tr.state_dict().items()}
    with pytest.raises(TrainerError, match=r"reward|not finite"):
        tr.train_step(_batch({11: bad}))
    assert tr.version == 0
    for k, v in tr.state_dict().items():
        assert torch.isfinite(v).all() and torch.equal(v, before[k]), k


@pytest.mark.parametrize("huge", [1e38, 1e39])
def test_reward_beyond_float32_trains_finitely(tiny_model_dir: Path, huge: float) -> None:
    """1e39 does not fit float32 (nor does the square of 1e38): scores and advantages are
    computed in float64, so the weights stay finite."""
    tr = _trainer(tiny_model_dir, lr=1e-2)
    m = tr.train_step(_batch({11: huge}))
    assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])
    tr.require_finite_weights()


@pytest.mark.fault
def test_non_finite_gradient_takes_no_step(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tr = _trainer(tiny_model_dir, lr=1e-2, grad_clip=0.0)
    monkeypatch.setattr(
        "staleflow_trainer.trainer.core._grad_norm", lambda model: torch.tensor(float("nan"))
    )
    before = {k: v.clone() for k, v in tr.state_dict().items()}
    with pytest.raises(TrainerError, match="no optimizer step"):
        tr.train_step(_batch())
    assert all(torch.equal(v, before[k]) for k, v in tr.state_dict().items())


def test_non_finite_weights_are_never_checkpointed(tiny_model_dir: Path, tmp_path: Path) -> None:
    tr = _trainer(tiny_model_dir)
    with torch.no_grad():
        next(tr.model.parameters()).view(-1)[0] = float("nan")
    with pytest.raises(TrainerError, match="non-finite"):
        tr.save_checkpoint(tmp_path)
    assert not (tmp_path / "trainer.pt").exists()
