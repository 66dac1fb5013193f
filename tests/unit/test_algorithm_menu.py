"""The algorithm menu against values computed by hand from the papers' formulas (docs/algorithms.md):
advantage estimators (REINFORCE++-baseline, Dr. GRPO, RLOO), policy losses (PPO-clip with
clip-higher and the dual clip, GSPO and its token variant, CISPO), loss aggregation, KL
estimators and DAPO's overlong shaping and filtering, with the edge cases: a group of equal
rewards, an episode with one policy token, a truncated episode."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from earl_megatron.config.algorithm import AlgorithmConfig
from earl_megatron.config.checks import ConfigError
from earl_megatron.rl.advantages import overlong_penalty
from earl_megatron.rl.losses import (PolicyLossConfig, aggregation_weights, kl_estimate,
                                     policy_loss, ratio_sums, sequence_sums, sequence_terms)
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.trainer.data import episode_tensors
from earl_megatron.trainer.scoring import (AdvantageConfig, advantage_check, advantages,
                                           overlong_filtered, shaped_overlong)


@pytest.fixture(autouse=True)
def _world_of_one(tmp_path):
    """A real gloo world of 1, so the scoring's all-reduces run as in the trainer."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _owner():
    """advantages reads only whether this rank owns its replica's samples (coords)."""
    return SimpleNamespace(coords=ParallelLayout(dp=1).coords(0))


def _samples(rewards, policy_tokens):
    """One sample per reward: a prompt token, then ``policy_tokens[i]`` policy tokens."""
    out = {}
    for s, (r, n) in enumerate(zip(rewards, policy_tokens)):
        ids = list(range(1 + n))
        mask = [0] + [1] * n
        out[s] = episode_tensors(ids, mask, [0.0] * len(ids), r, length=len(ids) - 1)
    return out


def _adv(name, rewards, tokens, group_size, **kw):
    samples = _samples(rewards, tokens)
    cfg = AdvantageConfig(name, group_size=group_size, **kw)
    ids = list(samples)
    adv = advantages(cfg, _owner(), ids, samples, len(ids))
    return adv, samples, cfg


# -- advantage estimators ----------------------------------------------------------------------
def test_rloo_is_the_reward_minus_the_others_mean():
    adv, samples, cfg = _adv("rloo", [1.0, 0.0, 0.0, 1.0, 3.0, 1.0], [2, 1, 3, 2, 1, 1], 3)
    # group 0: rewards 1, 0, 0: 1 - 0 = 1; 0 - 0.5 = -0.5 (twice)
    # group 1: rewards 1, 3, 1: 1 - 2 = -1; 3 - 1 = 2; 1 - 2 = -1
    want = [1.0, -0.5, -0.5, -1.0, 2.0, -1.0]
    for s, w in enumerate(want):
        on = samples[s].loss_mask.bool()
        assert torch.allclose(adv[s][on], torch.full((int(on.sum()),), w)), (s, adv[s])
        assert (adv[s][~on] == 0).all()
    check = advantage_check(cfg, _owner(), list(samples), samples, adv, 6)
    assert check["advantage_group_mean_max"] < 1e-12


def test_dr_grpo_is_r_minus_mean_unscaled():
    adv, samples, _ = _adv("grpo", [1.0, 0.0, 0.0, 0.0], [1, 2, 1, 1], 4, norm_by_std=False)
    assert [adv[s][samples[s].loss_mask.bool()][0].item() for s in range(4)] == \
        pytest.approx([0.75, -0.25, -0.25, -0.25])
    scaled, _, _ = _adv("grpo", [1.0, 0.0, 0.0, 0.0], [1, 2, 1, 1], 4)
    std = math.sqrt((0.75 ** 2 + 3 * 0.25 ** 2) / 3)     # unbiased within the group
    assert scaled[0][0].item() == pytest.approx(0.75 / (std + 1e-6), rel=1e-6)


def test_reinforce_pp_baseline_normalises_group_baselined_rewards_over_tokens():
    adv, samples, cfg = _adv("reinforce_pp_baseline", [1.0, 0.0, 2.0, 2.0], [1, 3, 2, 2], 2)
    # r - mean_g: group 0 -> 0.5, -0.5; group 1 -> 0, 0; on 1, 3, 2, 2 policy tokens
    values = [0.5] * 1 + [-0.5] * 3 + [0.0] * 4
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    want = [(0.5 - mean) / (std + 1e-6), (-0.5 - mean) / (std + 1e-6), (0 - mean) / (std + 1e-6)]
    assert adv[0][0].item() == pytest.approx(want[0], rel=1e-5)
    assert adv[1].tolist() == pytest.approx([want[1]] * 3, rel=1e-5)
    assert adv[2].tolist() == pytest.approx([want[2]] * 2, rel=1e-5)
    assert advantage_check(cfg, _owner(), list(samples), samples, adv, 4)["advantage_mean"] \
        == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("name,kw", [("grpo", {}), ("grpo", {"norm_by_std": False}),
                                     ("rloo", {}), ("reinforce_pp_baseline", {})])
