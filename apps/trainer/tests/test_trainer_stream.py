"""A streamed step (``trainer.stream_batch``) takes the update an unstreamed one takes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from staleflow_trainer.config import TrainerConfig
from staleflow_trainer.errors import TrainerError
from staleflow_trainer.tiny_model import EOS_ID
from staleflow_trainer.trainer import Trainer, TrainSample
from staleflow_trainer.trainer.stream import finish_streamed, stream_part

PROMPT = (7, 14, 8, 17)  # "3+4="
# the recording optimizer below replaces optimizer.step, which torch's scheduler remarks on
pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)`")


def _batch() -> list[TrainSample]:
    """Three groups of 4 whose responses differ in length (1–3 digits + EOS), so the parts
    carry different token counts and a per-part mean would weigh them wrongly."""
    out = []
    for g, responses in enumerate(
        (
            [(11,), (10, 3), (9,), (12, 4, 5)],
            [(11, 11, 2), (11,), (5,), (6, 7)],
            [(4,), (11, 9), (8, 8, 8), (11,)],
        )
    ):
        for digits in responses:
            ids = (*digits, EOS_ID)
            out.append(
                TrainSample(
                    group_id=f"g{g}",
                    prompt_ids=PROMPT,
                    response_ids=ids,
                    rollout_logprobs=tuple(-2.5 - 0.1 * i for i in range(len(ids))),
                    reward=1.0 if digits[0] == 11 else 0.0,
                )
            )
    return out


def _trainer(path: Path, **kw: object) -> Trainer:
    """Its optimizer records the gradients it is given (after clipping) and leaves the weights
    alone: Adam's first step divides by the gradient's own size, so weights after a step
    would compare float noise in near-zero gradients, not the update. No clipping: it would
    hide a gradient of the wrong scale."""
    kw.setdefault("grad_clip", 0.0)
    cfg = TrainerConfig(device="cpu", lr=1e-2, micro_batch_size=3, **kw)  # type: ignore[arg-type]
    tr = Trainer(cfg, path, max_response_len=4, seed=0)
    tr.steps_seen = []  # type: ignore[attr-defined]

    def step(*a: object, **k: object) -> None:
        tr.steps_seen.append(_grads(tr))  # type: ignore[attr-defined]

    tr.optimizer.step = step  # type: ignore[method-assign]
    return tr


def _grads(tr: Trainer) -> list[torch.Tensor]:
    return [
        torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        for p in tr.model.parameters()
    ]


def _same(a: Trainer, b: Trainer) -> bool:
    """Both took the same optimizer steps, with the same gradients."""
    sa, sb = a.steps_seen, b.steps_seen  # type: ignore[attr-defined]
    return len(sa) == len(sb) > 0 and all(
        torch.allclose(x, y, rtol=1e-4, atol=1e-7)
        for ga, gb in zip(sa, sb, strict=True)
        for x, y in zip(ga, gb, strict=True)
    )


def test_a_streamed_step_takes_the_unstreamed_update(tiny_model_dir: Path) -> None:
    batch = _batch()
    plain = _trainer(tiny_model_dir)
    m0 = plain.train_step(batch)
    streamed = _trainer(tiny_model_dir)
    assert stream_part(streamed, [s for s in batch if s.group_id == "g1"]) == 4
    assert stream_part(streamed, [s for s in batch if s.group_id == "g1"]) == 0  # once only
    assert stream_part(streamed, [s for s in batch if s.group_id == "g2"]) == 4
    assert streamed.steps_seen == []  # type: ignore[attr-defined]  (no step before the end)
    m1 = finish_streamed(streamed, batch)
    assert streamed.version == plain.version == 1
    assert any(bool(g.abs().sum() > 0) for g in plain.steps_seen[0])  # type: ignore[attr-defined]
    assert _same(streamed, plain)
    for key in (
        "loss",
        "grad_norm",
        "reward_mean",
        "reward_std",
        "score_mean",
        "adv_abs_mean",
        "response_len_mean",
        "tokens",
        "tis_mean",
        "tis_capped_frac",
        "rollout_old_kl",
        "lr",
        "version",
    ):
        assert m1[key] == pytest.approx(m0[key], rel=1e-4, abs=1e-7), key
    assert m1["streamed_samples"] == 8.0


def test_a_second_step_streams_afresh(tiny_model_dir: Path) -> None:
    batch = _batch()
    plain, streamed = _trainer(tiny_model_dir), _trainer(tiny_model_dir)
    for _ in range(2):
        plain.train_step(batch)
        stream_part(streamed, batch[:4])
        finish_streamed(streamed, batch)
    assert streamed.version == 2
    assert _same(streamed, plain)


def test_parts_the_batch_lacks_are_discarded_not_trained(tiny_model_dir: Path) -> None:
    batch = _batch()
    plain = _trainer(tiny_model_dir)
    plain.train_step(batch[:8])
    streamed = _trainer(tiny_model_dir)
    stream_part(streamed, batch[8:])  # g2, which the consumed batch does not hold
    m = finish_streamed(streamed, batch[:8])
    assert m["streamed_samples"] == 0.0
    assert _same(streamed, plain)


def test_a_part_for_an_older_version_is_dropped_at_the_next_step(tiny_model_dir: Path) -> None:
    batch = _batch()
    streamed, plain = _trainer(tiny_model_dir), _trainer(tiny_model_dir)
    stream_part(streamed, batch[:4])
    streamed.stream.version = -1  # type: ignore[union-attr]  (as if streamed at another step)
    finish_streamed(streamed, batch)
    plain.train_step(batch)
    assert _same(streamed, plain)


def test_streaming_needs_one_update_per_step(tiny_model_dir: Path) -> None:
    tr = _trainer(tiny_model_dir, mini_batches=2)
    with pytest.raises(TrainerError, match="mini_batches") as e:
        stream_part(tr, _batch()[:4])
    assert e.value.field == "mini_batches"


def test_the_batch_may_leave_out_the_groups_streamed_in(tiny_model_dir: Path) -> None:
    """As the trainer actor calls it: the consumed batch's samples without those already in,
    and the batch's group ids."""
    batch = _batch()
    plain, streamed = _trainer(tiny_model_dir), _trainer(tiny_model_dir)
    m0 = plain.train_step(batch)
    stream_part(streamed, batch[4:8])
    rest = batch[:4] + batch[8:]
    m = finish_streamed(streamed, rest, groups=["g0", "g1", "g2"])
    assert m["streamed_samples"] == 4.0 and m["tokens"] == m0["tokens"] == 33.0
    assert _same(streamed, plain)
    with pytest.raises(TrainerError, match=r"neither streamed in nor given"):
        finish_streamed(_trainer(tiny_model_dir), rest, groups=["g0", "g1", "g2"])


def test_a_part_that_fails_halfway_leaves_no_gradient_behind(tiny_model_dir: Path) -> None:
    batch = _batch()
    plain, streamed = _trainer(tiny_model_dir), _trainer(tiny_model_dir)
    plain.train_step(batch)
    stream_part(streamed, batch[:4])
    real = streamed.backward_chunk
    calls = []

    def flaky(*a: object, **k: object) -> object:
        calls.append(1)
        if len(calls) == 2:  # the second micro-batch of the part: its first one is in
            raise RuntimeError("out of memory")
        return real(*a, **k)  # type: ignore[arg-type]

    streamed.backward_chunk = flaky  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="out of memory"):
        stream_part(streamed, batch[4:])
    assert streamed.stream is None
    assert all(p.grad is None for p in streamed.model.parameters())
    streamed.backward_chunk = real  # type: ignore[method-assign]
    m = finish_streamed(streamed, batch)  # the whole batch again, from zero
    assert m["streamed_samples"] == 0.0
    assert _same(streamed, plain)
