"""Advantages and losses: values a reader can check by hand, and masking invariants."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from earl_megatron.rl.advantages import (TokenStats, batch_statistics, group_statistics,
                                         grpo_advantages, last_policy_token, normalize,
                                         reinforce_pp_advantages, reinforce_pp_returns,
                                         turn_ids, turn_returns)
from earl_megatron.rl.losses import PolicyLossConfig, clipped_surrogate, k3_kl, policy_loss

MASK = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 1, 1, 0, 0]], dtype=torch.float32)


def test_last_policy_token():
    assert last_policy_token(MASK).tolist() == [[0, 0, 0, 0, 1, 0], [0, 0, 0, 1, 0, 0]]
    assert last_policy_token(torch.zeros(1, 3)).sum() == 0


def test_reinforce_returns_and_kl_in_reward():
    r = torch.tensor([1.0, -1.0])
    assert reinforce_pp_returns(r, MASK).tolist() == [[0, 1, 1, 0, 1, 0], [0, 0, -1, -1, 0, 0]]
    kl = torch.full_like(MASK, 0.5)
    g = reinforce_pp_returns(r, MASK, kl, kl_coef=0.1)
    # row 0: tokens 1,2,4 each pay 0.05; G_1 = 1 - 3*0.05
    assert g[0, 1].item() == pytest.approx(1 - 0.15)
    assert g[0, 4].item() == pytest.approx(1 - 0.05)
    assert g[0, 0].item() == 0.0  # prompt token


def test_turn_returns_credit_each_turn_and_discount_per_turn():
    # two turns (tokens 1-2 and 4-5), env tokens between; rewards on each turn's last token
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0]], dtype=torch.float32)
    rew = torch.tensor([[0, 0, 0.1, 0, 0, -1.0, 0]])
    assert turn_ids(mask).tolist() == [[-1, 0, 0, -1, 1, 1, -1]]
    g1 = turn_returns(rew, mask, 1.0)[0].tolist()
    assert g1 == pytest.approx([0, -0.9, -0.9, 0, -1, -1, 0])
    g = turn_returns(rew, mask, 0.5)[0].tolist()
    assert g == pytest.approx([0, 0.1 - 0.5, 0.1 - 0.5, 0, -1, -1, 0])
    # one final reward and gamma = 1 is the plain REINFORCE++ return
    r = torch.tensor([1.0, -1.0])
    assert torch.equal(turn_returns(r[:, None] * last_policy_token(MASK), MASK, 1.0),
                       reinforce_pp_returns(r, MASK))
    with pytest.raises(ValueError, match="gamma"):
        turn_returns(rew, mask, 1.5)


def test_episode_tensors_put_turn_rewards_on_turn_ends():
    from earl_megatron.trainer.data import episode_tensors

    ids, mask = [5, 6, 7, 8, 9, 10], [0, 1, 0, 1, 1, 0]
    t = episode_tensors(ids, mask, [0.0] * 6, reward=0.6, length=8, turn_rewards=(0.1, 0.5))
    # label-aligned: token j's reward sits at j - 1
    assert t.token_rewards.tolist() == pytest.approx([0.1, 0, 0, 0.5, 0, 0, 0, 0])
    whole = episode_tensors(ids, mask, [0.0] * 6, reward=0.6, length=8)
    assert whole.token_rewards.tolist() == pytest.approx([0, 0, 0, 0.6, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="one reward per turn"):
        episode_tensors(ids, mask, [0.0] * 6, reward=0.6, length=8, turn_rewards=(0.6,))
    with pytest.raises(ValueError, match="add up"):
        episode_tensors(ids, mask, [0.0] * 6, reward=0.6, length=8, turn_rewards=(0.1, 0.1))


def test_reinforce_advantages_normalised_over_policy_tokens():
    r = torch.tensor([1.0, -1.0])
    a = reinforce_pp_advantages(r, MASK)
    vals = a[MASK > 0]
    assert vals.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert vals.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)
    assert torch.all(a[MASK == 0] == 0)


def test_split_statistics_equal_whole():
    g = torch.Generator().manual_seed(0)
    vals = torch.randn(8, 10, generator=g)
    mask = (torch.rand(8, 10, generator=g) > 0.5).float()
    whole = batch_statistics(vals, mask)
    parts = [batch_statistics(vals[i:i + 2], mask[i:i + 2]) for i in range(0, 8, 2)]
    summed = TokenStats.from_tensor(sum(p.as_tensor() for p in parts))
    assert torch.allclose(normalize(vals, mask, whole), normalize(vals, mask, summed), atol=1e-6)


def test_grpo_by_hand():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.ones(4, 2)
    a = grpo_advantages(r, mask, groups, 2)
    std0 = math.sqrt(0.5)  # unbiased std of {1, 0}
    assert a[0, 0].item() == pytest.approx(0.5 / std0, rel=1e-5)
    assert a[1, 1].item() == pytest.approx(-0.5 / std0, rel=1e-5)
    assert torch.all(a[2:] == 0)  # identical rewards: no signal
    unscaled = grpo_advantages(r, mask, groups, 2, scale=False)
    assert unscaled[0, 0].item() == pytest.approx(0.5)
    st_ = group_statistics(r, groups, 2)
    assert st_.count.tolist() == [2, 2] and st_.total.tolist() == [1, 2]


def test_k3_kl_nonnegative_and_zero_at_equality():
    lp = torch.linspace(-5, -0.1, 20)
    assert torch.all(k3_kl(lp, lp) == 0)
    assert torch.all(k3_kl(lp, lp - 0.3) > 0)


def test_on_policy_surrogate_gradient_is_reinforce():
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, clipped = clipped_surrogate(logp, logp.detach(), adv, PolicyLossConfig())
    loss.sum().backward()
    assert torch.allclose(logp.grad, -adv)
    assert clipped.sum() == 0


def test_clipping_stops_gradient_beyond_trust_region():
    old = torch.tensor([-1.0])
    logp = torch.tensor([-1.0 + math.log(1.5)], requires_grad=True)  # ratio 1.5 > 1.2
    loss, clipped = clipped_surrogate(logp, old, torch.tensor([1.0]), PolicyLossConfig())
    loss.sum().backward()
    assert clipped.item() == 1.0
    assert logp.grad.item() == 0.0
    assert loss.item() == pytest.approx(-1.2)


def test_policy_loss_requires_ref_for_kl():
    lp = torch.zeros(2)
    with pytest.raises(ValueError, match="reference logprobs"):
        policy_loss(lp, lp, lp, PolicyLossConfig(kl_coef=0.1))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.integers(0, 10_000))
def test_advantages_zero_off_mask(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, t, generator=g) > 0.5).float()
    r = torch.randn(b, generator=g)
    assert torch.all(reinforce_pp_advantages(r, mask)[mask == 0] == 0)
    assert torch.all(grpo_advantages(r, mask, torch.zeros(b, dtype=torch.long), 1)[mask == 0] == 0)