def test_a_group_of_equal_rewards_has_no_signal(name, kw):
    adv, samples, _ = _adv(name, [1.0, 1.0, 1.0, 0.0, 0.0, 0.0], [2, 1, 1, 1, 3, 1], 3, **kw)
    for s in range(6):
        assert torch.count_nonzero(adv[s]) == 0, (name, s, adv[s])


# -- policy losses -----------------------------------------------------------------------------
def test_ppo_clip_higher_and_dual_clip_by_hand():
    cfg = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, ratio_cap=3.0)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 20.0]]))
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss = policy_loss(logp, old, adv, cfg)
    # 1.5 clipped above at 1.28; 0.5 clipped below at 0.8 with A<0: -min(-0.5, -0.8) = 0.8;
    # 1.1 inside; 20 with A<0: -min(-20, -1.28) = 20, dual clip: min(20, 3) = 3
    assert loss.tolist()[0] == pytest.approx([-1.28, 0.8, -1.1, 3.0], rel=1e-6)
    r = ratio_sums(logp, old, torch.ones(1, 4), cfg)
    assert r[1].item() == 3 and r[2].item() == 4      # 1.5, 0.5 and 20 left [0.8, 1.28]


def test_cispo_keeps_every_tokens_gradient_with_a_clipped_weight():
    cfg = PolicyLossConfig(clip_eps_low=1.0, clip_eps_high=0.28, kind="cispo")
    logp = torch.log(torch.tensor([[2.0, 0.5, 1.1]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    loss = policy_loss(logp, torch.zeros(1, 3), adv, cfg)
    loss.sum().backward()
    # weights sg(clip(r, 0, 1.28)) = 1.28, 0.5, 1.1; d loss / d logp = -w * A
    assert logp.grad.tolist()[0] == pytest.approx([-1.28, 1.0, -0.55], rel=1e-6)
    assert loss.tolist()[0] == pytest.approx([-1.28 * math.log(2.0), 1.0 * math.log(0.5),
                                              -0.55 * math.log(1.1)], rel=1e-6)


def _gspo(kind, eps, logp_values, adv_values, mask_values):
    cfg = PolicyLossConfig(clip_eps_low=eps, clip_eps_high=eps, kind=kind)
    logp = torch.tensor([logp_values]).requires_grad_(True)
    old = torch.zeros(1, len(logp_values))
    adv, mask = torch.tensor([adv_values]), torch.tensor([mask_values])
    seq = sequence_terms(sequence_sums(logp, old, adv, mask))
    n = mask.sum()
    w = aggregation_weights("seq_mean_token_mean", {0: n.item()}, n.item(), 1)[0]
    loss = (policy_loss(logp, old, adv, cfg, seq=seq) * w * mask).sum() / n
    loss.backward()
    return loss.item(), logp.grad[0].tolist()


def test_gspo_is_the_sequence_objective_and_its_gradient():
    # log ratios 0.2 and 0.4 on two policy tokens (a third is masked): s = exp(0.3)
    s = math.exp(0.3)
    loss, grad = _gspo("gspo", 1.0, [0.2, 0.4, 5.0], [1.0, 3.0, 9.0], [1.0, 1.0, 0.0])
    # the sequence's advantage is its tokens' mean, 2; loss -s * 2; d/dlogp_t = -2 * s / 2
    assert loss == pytest.approx(-2 * s, rel=1e-6)
    assert grad == pytest.approx([-s, -s, 0.0], rel=1e-6)
    # the token variant keeps each token's advantage: -(s*1 + s*3)/2, d/dlogp_t = -s*A_t/2
    loss, grad = _gspo("gspo_token", 1.0, [0.2, 0.4, 5.0], [1.0, 3.0, 9.0], [1.0, 1.0, 0.0])
    assert loss == pytest.approx(-2 * s, rel=1e-6)
    assert grad == pytest.approx([-s / 2, -3 * s / 2, 0.0], rel=1e-6)
    # clipped at the sequence level (GSPO's 4e-4): s > 1 + eps with A > 0 -> no gradient
    loss, grad = _gspo("gspo", 4e-4, [0.2, 0.4, 5.0], [1.0, 3.0, 9.0], [1.0, 1.0, 0.0])
    assert loss == pytest.approx(-2 * (1 + 4e-4), rel=1e-6)
    assert grad == [0.0, 0.0, 0.0]


def test_gspo_with_one_policy_token_is_ppo_clip_on_that_token():
    loss, grad = _gspo("gspo", 0.2, [0.1, 0.0], [2.0, 0.0], [1.0, 0.0])
    assert loss == pytest.approx(-2 * math.exp(0.1), rel=1e-6)
    assert grad[0] == pytest.approx(-2 * math.exp(0.1), rel=1e-6)


# -- aggregation ---------------------------------------------------------------------------------
def test_aggregation_weights_give_each_mode_by_hand():
    tokens = {0: 2.0, 1: 4.0, 2: 0.0}         # sample 2 was filtered: no policy tokens
    losses = {0: [1.0, 3.0], 1: [2.0, 2.0, 2.0, 6.0], 2: []}
    n_tok, n_seq = 6.0, 2.0

    def agg(mode, norm=None):
        w = aggregation_weights(mode, tokens, n_tok, n_seq, norm)
        return sum(w[s] * sum(v) for s, v in losses.items()) / n_tok

    assert agg("token_mean") == pytest.approx(16 / 6)
    assert agg("seq_mean_token_mean") == pytest.approx((2.0 + 3.0) / 2)
    assert agg("seq_mean_token_sum") == pytest.approx((4.0 + 12.0) / 2)
    assert agg("seq_mean_token_sum_norm", 10) == pytest.approx((4.0 + 12.0) / (2 * 10))


# -- KL estimators -------------------------------------------------------------------------------
def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0, 0.0]), torch.tensor([-2.0, -100.0])
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([1.0, 100.0])
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.5, 5000.0])
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([math.exp(-1.0), 99.0],
                                                                  rel=1e-6)
    # low_var_kl: the log-ratio clamped to -20 (exp(-20) + 19), then the value to 10
    assert kl_estimate(logp, ref, "low_var_kl").tolist() == pytest.approx([math.exp(-1.0), 10.0],
                                                                          rel=1e-6)
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")


