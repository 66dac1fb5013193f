"""Returns, advantages, their normalisation, KL in the reward and TIS weights (pure tensor math).

The trainer's RL arithmetic lives in rl/ only: this module, rl/losses.py (the per-token loss, KL
estimators, ratio and clip-fraction sums) and rl/vocab_parallel.py (logp and entropy from
TP-sharded logits); trainer/scoring.py and trainer/stages.py call them. No communication:
normalisation statistics come in already reduced over the whole (global) batch: the trainer
computes this rank's ``moment_sums`` on what it OWNS (each sample counted once, by one rank of its
rollout replica), runtime/reduce.py all-reduces them (mean first, then squared deviations about the
global mean: one pass of sum and sum of squares loses digits when the mean is large), and the
functions here apply the result. On one process the all-reduces are identities, so a distributed
run equals the single-process one (tests/unit/test_scoring.py runs the trainer's path so).

Per-sample tensors are label-aligned [T] rows (trainer/data.py): ``mask`` is 1 on policy
tokens (the ones the loss trains) and 0 on prompt, environment, tool and padding tokens;
``token_rewards`` holds each turn's reward on the turn's last policy token.

- Returns (REINFORCE++; Hu et al. 2025, the EARL paper's estimator):
  ``token_returns``. Per-turn credit: every token of turn k gets
  ``G_k = r_k + gamma * G_{k+1}`` (the turn is the action). KL in the reward (k1, weight beta):
  with gamma = 1 each token pays its own and every later token's KL (REINFORCE++'s per-token
  form: ``G_t = sum_{t' >= t} r_t' - beta * kl_t'``); with gamma < 1 each turn's summed KL joins
  that turn's reward. gamma = 1, one final reward, no KL: the plain episode reward everywhere.
- REINFORCE++ advantage: ``(G - mean) / (std + eps)`` with mean and std over ALL policy tokens
  of the global batch (population std), ``normalize``.
- GRPO (Shao et al. 2024): ``A_i = (r_i - mean_g) / (std_g + eps)`` over the episodes of prompt
  group g (unbiased std within the group, as GRPO implementations use; 0 for a singleton group),
  broadcast over the episode's policy tokens, ``grpo_advantage``. With KL in the reward the
  episode's summed k1 comes off r_i first (a sequence-level penalty, ``kl_penalized_reward``).

- RLOO (Ahmadian et al. 2024): ``A_i = r_i - mean of the other rewards of the group``,
  ``rloo_advantage``. REINFORCE++-baseline (Hu et al. 2025): ``r_i - mean_g``, then normalised
  like REINFORCE++ over the batch's policy tokens, ``baselined_reward`` then ``normalize``.
  Dr. GRPO (Liu et al. 2025): GRPO without the division by the std (``grpo_advantage(scale=
  False)``; its length normalisation is rl/losses.py's ``seq_mean_token_sum_norm``). These
  three score whole episodes (no per-turn gamma), with the summed KL off the reward like GRPO.
- DAPO's overlong reward shaping (Yu et al. 2025), ``overlong_penalty``: a soft punishment over
  the last ``buffer`` tokens before the context limit.

- Off-policy weights (``algorithm.off_policy``). The policy that sampled a token (pi_behav: the
  engine's logprobs, perhaps another engine's kernels, perhaps weights some train steps old)
  is not the trainer's old policy pi_old (pi_prox: the re-scoring at the start of TRAIN), so
  each sampled token's policy-gradient term is weighted by ``w = pi_old / pi_rollout``,
  detached (``off_policy_weights``), applied to the advantages by ``tis_weighted``: truncated
  importance sampling (TIS; Yao et al. 2025, verl's ``tis_imp_ratio_cap``, slime's
  ``--use-tis``) caps w; decoupled PPO (Hilton et al. 2022, AReaL's ``behav_imp_weight_cap``)
  drops the tokens whose w passes the cap. Every term of the clipped surrogate (dual clip
  included) is linear in A and w >= 0, so ``w * A`` in place of A is exactly ``w *
  surrogate``; the KL and entropy terms are not weighted (they are not reached through A).

Invariants: advantages are exactly 0 where mask == 0; GRPO's advantages have mean 0 in every
group of non-identical rewards; REINFORCE++'s have mean 0 over the batch's policy tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

EPS = 1e-6


@dataclass(frozen=True)
class Moments:
    """Global statistics per group ([G] float64 each): count, mean and std."""

    count: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


def moment_sums(values: torch.Tensor, group_ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[2, G] float64: sum and count of ``values`` per group (this rank's share)."""
    v = values.double().flatten()
    idx = group_ids.long().flatten()
    out = torch.zeros(2, num_groups, dtype=torch.float64)
    out[0].index_add_(0, idx, v)
    out[1].index_add_(0, idx, torch.ones_like(v))
    return out


def squared_deviations(values: torch.Tensor, group_ids: torch.Tensor,
                       mean: torch.Tensor) -> torch.Tensor:
    """[G] float64: sum of (value - its group's global mean)^2 (this rank's share)."""
    v = values.double().flatten()
    idx = group_ids.long().flatten()
    return torch.zeros_like(mean).index_add_(0, idx, (v - mean[idx]) ** 2)


def moments_from(sums: torch.Tensor, sq_dev: torch.Tensor, *, unbiased: bool) -> Moments:
    """Moments from GLOBAL ``moment_sums`` and ``squared_deviations``."""
    total, count = sums[0], sums[1]
    mean = total / count.clamp(min=1)
    denom = (count - 1 if unbiased else count).clamp(min=1)
    return Moments(count=count, mean=mean, std=(sq_dev / denom).sqrt())


