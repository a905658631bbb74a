"""GRPO/DAPO loss math against hand-computed small cases."""

from __future__ import annotations

import math

import pytest
import torch

from staleflow_trainer.trainer.loss import (
    group_advantages,
    overlong_penalty,
    policy_loss,
    should_drop_group,
    tis_weights,
)


def test_group_advantages_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = group_advantages(rewards, groups, eps=0.0)
    # group 0: mean 0.25, unbiased std sqrt(0.75/3) = 0.5
    assert adv[:4].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])
    # group 1: mean 3, std sqrt(2) -> ±1/sqrt(2)
    assert adv[4:].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)])


def test_group_advantages_degenerate_groups() -> None:
    adv = group_advantages(torch.tensor([1.0, 1.0, 5.0]), torch.tensor([0, 0, 1]), eps=1e-6)
    assert adv.tolist() == [0.0, 0.0, 0.0]  # equal rewards, and a group of one
    # interleaved group ids
    adv = group_advantages(torch.tensor([1.0, 3.0, 0.0, 2.0]), torch.tensor([0, 1, 0, 1]), eps=0)
    assert adv.tolist() == pytest.approx(
        [1 / math.sqrt(2), 1 / math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)]
    )
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))


def test_overlong_penalty_dapo() -> None:
    kw = {"max_len": 20, "buffer_len": 4, "factor": 1.0}
    assert overlong_penalty(10, **kw) == 0.0
    assert overlong_penalty(16, **kw) == 0.0
    assert overlong_penalty(17, **kw) == pytest.approx(-0.25)
    assert overlong_penalty(19, **kw) == pytest.approx(-0.75)
    assert overlong_penalty(20, **kw) == pytest.approx(-1.0)
    assert overlong_penalty(21, **kw) == -1.0
    assert overlong_penalty(18, max_len=20, buffer_len=4, factor=0.5) == pytest.approx(-0.25)
    assert overlong_penalty(20, max_len=20, buffer_len=0, factor=1.0) == 0.0
    assert overlong_penalty(21, max_len=20, buffer_len=0, factor=1.0) == -1.0


def test_should_drop_group() -> None:
    assert should_drop_group([1.0, 1.0, 1.0])
    assert should_drop_group([0.0, 0.0])
    assert not should_drop_group([0.0, 1.0, 0.0])
    assert should_drop_group([0.5, 0.5000001], tol=1e-3)
    assert should_drop_group([])


def test_tis_weights_cap() -> None:
    old = torch.log(torch.tensor([0.5, 0.5, 0.9]))
    rollout = torch.log(torch.tensor([0.5, 0.1, 0.3]))
    w = tis_weights(old, rollout, cap=2.0)
    assert w.tolist() == pytest.approx([1.0, 2.0, 2.0])  # ratios 1, 5 -> 2, 3 -> 2
    assert tis_weights(old, rollout, cap=10.0).tolist() == pytest.approx([1.0, 5.0, 3.0])


def _loss(ratio: float, adv: float, **kw: float) -> tuple[float, float, float]:
    lp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    out = policy_loss(
        lp,
        torch.zeros(1, 1),
        torch.tensor([adv]),
        torch.ones(1, 1, dtype=torch.bool),
        clip_low=kw.get("clip_low", 0.2),
        clip_high=kw.get("clip_high", 0.28),
    )
    out.loss.backward()
    assert lp.grad is not None
    return float(out.loss.detach()), float(lp.grad), out.clip_frac


def test_clip_higher_by_hand() -> None:
    # positive advantage: clipped at 1 + 0.28 -> loss -1.28, no gradient
    loss, grad, frac = _loss(1.5, 1.0)
    assert loss == pytest.approx(-1.28) and grad == 0.0 and frac == 1.0
    # inside the trust region: loss -A*r, d/dlogp = -A*r
    loss, grad, frac = _loss(1.1, 1.0)
    assert loss == pytest.approx(-1.1) and grad == pytest.approx(-1.1) and frac == 0.0
    # negative advantage, ratio below 1 - 0.2 -> clipped at 0.8
    loss, grad, frac = _loss(0.5, -1.0)
    assert loss == pytest.approx(0.8) and grad == 0.0 and frac == 1.0
    # negative advantage, large ratio: unclipped branch is the max (pessimistic)
    loss, grad, _ = _loss(2.0, -1.0)
    assert loss == pytest.approx(2.0) and grad == pytest.approx(2.0)
    # the asymmetry: 1.25 is inside clip-higher's range but outside a symmetric 0.2 clip
    assert _loss(1.25, 1.0)[1] != 0.0
    assert _loss(1.25, 1.0, clip_high=0.2)[1] == 0.0


def test_token_mean_and_weights() -> None:
    lp = torch.zeros(2, 3)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    adv = torch.tensor([1.0, -2.0])
    out = policy_loss(lp, lp, adv, mask, clip_low=0.2, clip_high=0.28)
    # ratio 1: per token -A -> (-1 -1 +2) / 3 tokens
    assert float(out.loss) == pytest.approx(0.0) and out.tokens == 3
    w = torch.tensor([[2.0, 1.0, 9.0], [0.5, 9.0, 9.0]])
    out = policy_loss(lp, lp, adv, mask, clip_low=0.2, clip_high=0.28, weights=w)
    assert float(out.loss) == pytest.approx((-2.0 - 1.0 + 1.0) / 3)
    out = policy_loss(lp, lp, adv, mask, clip_low=0.2, clip_high=0.28, num_tokens=6)
    assert float(out.loss) == pytest.approx(0.0)
    out = policy_loss(
        lp, lp, torch.tensor([1.0, 1.0]), mask, clip_low=0.2, clip_high=0.28, num_tokens=6
    )
    assert float(out.loss) == pytest.approx(-3 / 6)


def test_micro_batch_accumulation_equals_full_batch() -> None:
    torch.manual_seed(0)
    base = torch.randn(4, 5)
    old = base + 0.1 * torch.randn(4, 5)
    adv = torch.randn(4)
    mask = torch.rand(4, 5) > 0.3
    full = base.clone().requires_grad_(True)
    policy_loss(full, old, adv, mask, clip_low=0.2, clip_high=0.28).loss.backward()
    parts = base.clone().requires_grad_(True)
    n = int(mask.sum())
    for idx in ([0, 1], [2, 3]):
        policy_loss(
            parts[idx], old[idx], adv[idx], mask[idx], clip_low=0.2, clip_high=0.28, num_tokens=n
        ).loss.backward()
    assert full.grad is not None and parts.grad is not None
    assert torch.allclose(full.grad, parts.grad, atol=1e-7)
