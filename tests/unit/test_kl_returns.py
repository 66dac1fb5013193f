"""KL in the reward (trainer/loop.returns_with_kl): the k1 penalty enters the returns per token
for gamma = 1 and per turn for gamma < 1, and vanishes without KL."""

import torch

from earl_megatron.rl.advantages import turn_returns
from earl_megatron.trainer.loop import returns_with_kl

# two turns: tokens 1-2 (reward 0.5 at 2) and 4-5 (reward 1 at 5); 0, 3 are env tokens
MASK = torch.tensor([0., 1., 1., 0., 1., 1.])
REWARDS = torch.tensor([0., 0., .5, 0., 0., 1.])
KL = torch.tensor([0., .1, .2, 0., .3, .4])


def test_no_kl_is_the_turn_return():
    assert torch.equal(returns_with_kl(REWARDS, MASK, 1.0),
                       turn_returns(REWARDS[None], MASK[None], 1.0)[0])
    # gamma = 1 reverse cumulative sum == turn returns when kl = 0
    zero = returns_with_kl(REWARDS, MASK, 1.0, torch.zeros(6), 0.5)
    assert torch.allclose(zero, turn_returns(REWARDS[None], MASK[None], 1.0)[0])


def test_gamma_one_pays_own_and_later_kl_per_token():
    got = returns_with_kl(REWARDS, MASK, 1.0, KL, 0.5)
    want = torch.tensor([0., 1.5 - .5 * 1.0, 1.5 - .5 * .9, 0., 1. - .5 * .7, 1. - .5 * .4])
    assert torch.allclose(got, want)


def test_gamma_below_one_puts_each_turns_kl_in_its_reward():
    got = returns_with_kl(REWARDS, MASK, 0.5, KL, 0.5)
    turn2 = 1. - .5 * (.3 + .4)
    turn1 = .5 - .5 * (.1 + .2) + .5 * turn2
    assert torch.allclose(got, torch.tensor([0., turn1, turn1, 0., turn2, turn2]))