# -- DAPO's overlong handling --------------------------------------------------------------------
def test_overlong_penalty_by_hand():
    assert [overlong_penalty(n, 100, 20, 1.0) for n in (80, 90, 100, 120)] == \
        pytest.approx([0.0, -0.5, -1.0, -1.0])
    assert overlong_penalty(150, 100, 0, 1.0) == 0.0


def test_overlong_shaping_and_filtering_of_a_truncated_episode():
    from earl_megatron.rollout.agent_loop import Episode

    def ep(n, finish, turns):
        return Episode(env="e", seed=0, token_ids=tuple(range(n)),
                       loss_mask=(0,) + (1,) * (n - 1), logprobs=(0.0,) * n, reward=sum(turns),
                       turns=len(turns), finish_reason=finish, prompt_length=1, actions=(),
                       observations=(), turn_rewards=tuple(turns))
    eps = [ep(10, "done", (1.0,)), ep(95, "max_context", (0.5,))]
    shaped, pens = shaped_overlong(eps, 100, 20, 1.0)
    assert pens == pytest.approx([0.0, -0.75])
    assert shaped[1].reward == pytest.approx(-0.25) and shaped[1].turn_rewards == (-0.25,)
    assert shaped[0] is eps[0]
    samples = {s: episode_tensors(e.token_ids, e.loss_mask, e.logprobs, e.reward,
                                  len(e.token_ids) - 1, turn_rewards=e.turn_rewards)
               for s, e in enumerate(shaped)}
    kept, cut = overlong_filtered(samples, [0, 1], shaped)
    assert cut == [1] and kept[1].loss_mask.sum() == 0 and kept[0].loss_mask.sum() == 9


# -- the configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize("kw,needle", [
    ({"policy_loss": "gspo"}, "loss_agg=seq_mean_token_mean"),
    ({"policy_loss": "gspo_token", "loss_agg": "token_mean"}, "sequence-level"),
    ({"dynamic_sampling": True}, "group_size >= 2"),
    ({"name": "rloo", "group_size": 1}, "group_size >= 2"),
    ({"name": "rloo", "group_size": 2, "gamma": 0.9}, "no per-turn returns"),
    ({"norm_by_std": False}, "only grpo"),
    ({"loss_agg_tokens": 64}, "does nothing"),
    ({"kl_estimator": "k2"}, "kl_mode=off"),
    ({"kl_mode": "loss", "kl_coef": 0.1, "kl_estimator": "k5"}, "k1, k2, k3, low_var_kl"),
    ({"dual_clip": 1.0}, "must be > 1"),
])
def test_combinations_that_mean_nothing_are_refused(kw, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        AlgorithmConfig(**kw)


def test_kl_estimator_auto_resolves_per_mode():
    assert AlgorithmConfig().kl_estimator == "none"
    assert AlgorithmConfig(kl_mode="loss", kl_coef=0.1).kl_estimator == "k3"
    assert AlgorithmConfig(kl_mode="reward", kl_coef=0.1).kl_estimator == "k1"
    a = AlgorithmConfig(clip_eps=0.1, clip_eps_high=0.3)
    assert (a.clip_low, a.clip_high) == (0.1, 0.3)
