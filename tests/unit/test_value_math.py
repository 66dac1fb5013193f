"""PPO's critic math (rl/value.py): GAE over agent turns against numbers worked out by hand, the
clipped value loss, its clip fraction and explained variance against hand values, bad input."""

import math

import pytest
import torch

from earl_megatron.rl.advantages import (group_means, moment_sums, moments_from,
                                         squared_deviations, turn_returns)
from earl_megatron.rl.value import (explained_variance, explained_variance_inputs, gae,
                                    value_clip_sums, value_loss)

# A label-aligned row: position 0 the prompt, 1-2 turn 1 (reward 0.5 on its last token), 3-4 the
# tool's answer (masked), 5-6 turn 2 (reward 1 on its last token), 7 padding. Values on masked
# positions are junk (9, 7) that must change nothing.
MASK = torch.tensor([0., 1., 1., 0., 0., 1., 1., 0.])
REWARDS = torch.tensor([0., 0., .5, 0., 0., 0., 1., 0.])
VALUES = torch.tensor([9., .2, .4, 7., 7., .3, .6, 9.])


def test_gae_by_hand_over_two_turns_and_a_tool_answer():
    # gamma = 0.9, lam = 0.8 (gamma * lam = 0.72), policy tokens 1, 2, 5, 6 in order; the next
    # value of token 2 (turn 1's end) is token 5's (turn 2's first), past the tool's answer:
    # 6: delta = 1   + 0.9 * 0   - 0.6 = 0.4    A = 0.4                    R = 1.0
    # 5: delta = 0   + 0.9 * 0.6 - 0.3 = 0.24   A = 0.24 + 0.72 * 0.4      = 0.528     R = 0.828
    # 2: delta = 0.5 + 0.9 * 0.3 - 0.4 = 0.37   A = 0.37 + 0.72 * 0.528    = 0.75016   R = 1.15016
    # 1: delta = 0   + 0.9 * 0.4 - 0.2 = 0.16   A = 0.16 + 0.72 * 0.75016  = 0.7001152 R = 0.9001152
    adv, ret = gae(REWARDS, VALUES, MASK, 0.9, 0.8)
    assert adv.dtype == ret.dtype == torch.float32
    assert adv.tolist() == pytest.approx([0, .7001152, .75016, 0, 0, .528, .4, 0], abs=1e-6)
    assert ret.tolist() == pytest.approx([0, .9001152, 1.15016, 0, 0, .828, 1., 0], abs=1e-6)
    # masked positions: their values and rewards change nothing, outputs stay exactly 0
    junk_v, junk_r = VALUES.clone(), REWARDS.clone()
    junk_v[[0, 3, 4, 7]] = torch.tensor([-5., 100., -3., 2.])
    junk_r[[3, 7]] = torch.tensor([4., -2.])
    adv2, ret2 = gae(junk_r, junk_v, MASK, 0.9, 0.8)
    assert torch.equal(adv2, adv) and torch.equal(ret2, ret)
    assert (adv[MASK == 0] == 0).all() and (ret[MASK == 0] == 0).all()


def test_gae_limits_gamma_lam_one_lam_one_lam_zero():
    # gamma = lam = 1: A = G - V with G the plain return to the end, [0, 1.5, 1.5, 0, 0, 1, 1, 0]
    g = torch.tensor([0., 1.5, 1.5, 0., 0., 1., 1., 0.])
    adv, ret = gae(REWARDS, VALUES, MASK, 1.0, 1.0)
    assert adv.tolist() == pytest.approx(((g - VALUES) * MASK).tolist(), abs=1e-6)
    assert torch.allclose(ret, turn_returns(REWARDS, MASK, 1.0))     # the per-turn returns
    # lam = 1: R is the discounted Monte-Carlo return, one discount per POLICY token, whatever
    # the values: token 1 sees 0.5 one step and 1 three steps later
    _, ret = gae(REWARDS, VALUES, MASK, 0.9, 1.0)
    _, ret_zero_v = gae(REWARDS, torch.zeros(8), MASK, 0.9, 1.0)
    assert ret.tolist() == pytest.approx([0, .9 * .5 + .9 ** 3, .5 + .9 ** 2, 0, 0, .9, 1., 0],
                                         abs=1e-6)
    assert torch.allclose(ret, ret_zero_v)
    # lam = 0: the one-step TD error
    adv, _ = gae(REWARDS, VALUES, MASK, 0.9, 0.0)
    assert adv.tolist() == pytest.approx([0, .16, .37, 0, 0, .24, .4, 0], abs=1e-6)
    # no policy token: zeros
    adv, ret = gae(REWARDS, VALUES, torch.zeros(8), 0.9, 0.8)
    assert not adv.any() and not ret.any()


