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

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from earl_megatron.config.algorithm import GROUPED
from earl_megatron.rl.advantages import (baselined_reward, grpo_advantage, kl_penalized_reward,
                                         normalize, overlong_penalty, rloo_advantage,
                                         token_returns)
from earl_megatron.rl.losses import aggregation_weights, k1_kl, kl_estimate
from earl_megatron.runtime.build import ModelOnLayout
from earl_megatron.runtime.reduce import global_max, global_moments, global_sum


@dataclass(frozen=True)
class AdvantageConfig:
    estimator: str
    """algorithm.name: "reinforce_pp" (per-turn returns, batch-normalised),
    "reinforce_pp_baseline", "grpo" or "rloo" (rl/advantages.py)."""
    gamma: float = 1.0
    group_size: int = 1
    kl_coef: float = 0.0
    """KL in the reward; 0 when the KL is off or in the loss."""
    norm_by_std: bool = True
    """grpo: divide by the group's std (False: Dr. GRPO)."""



def owns_samples(policy: ModelOnLayout) -> bool:
    """One rank per rollout replica counts each of its samples (tp, pp, cp coordinate 0)."""
    c = policy.coords
    return c.tp == 0 and c.pp == 0 and c.cp == 0


def kl_to_reference(policy: ModelOnLayout, ids: list[int], samples: dict, estimator: str
                    ) -> tuple[dict[int, torch.Tensor], dict[str, float]]:
    """Per-token KL of the sampling policy to the reference (algorithm.kl_estimator: by default
    k1 in the reward, k3 in the loss) on policy tokens, and global metrics: ``kl`` (its mean per
    policy token) and ``ref_log_ratio_max`` (max |log pi_old - log pi_ref| over policy
    tokens)."""
    per, acc, top = {}, torch.zeros(2, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    owner = owns_samples(policy)
    for s in ids:
        t = samples[s]
        m = t.loss_mask
        k = kl_estimate(t.old_logprobs, t.ref_logprobs, estimator) * m
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
    if cfg.estimator in GROUPED:   # the baseline is the episode's group
        g = cfg.group_size
        reward = {s: kl_penalized_reward(samples[s].reward, kl[s] if coef else None, coef)
                  for s in ids}
        n = num_episodes
        mine = [s for s in ids if s < n and samples[s].loss_mask.any()] if owner else []
        moments = global_moments(torch.tensor([reward[s] for s in mine], dtype=torch.float64),
                                 torch.tensor([s // g for s in mine], dtype=torch.long),
                                 n // g, unbiased=True)
        group = {s: (s % n) // g for s in ids}
        if cfg.estimator == "grpo":
            return {s: grpo_advantage(reward[s], group[s], samples[s].loss_mask, moments,
                                      scale=cfg.norm_by_std) for s in ids}
        if cfg.estimator == "rloo":
            return {s: rloo_advantage(reward[s], group[s], samples[s].loss_mask, moments)
                    for s in ids}
        # reinforce_pp_baseline: r - mean_g on the policy tokens, normalised as REINFORCE++'s
        returns = {s: baselined_reward(reward[s], group[s], moments) * samples[s].loss_mask
                   for s in ids}
    else:
        returns = {s: token_returns(samples[s].token_rewards, samples[s].loss_mask, cfg.gamma,
                                    kl[s] if coef else None, coef) for s in ids}
    return normalized(policy, ids, samples, returns)


def normalized(policy: ModelOnLayout, ids: list[int], samples: dict,
               values: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """``values`` (per-token, per sample) as ``(x - mean) / (std + eps)`` with the mean and the
    population std over every policy token of the GLOBAL batch (REINFORCE++'s normalisation,
    and PPO's of its GAE advantages); 0 off the policy tokens."""
    parts = [values[s].double()[samples[s].loss_mask.bool()] for s in ids] \
        if owns_samples(policy) else []
    vals = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
    moments = global_moments(vals, torch.zeros(vals.numel(), dtype=torch.long), 1,
                             unbiased=False)
    return {s: normalize(values[s], samples[s].loss_mask, moments) for s in ids}


def advantage_check(cfg: AdvantageConfig, policy: ModelOnLayout, ids: list[int], samples: dict,
                    adv: dict, num_episodes: int) -> dict[str, float]:
    """The estimator's defining property, measured on the advantages the step trains on (a
    check that the normalisation ran on global statistics): REINFORCE++ (and its baseline
    variant) ``advantage_mean``, the mean per policy token (0); GRPO and RLOO
    ``advantage_group_mean_max``, the largest |mean| over groups of the episodes' advantages
    (0)."""
    owner = owns_samples(policy)
    if cfg.estimator in ("grpo", "rloo"):
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


def loss_weights(mode: str, policy: ModelOnLayout, ids: list[int], samples: dict,
                 norm_tokens: Optional[int]) -> Optional[dict[int, float]]:
    """Each sample's aggregation weight (rl/losses.aggregation_weights) from the GLOBAL batch's
    policy tokens and samples (counted by the replicas' owners); None for token_mean, whose
    weights are all 1 (the loss reads no weight tensor then)."""
    if mode == "token_mean":
        return None
    tokens = {s: float(samples[s].loss_mask.sum()) for s in ids}
    acc = torch.zeros(2, dtype=torch.float64)
    if owns_samples(policy):
        acc += torch.tensor([sum(tokens.values()), sum(1 for n in tokens.values() if n)],
                            dtype=torch.float64)
    acc = global_sum(acc)
    return aggregation_weights(mode, tokens, acc[0].item(), acc[1].item(), norm_tokens)


TRUNCATED = ("max_turns", "max_context")
"""The finish reasons of an episode cut off before its end (rollout/agent_loop.py)."""


def shaped_overlong(episodes: list, max_tokens: Optional[int], buffer: int, penalty: float
                    ) -> tuple[list, list[float]]:
    """DAPO's soft overlong punishment on each episode's reward (and its last turn's, so the
    turn rewards still add up): (episodes, the penalty of each). Unchanged when ``buffer`` is
    0."""
    if not buffer:
        return episodes, [0.0] * len(episodes)
    out, pens = [], []
    for e in episodes:
        p = overlong_penalty(len(e.token_ids), max_tokens, buffer, penalty)
        if p:
            turns = tuple(e.turn_rewards[:-1]) + (e.turn_rewards[-1] + p,) \
                if e.turn_rewards else ()
            e = dataclasses.replace(e, reward=e.reward + p, turn_rewards=turns)
        out.append(e)
        pens.append(p)
    return out, pens


def overlong_filtered(samples: dict, ids: list[int], episodes: list) -> tuple[dict, list[int]]:
    """DAPO's overlong filtering: the truncated episodes' samples with their loss mask zeroed
    (they train nothing; their group statistics were taken before), and their sample ids."""
    cut = [s for s, e in zip(ids, episodes) if e.finish_reason in TRUNCATED]
    out = dict(samples)
    for s in cut:
        out[s] = dataclasses.replace(out[s], loss_mask=torch.zeros_like(out[s].loss_mask))
    return out, cut


def overlong_metrics(policy: ModelOnLayout, ids: list[int], filtered: list[int],
                     penalties: list[float], num_episodes: int) -> dict[str, float]:
    """Global counts: ``overlong_filtered`` (samples masked out), ``overlong_penalized`` and
    ``overlong_penalty_mean`` (over the episodes' first rows)."""
    acc = torch.zeros(3, dtype=torch.float64)
    if owns_samples(policy):
        firsts = [p for s, p in zip(ids, penalties) if s < num_episodes]
        acc += torch.tensor([len(filtered), sum(1 for p in firsts if p), sum(firsts)],
                            dtype=torch.float64)
    acc = global_sum(acc)
    return {"overlong_filtered": acc[0].item(), "overlong_penalized": acc[1].item(),
            "overlong_penalty_mean": acc[2].item() / max(num_episodes, 1)}
