"""Returns, advantages and losses (rl/): values a reader can check by hand, and masking
invariants."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from earl_megatron.rl.advantages import (grpo_advantage, group_means, kl_penalized_reward,
                                         moment_sums, moments_from, normalize,
                                         squared_deviations, tis_weighted, token_returns,
                                         off_policy_weights, turn_ids, turn_returns)
from earl_megatron.rl.losses import (PolicyLossConfig, clipped_surrogate, k1_kl, k3_kl,
                                     masked_sums, policy_loss, ratio_sums)

# two turns: tokens 1-2 (reward 0.5 at 2) and 4-5 (reward 1 at 5); 0, 3 are env tokens
MASK = torch.tensor([0., 1., 1., 0., 1., 1.])
REWARDS = torch.tensor([0., 0., .5, 0., 0., 1.])
KL = torch.tensor([0., .1, .2, 0., .3, .4])


def local_moments(values, group_ids, num_groups, *, unbiased):
    """One process's statistics from the same pieces runtime/reduce.global_moments all-reduces
    (the trainer's own path is tested in tests/unit/test_scoring.py)."""
    sums = moment_sums(values, group_ids, num_groups)
    return moments_from(sums, squared_deviations(values, group_ids, group_means(sums)),
                        unbiased=unbiased)


def test_turn_returns_credit_each_turn_and_discount_per_turn():
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 0], dtype=torch.float32)
    rew = torch.tensor([0, 0, 0.1, 0, 0, -1.0, 0])
    assert turn_ids(mask).tolist() == [-1, 0, 0, -1, 1, 1, -1]
    assert turn_returns(rew, mask, 1.0).tolist() == pytest.approx([0, -0.9, -0.9, 0, -1, -1, 0])
    assert turn_returns(rew, mask, 0.5).tolist() == pytest.approx(
        [0, 0.1 - 0.5, 0.1 - 0.5, 0, -1, -1, 0])
    # one final reward and gamma = 1: the plain episode reward on every policy token
    final = torch.tensor([0, 0, 0, 0, 0, 2.0, 0])
    assert turn_returns(final, mask, 1.0).tolist() == [0, 2, 2, 0, 2, 2, 0]
    assert turn_returns(torch.zeros(3), torch.zeros(3)).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="gamma"):
        turn_returns(rew, mask, 1.5)


def test_no_kl_is_the_turn_return():
    assert torch.equal(token_returns(REWARDS, MASK, 1.0), turn_returns(REWARDS, MASK, 1.0))
    # gamma = 1 reverse cumulative sum == turn returns when kl = 0
    zero = token_returns(REWARDS, MASK, 1.0, torch.zeros(6), 0.5)
    assert torch.allclose(zero, turn_returns(REWARDS, MASK, 1.0))


def test_gamma_one_pays_own_and_later_kl_per_token():
    got = token_returns(REWARDS, MASK, 1.0, KL, 0.5)
    want = torch.tensor([0., 1.5 - .5 * 1.0, 1.5 - .5 * .9, 0., 1. - .5 * .7, 1. - .5 * .4])
    assert torch.allclose(got, want)


def test_gamma_below_one_puts_each_turns_kl_in_its_reward():
    got = token_returns(REWARDS, MASK, 0.5, KL, 0.5)
    turn2 = 1. - .5 * (.3 + .4)
    turn1 = .5 - .5 * (.1 + .2) + .5 * turn2
    assert torch.allclose(got, torch.tensor([0., turn1, turn1, 0., turn2, turn2]))


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
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 1, 1, 0, 0]], dtype=torch.float32)
    returns = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, -1, -1, 0, 0]], dtype=torch.float32)
    vals = returns[mask > 0]
    m = local_moments(vals, torch.zeros(vals.numel(), dtype=torch.long), 1, unbiased=False)
    assert m.count.item() == 5 and m.mean.item() == pytest.approx(0.2)
    a = torch.stack([normalize(returns[i], mask[i], m) for i in range(2)])
    assert a[mask > 0].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert a[mask > 0].std(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)
    assert torch.all(a[mask == 0] == 0)


