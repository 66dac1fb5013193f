"""``trainer/scoring.advantages``, the function every iteration calls, against values computed by
hand: REINFORCE++ (per-turn returns, batch-normalised over policy tokens; gamma 1 and 0.5; KL
in the reward per token) and GRPO (group-normalised episode rewards; KL in the reward as a
sequence penalty). One process, a real gloo world of 1, so the all-reduces run as they do in
the trainer."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.trainer.data import episode_tensors
from earl_megatron.trainer.scoring import AdvantageConfig, advantages, kl_to_reference


@pytest.fixture
def owner(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        # advantages reads only whether this rank owns its replica's samples (coords)
        yield SimpleNamespace(coords=ParallelLayout(dp=1).coords(0))
    finally:
        dist.destroy_process_group()


def _episodes(kl: bool):
    """Two episodes, label-aligned masks [0 1 1 0 1 0] (turns at 1-2 and 4, rewards 0.5 + 0.5)
    and [0 0 1 1 0 0] (one turn, reward 0); with ``kl`` their k1 on the policy tokens is
    [0.2 0.4 1.0] and [0 0]."""
    ref0 = torch.tensor([0.0, -1.2, -1.4, 0.0, -2.0, 0.0]) if kl else None
    ref1 = torch.tensor([0.0, 0.0, -1.0, -1.0, 0.0, 0.0]) if kl else None
    return {
        0: episode_tensors(range(7), [0, 0, 1, 1, 0, 1, 0], [0, 0, -1, -1, 0, -1, 0], 1.0, 6,
                           turn_rewards=(0.5, 0.5), ref_logprobs=ref0),
        1: episode_tensors(range(7), [0, 0, 0, 1, 1, 0, 0], [0, 0, 0, -1, -1, 0, 0], 0.0, 6,
                           ref_logprobs=ref1),
    }


def _on_policy(adv, samples):
    return {s: adv[s][samples[s].loss_mask.bool()].tolist() for s in adv}


def _check(adv, samples, want):
    got = _on_policy(adv, samples)
    for s, values in want.items():
        assert got[s] == pytest.approx(values, abs=1e-5), (s, got[s], values)
        assert torch.all(adv[s][samples[s].loss_mask == 0] == 0)


def test_reinforce_pp_gamma_1(owner):
    samples = _episodes(kl=False)
    adv = advantages(AdvantageConfig("reinforce_pp"), owner, [0, 1], samples, 2)
    # returns on policy tokens: turn 1 gets 0.5 + 0.5, turn 2 gets 0.5; episode 1 gets 0
    # values [1, 1, .5, 0, 0]: mean .5, population std sqrt(.2)
    std = math.sqrt(0.2)
    _check(adv, samples, {0: [0.5 / std, 0.5 / std, 0.0], 1: [-0.5 / std, -0.5 / std]})


def test_reinforce_pp_gamma_half(owner):
    samples = _episodes(kl=False)
    adv = advantages(AdvantageConfig("reinforce_pp", gamma=0.5), owner, [0, 1], samples, 2)
    # turn 1: .5 + .5 * .5 = .75, turn 2: .5; values [.75, .75, .5, 0, 0], mean .4
    std = math.sqrt((2 * 0.35 ** 2 + 0.1 ** 2 + 2 * 0.4 ** 2) / 5)
    _check(adv, samples, {0: [0.35 / std, 0.35 / std, 0.1 / std], 1: [-0.4 / std] * 2})


def test_reinforce_pp_kl_in_reward(owner):
    samples = _episodes(kl=True)
    kl, metrics = kl_to_reference(owner, [0, 1], samples, "k1")
    assert _on_policy(kl, samples) == {0: pytest.approx([0.2, 0.4, 1.0]), 1: [0.0, 0.0]}
    assert metrics["kl"] == pytest.approx(1.6 / 5) and metrics["ref_log_ratio_max"] == 1.0
    adv = advantages(AdvantageConfig("reinforce_pp", kl_coef=0.1), owner, [0, 1], samples, 2,
                     kl=kl)
    # per-token rewards -.02, .5 - .04, .5 - .1; gamma 1: each token its own and every later
    # token's: .84, .86, .4; episode 1: 0, 0. Mean 2.1 / 5 = .42
    std = math.sqrt((0.42 ** 2 + 0.44 ** 2 + 0.02 ** 2 + 2 * 0.42 ** 2) / 5)
    _check(adv, samples, {0: [0.42 / std, 0.44 / std, -0.02 / std], 1: [-0.42 / std] * 2})
    # the coefficient is read: without it the KL changes nothing
    plain = advantages(AdvantageConfig("reinforce_pp"), owner, [0, 1], samples, 2, kl=kl)
    _check(plain, samples, {0: [0.5 / math.sqrt(0.2)] * 2 + [0.0]})


def test_grpo(owner):
    samples = {s: episode_tensors(range(4), [0, 1, 1, 0], [0.0] * 4, r, 3)
               for s, r in enumerate([1.0, 0.0, 1.0, 1.0])}
    adv = advantages(AdvantageConfig("grpo", group_size=2), owner, [0, 1, 2, 3], samples, 4)
    # group {1, 0}: mean .5, unbiased std sqrt(.5); group {1, 1}: no signal
    a = 0.5 / math.sqrt(0.5)
    _check(adv, samples, {0: [a, a], 1: [-a, -a], 2: [0.0, 0.0], 3: [0.0, 0.0]})


def test_grpo_kl_in_reward(owner):
    base = _episodes(kl=True)
    third = episode_tensors(range(7), [0, 1, 1, 0, 0, 0, 0], [0, -1, -1, 0, 0, 0, 0], 0.5, 6,
                            ref_logprobs=torch.tensor([-1.0, -1.0, 0, 0, 0, 0]))
    samples = {0: base[0], 1: base[1], 2: third}
    kl, _ = kl_to_reference(owner, [0, 1, 2], samples, "k1")
    adv = advantages(AdvantageConfig("grpo", group_size=3, kl_coef=0.1), owner, [0, 1, 2],
                     samples, 3, kl=kl)
    # summed k1: 1.6, 0, 0 -> rewards 1 - .16, 0, .5; mean 1.34 / 3; unbiased std
    r = [0.84, 0.0, 0.5]
    mean = sum(r) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / 2)
    _check(adv, samples, {0: [(r[0] - mean) / std] * 3, 1: [(r[1] - mean) / std] * 2,
                          2: [(r[2] - mean) / std] * 2})
