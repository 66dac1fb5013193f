"""Scoring an iteration's samples: KL to the reference and advantages, with global statistics.

Where the samples are: every rank of rollout replica d holds replica d's samples (the producer
placement). One rank per replica OWNS them for statistics (tp, pp and cp coordinate 0), so each
sample counts once in every all-reduce (runtime/reduce.py); every rank then applies the same
global statistics to the samples it holds. The math is rl/'s: advantages and KL in the reward in
rl/advantages.py, the KL estimators (k1 in the reward, k3 in the loss) in rl/losses.py.
``kl`` in the metrics is the mean over policy tokens of the estimator in use, evaluated at the
policy that sampled the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from earl_megatron.rl.advantages import (grpo_advantage, kl_penalized_reward, normalize,
                                         token_returns)
from earl_megatron.rl.losses import k1_kl, k3_kl
from earl_megatron.runtime.build import ModelOnLayout
from earl_megatron.runtime.reduce import global_max, global_moments, global_sum


@dataclass(frozen=True)
class AdvantageConfig:
    estimator: str
    """"reinforce_pp" (per-turn returns, batch-normalised) or "grpo" (algorithm.name)."""
    gamma: float = 1.0
    group_size: int = 1
    kl_coef: float = 0.0
    """KL in the reward (k1); 0 when the KL is off or in the loss."""


def owns_samples(policy: ModelOnLayout) -> bool:
    """One rank per rollout replica counts each of its samples (tp, pp, cp coordinate 0)."""
    c = policy.coords
    return c.tp == 0 and c.pp == 0 and c.cp == 0


def kl_to_reference(policy: ModelOnLayout, ids: list[int], samples: dict, in_reward: bool
                    ) -> tuple[dict[int, torch.Tensor], dict[str, float]]:
    """Per-token KL of the sampling policy to the reference (k1 in the reward, k3 in the loss) on
    policy tokens, and global metrics: ``kl`` (its mean per policy token) and
    ``ref_log_ratio_max`` (max |log pi_old - log pi_ref| over policy tokens)."""
    per, acc, top = {}, torch.zeros(2, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    owner = owns_samples(policy)
    for s in ids:
        t = samples[s]
        m = t.loss_mask
        k = (k1_kl if in_reward else k3_kl)(t.old_logprobs, t.ref_logprobs) * m
        per[s] = k
        if owner:
            acc += torch.stack([k.double().sum(), m.double().sum()])
            gap = (k1_kl(t.old_logprobs, t.ref_logprobs).abs() * m).max() if m.any() else 0.0
            top = torch.maximum(top, torch.as_tensor(gap, dtype=torch.float64).reshape(1))
    acc, top = global_sum(acc), global_max(top)
    return per, {"kl": acc[0].item() / max(acc[1].item(), 1.0),
                 "ref_log_ratio_max": top.item()}


def advantages(cfg: AdvantageConfig, policy: ModelOnLayout, ids: list[int], samples: dict,
               num_episodes: int, kl: Optional[dict[int, torch.Tensor]] = None
               ) -> dict[int, torch.Tensor]:
    """Per-sample advantages [length] of this rank's samples (0 off the policy tokens).

    REINFORCE++: ``token_returns`` of each episode (``kl``: k1 per token, with
    ``cfg.kl_coef``), normalised by mean and std over every policy token of the iteration.
    GRPO: each episode's reward (minus its summed KL when in the reward) normalised within its
    group of ``group_size`` consecutive episodes. Sample ``s`` is episode ``s % num_episodes``
    (an agent episode that forked has rows s, s + n, ...: trainer/agent_rollout.py); only an
    episode's first row (s < n) with policy tokens counts in its group's statistics, and every
    row takes its group's.
    """
    owner = owns_samples(policy)
    coef = cfg.kl_coef if kl is not None else 0.0
    if cfg.estimator == "grpo":
        g = cfg.group_size
        reward = {s: kl_penalized_reward(samples[s].reward, kl[s] if coef else None, coef)
                  for s in ids}
        n = num_episodes
        mine = [s for s in ids if s < n and samples[s].loss_mask.any()] if owner else []
        moments = global_moments(torch.tensor([reward[s] for s in mine], dtype=torch.float64),
                                 torch.tensor([s // g for s in mine], dtype=torch.long),
                                 n // g, unbiased=True)
        return {s: grpo_advantage(reward[s], (s % n) // g, samples[s].loss_mask, moments)
                for s in ids}
    returns = {s: token_returns(samples[s].token_rewards, samples[s].loss_mask, cfg.gamma,
                                kl[s] if coef else None, coef) for s in ids}
    parts = [returns[s].double()[samples[s].loss_mask.bool()] for s in ids] if owner else []
    vals = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
    moments = global_moments(vals, torch.zeros(vals.numel(), dtype=torch.long), 1,
                             unbiased=False)
    return {s: normalize(returns[s], samples[s].loss_mask, moments) for s in ids}


def advantage_check(cfg: AdvantageConfig, policy: ModelOnLayout, ids: list[int], samples: dict,
                    adv: dict, num_episodes: int) -> dict[str, float]:
    """The estimator's defining property, measured on the advantages the step trains on (a
    check that the normalisation ran on global statistics): REINFORCE++ ``advantage_mean``, the
    mean per policy token (0); GRPO ``advantage_group_mean_max``, the largest |mean| over
    groups of the episodes' advantages (0)."""
    owner = owns_samples(policy)
    if cfg.estimator == "grpo":
        g = cfg.group_size
        acc = torch.zeros(2, num_episodes // g, dtype=torch.float64)
        for s in ids if owner else []:
            on = samples[s].loss_mask.bool()
            if s >= num_episodes or not on.any():
                continue  # forks repeat their episode's advantage; a lost episode has none
            acc[0, s // g] += adv[s][on][0].item()
            acc[1, s // g] += 1
        acc = global_sum(acc)
        return {"advantage_group_mean_max":
                (acc[0] / acc[1].clamp(min=1)).abs().max().item()}
    acc = torch.zeros(2, dtype=torch.float64)
    for s in ids if owner else []:
        acc += torch.stack([adv[s].double().sum(), samples[s].loss_mask.double().sum()])
    acc = global_sum(acc)
    return {"advantage_mean": acc[0].item() / max(acc[1].item(), 1.0)}