def test_split_statistics_equal_whole():
    # what runtime/reduce.py does across ranks: sums add, then deviations about the global mean
    g = torch.Generator().manual_seed(0)
    vals = torch.randn(40, generator=g, dtype=torch.float64) + 100.0
    groups = torch.randint(0, 3, (40,), generator=g)
    whole = local_moments(vals, groups, 3, unbiased=True)
    parts = [slice(0, 7), slice(7, 30), slice(30, 40)]
    sums = sum(moment_sums(vals[p], groups[p], 3) for p in parts)
    mean = sums[0] / sums[1]
    sq = sum(squared_deviations(vals[p], groups[p], mean) for p in parts)
    split = moments_from(sums, sq, unbiased=True)
    for gi in range(3):
        sel = vals[groups == gi]
        assert split.mean[gi].item() == pytest.approx(sel.mean().item(), rel=1e-14)
        assert split.std[gi].item() == pytest.approx(sel.std().item(), rel=1e-12)
        assert split.count[gi].item() == sel.numel()
    assert torch.allclose(whole.std, split.std, rtol=1e-12)


def test_grpo_by_hand():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    m = local_moments(r, groups, 2, unbiased=True)
    assert m.count.tolist() == [2, 2] and m.mean.tolist() == [0.5, 1.0]
    mask = torch.ones(2)
    std0 = math.sqrt(0.5)  # unbiased std of {1, 0}
    assert grpo_advantage(1.0, 0, mask, m)[0].item() == pytest.approx(0.5 / std0, rel=1e-5)
    assert grpo_advantage(0.0, 0, mask, m)[1].item() == pytest.approx(-0.5 / std0, rel=1e-5)
    assert torch.all(grpo_advantage(1.0, 1, mask, m) == 0)  # identical rewards: no signal
    assert grpo_advantage(1.0, 0, mask, m, scale=False)[0].item() == pytest.approx(0.5)
    # a singleton group has std 0, not nan
    assert local_moments(r[:1], groups[:1], 1, unbiased=True).std.item() == 0.0


def test_k3_kl_nonnegative_and_zero_at_equality():
    lp = torch.linspace(-5, -0.1, 20)
    assert torch.all(k3_kl(lp, lp) == 0)
    assert torch.all(k3_kl(lp, lp - 0.3) > 0)


def test_on_policy_surrogate_gradient_is_reinforce():
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss = clipped_surrogate(logp, logp.detach(), adv, PolicyLossConfig())
    loss.sum().backward()
    assert torch.allclose(logp.grad, -adv)
    assert ratio_sums(logp, logp.detach(), torch.ones(3), PolicyLossConfig()).tolist() == \
        [3.0, 0.0, 3.0]


def test_clipping_stops_gradient_beyond_trust_region():
    old = torch.tensor([-1.0])
    logp = torch.tensor([-1.0 + math.log(1.5)], requires_grad=True)  # ratio 1.5 > 1.2
    loss = clipped_surrogate(logp, old, torch.tensor([1.0]), PolicyLossConfig())
    loss.sum().backward()
    assert logp.grad.item() == 0.0
    assert loss.item() == pytest.approx(-1.2)


def test_clip_fraction_counts_ratios_outside_the_range_whatever_the_sign_of_a():
    # ratios 0.5, 0.9, 1.0, 1.3, 2.0 on policy tokens, one more (3.0) off them; eps 0.2 / 0.25
    old = torch.zeros(6, dtype=torch.float64)
    logp = torch.log(torch.tensor([0.5, 0.9, 1.0, 1.3, 2.0, 3.0], dtype=torch.float64))
    mask = torch.tensor([1., 1., 1., 1., 1., 0.])
    got = ratio_sums(logp, old, mask, PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.25))
    assert got.tolist() == pytest.approx([5.7, 3.0, 5.0])  # 0.5, 1.3 and 2.0 left [0.8, 1.25]
    assert masked_sums(torch.arange(6.0), mask).tolist() == [10.0, 5.0]


def test_kl_estimators_and_kl_in_grpo_reward():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert k1_kl(lp, ref).tolist() == [0.5, -1.0]
    assert kl_penalized_reward(1.0, k1_kl(lp, ref), 0.1) == pytest.approx(1.05)
    assert kl_penalized_reward(1.0, None, 0.1) == 1.0 == kl_penalized_reward(1.0, lp, 0.0)