def test_gae_bad_input():
    with pytest.raises(ValueError, match=r"gamma=1.5 must be in \[0, 1\]"):
        gae(REWARDS, VALUES, MASK, 1.5, 0.8)
    with pytest.raises(ValueError, match=r"lam=-0.1 must be in \[0, 1\]"):
        gae(REWARDS, VALUES, MASK, 0.9, -0.1)
    with pytest.raises(ValueError, match="one shape"):
        gae(REWARDS, VALUES[:7], MASK, 0.9, 0.8)
    with pytest.raises(ValueError, match="call it per sample"):
        gae(REWARDS.expand(2, 8), VALUES.expand(2, 8), MASK.expand(2, 8), 0.9, 0.8)


def test_value_loss_and_clipping_by_hand():
    # clip 0.1; position 0 masked (a huge error there counts for nothing)
    # 1: V 1.0, old 0.8, R 0: unclipped 1.0^2 = 1, clipped (0.9 - 0)^2 = 0.81 -> 0.5 * 1 = 0.5
    # 2: V 0.5 = old, R 1: both 0.25 -> 0.125 (a tie: the clip decided nothing)
    # 3: V 1.0, old 0, R 1: unclipped 0, clipped (0.1 - 1)^2 = 0.81 -> 0.405, the clip decides
    v = torch.tensor([5., 1., .5, 1.], requires_grad=True)
    old = torch.tensor([0., .8, .5, 0.])
    ret = torch.tensor([0., 0., 1., 1.])
    mask = torch.tensor([0., 1., 1., 1.])
    loss = value_loss(v, old, ret, mask, 0.1)
    assert loss.tolist() == pytest.approx([0, .5, .125, .405], abs=1e-6)
    loss.sum().backward()
    # d/dV 0.5 (V - R)^2 = V - R where the unclipped term wins; 0 where the clip decided
    assert v.grad.tolist() == pytest.approx([0, 1., -.5, 0.], abs=1e-6)
    assert value_clip_sums(v, old, ret, mask, 0.1).tolist() == [1.0, 3.0]
    # no clip: 0.5 (V - R)^2, nothing clipped
    assert value_loss(v, old, ret, mask, None).tolist() == pytest.approx([0, .5, .125, 0.])
    assert value_clip_sums(v, old, ret, mask, None).tolist() == [0.0, 3.0]
    with pytest.raises(ValueError, match="value clip 0 must be > 0"):
        value_loss(v, old, ret, mask, 0)
    with pytest.raises(ValueError, match="one shape"):
        value_loss(v, old[:3], ret, mask, 0.1)


def _explained_variance(values, returns, mask, shares=1):
    """EV from ``shares`` ranks' pieces of the row, their sums added as runtime/reduce's
    all-reduces add them (two passes: sums, then squared deviations about the global means)."""
    pieces = [explained_variance_inputs(v, r, m) for v, r, m in
              zip(values.chunk(shares), returns.chunk(shares), mask.chunk(shares))]
    sums = sum(moment_sums(x, ids, 2) for x, ids in pieces)
    sq = sum(squared_deviations(x, ids, group_means(sums)) for x, ids in pieces)
    return explained_variance(moments_from(sums, sq, unbiased=False))


def test_explained_variance_known_cases():
    ret = torch.tensor([1., 2., 0., 3., 4.])
    mask = torch.tensor([1., 1., 0., 1., 1.])          # position 2 masked: its value is junk
    junk = torch.tensor([0., 0., 50., 0., 0.])
    assert _explained_variance(ret + junk, ret, mask) == pytest.approx(1.0)      # perfect
    assert _explained_variance(torch.full((5,), 2.5) + junk, ret, mask) == pytest.approx(0.0)
    # V = R / 2: residuals R / 2, a quarter of the variance left -> 0.75
    assert _explained_variance(ret / 2 + junk, ret, mask) == pytest.approx(0.75)
    # split over two "ranks" (3 + 2 positions), the sums added: the same number
    assert _explained_variance(ret / 2 + junk, ret, mask, shares=2) == pytest.approx(0.75)
    # V = 0: Var(R - 0) = Var(R) -> 0 as well; V = -R, worse than the mean: 1 - 4 Var / Var
    assert _explained_variance(junk, ret, mask) == pytest.approx(0.0)
    assert _explained_variance(-ret, ret, mask) == pytest.approx(1 - 4.0)
    # constant returns: nothing to explain
    assert math.isnan(_explained_variance(ret, torch.ones(5), mask))