def group_means(sums: torch.Tensor) -> torch.Tensor:
    """[G] means from global ``moment_sums`` (the first pass)."""
    return sums[0] / sums[1].clamp(min=1)


def turn_ids(mask: torch.Tensor) -> torch.Tensor:
    """[..., T] index of the turn (run of policy tokens) each position belongs to; -1 off-policy."""
    m = mask > 0
    prev = torch.zeros_like(m)
    prev[..., 1:] = m[..., :-1]
    starts = (m & ~prev).long()
    return torch.where(m, starts.cumsum(-1) - 1, torch.full_like(starts, -1))


def turn_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0
                 ) -> torch.Tensor:
    """[T] per-token returns of one episode with the reward of each turn and a per-turn
    discount ``gamma``: every token of turn k gets ``G_k = sum_{j >= k} gamma^(j - k) r_j``.

    ``token_rewards`` holds each turn's reward anywhere inside the turn (conventionally its
    last policy token); rewards off the policy tokens are ignored.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma={gamma} must be in [0, 1]")
    ids = turn_ids(mask)
    k = int(ids.max().item()) + 1 if ids.numel() else 0
    if k <= 0:
        return torch.zeros_like(token_rewards, dtype=torch.float32)
    on = ids >= 0
    per_turn = torch.zeros(k, dtype=torch.float64)
    per_turn.index_add_(0, ids[on], token_rewards.double()[on])
    g = torch.zeros((), dtype=torch.float64)
    for j in range(k - 1, -1, -1):
        g = per_turn[j] + gamma * g
        per_turn[j] = g
    return (per_turn[ids.clamp(min=0)] * on).float()


def token_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float,
                  kl: Optional[torch.Tensor] = None, kl_coef: float = 0.0) -> torch.Tensor:
    """[T] returns of one episode with ``kl_coef * kl`` (k1, KL in the reward) off the policy
    tokens' rewards (see the module docstring for gamma = 1 vs gamma < 1)."""
    if kl is None or not kl_coef:
        return turn_returns(token_rewards, mask, gamma)
    r = token_rewards - kl_coef * kl * mask
    if gamma == 1.0:
        return r.flip(0).cumsum(0).flip(0) * mask
    return turn_returns(r, mask, gamma)


def normalize(values: torch.Tensor, mask: torch.Tensor, moments: Moments,
              eps: float = EPS) -> torch.Tensor:
    """REINFORCE++: (values - mean) / (std + eps) on policy tokens, 0 elsewhere (one group)."""
    mean, std = moments.mean[0].item(), moments.std[0].item()
    return (values - mean) / (std + eps) * mask


def kl_penalized_reward(reward: float, kl: Optional[torch.Tensor], kl_coef: float) -> float:
    """GRPO with KL in the reward: the episode reward minus ``kl_coef`` times its summed k1."""
    return reward - (kl_coef * float(kl.sum()) if kl is not None and kl_coef else 0.0)


def grpo_advantage(reward: float, group: int, mask: torch.Tensor, moments: Moments, *,
                   scale: bool = True, eps: float = EPS) -> torch.Tensor:
    """GRPO: one episode's group-normalised reward on its policy tokens (``scale=False``:
    Dr. GRPO's unscaled ``r - mean``)."""
    a = reward - moments.mean[group].item()
    if scale:
        a = a / (moments.std[group].item() + eps)
    return a * mask


def rloo_advantage(reward: float, group: int, mask: torch.Tensor, moments: Moments
                   ) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): the reward minus the mean of the OTHER rewards of its group,
    ``r_i - (sum_g - r_i) / (c - 1) = c / (c - 1) * (r_i - mean_g)`` for a group of c episodes
    (0 for a group of one: nothing to compare with), on the episode's policy tokens."""
    c = moments.count[group].item()
    if c < 2:
        return torch.zeros_like(mask, dtype=torch.float32)
    return c / (c - 1) * (reward - moments.mean[group].item()) * mask


def baselined_reward(reward: float, group: int, moments: Moments) -> float:
    """REINFORCE++-baseline's first step: the reward minus its group's mean (then normalised
    over the batch's policy tokens by ``normalize``)."""
    return reward - moments.mean[group].item()


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025), as a non-positive reward term: 0 up to
    ``max_tokens - buffer`` tokens, then falling linearly to ``-penalty`` at ``max_tokens``, and
    ``-penalty`` beyond it."""
    if buffer <= 0:
        return 0.0
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    return -penalty * min(1.0, (length - start) / buffer)


def off_policy_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                       cap: float, mode: str = "tis") -> tuple[torch.Tensor, int]:
    """(weights, capped): w = ``exp(old_logp - rollout_logp)`` on policy tokens and 1
    elsewhere, with w > ``cap`` set to ``cap`` (mode "tis") or to 0, the token dropped (mode
    "decoupled"); and how many policy tokens the cap touched (module docstring)."""
    if cap <= 0:
        raise ValueError(f"off-policy weight cap must be > 0, got {cap}")
    if mode not in ("tis", "decoupled"):
        raise ValueError(f"off-policy weights: mode {mode!r} is not tis or decoupled")
    on = mask.bool()
    ratio = torch.exp(old_logp.double() - rollout_logp.double())
    capped = ratio.clamp(max=cap) if mode == "tis" else \
        torch.where(ratio > cap, torch.zeros_like(ratio), ratio)
    weights = torch.where(on, capped, torch.ones_like(ratio))
    return weights.to(old_logp.dtype), int((on & (ratio > cap)).sum())


def tis_weighted(advantages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``w * A`` of one sample: ``weights`` (``off_policy_weights``) cover its first
    predictions, 1 on the padding after them."""
    w = torch.ones_like(advantages)
    w[:weights.numel()] = weights.to(advantages.dtype)
    return advantages * w