def test_tis_weighted_pads_with_one():
    adv = torch.tensor([1.0, -2.0, 3.0, 0.0])
    assert tis_weighted(adv, torch.tensor([0.5, 2.0], dtype=torch.float64)).tolist() == \
        [0.5, -4.0, 3.0, 0.0]


def test_off_policy_weights_by_hand():
    old = torch.log(torch.tensor([0.5, 0.2, 0.9, 0.3, 0.6]))
    rollout = torch.log(torch.tensor([0.5, 0.4, 0.3, 0.3, 0.1]))
    mask = torch.tensor([0., 1., 1., 0., 1.])
    w, cut = off_policy_weights(old, rollout, mask, cap=2.0, mode="tis")
    # 0.2/0.4 = 0.5; 0.9/0.3 = 3 -> 2; off-mask 1; 0.6/0.1 = 6 -> 2
    assert w.tolist() == pytest.approx([1.0, 0.5, 2.0, 1.0, 2.0])
    assert cut == 2
    # decoupled PPO drops the tokens past the cap instead (AReaL's behaviour weight mask)
    w, cut = off_policy_weights(old, rollout, mask, cap=2.0, mode="decoupled")
    assert w.tolist() == pytest.approx([1.0, 0.5, 0.0, 1.0, 0.0])
    assert cut == 2
    with pytest.raises(ValueError, match="cap must be > 0"):
        off_policy_weights(old, rollout, mask, cap=0.0)
    with pytest.raises(ValueError, match="mode 'both'"):
        off_policy_weights(old, rollout, mask, cap=2.0, mode="both")


@pytest.mark.parametrize("ratio_cap", [None, 3.0])
def test_tis_weighted_advantages_are_the_weighted_surrogate(ratio_cap):
    # A * w in place of A trains w * surrogate, token by token, through clipping and dual clip
    torch.manual_seed(0)
    logp = torch.randn(64, dtype=torch.float64, requires_grad=True)
    old = (logp.detach() + 0.8 * torch.randn(64, dtype=torch.float64))
    adv = torch.randn(64, dtype=torch.float64) * 2
    w = torch.rand(64, dtype=torch.float64) * 2 + 0.01
    cfg = PolicyLossConfig(ratio_cap=ratio_cap)
    folded = clipped_surrogate(logp, old, adv * w, cfg)
    weighted = w * clipped_surrogate(logp, old, adv, cfg)
    assert torch.allclose(folded, weighted, rtol=1e-12, atol=1e-12)
    g1, = torch.autograd.grad(folded.sum(), logp)
    g2, = torch.autograd.grad(weighted.sum(), logp)
    assert torch.allclose(g1, g2, rtol=1e-12, atol=1e-12)


def test_policy_loss_requires_ref_for_kl():
    lp = torch.zeros(2)
    with pytest.raises(ValueError, match="reference logprobs"):
        policy_loss(lp, lp, lp, PolicyLossConfig(kl_coef=0.1))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.integers(0, 10_000))
def test_advantages_zero_off_mask_and_mean_zero(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, t, generator=g) > 0.5).float()
    r = torch.randn(b, generator=g)
    rew = torch.zeros(b, t)
    rew[:, -1] = r
    returns = torch.stack([token_returns(rew[i], mask[i], 1.0) for i in range(b)])
    vals = returns[mask > 0]
    m = local_moments(vals, torch.zeros(vals.numel(), dtype=torch.long), 1, unbiased=False)
    a = torch.stack([normalize(returns[i], mask[i], m) for i in range(b)])
    assert torch.all(a[mask == 0] == 0)
    if vals.numel():
        assert abs(a[mask > 0].mean().item()) < 1e-5
    gm = local_moments(r, torch.zeros(b, dtype=torch.long), 1, unbiased=True)
    ga = torch.stack([grpo_advantage(r[i].item(), 0, torch.ones(1), gm) for i in range(b)])
    assert abs(ga.mean().item()) < 1e-5
    assert torch.all(grpo_advantage(r[0].item(), 0, mask[0], gm)[mask[0] == 0] == 0)
