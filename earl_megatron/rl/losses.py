"""Per-token policy losses for REINFORCE++, GRPO and PPO-clip without a critic.

Every function returns a per-token loss [B, T]; the step runner multiplies by the loss mask and
divides by the global number of policy tokens (token-level loss), so env/tool/prompt tokens
never contribute. ``logp`` is the current policy's log-probability of each target token (with
Megatron-Core this is ``-cross_entropy``, computed vocab-parallel under TP); ``old_logp`` is the
logprob under the policy that sampled (from the LOGPROB stage, or the engine's rollout logprobs);
``ref_logp`` is the reference policy's.

    ratio      = exp(logp - old_logp)
    surrogate  = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)   (PPO-clip)
    kl (k3)    = exp(ref_logp - logp) - (ref_logp - logp) - 1                   (>= 0, unbiased)
    loss       = surrogate + kl_coef * kl - entropy_coef * entropy

KL estimators (Schulman's): ``k1_kl`` (in the reward, rl/advantages.py), ``k3_kl`` (in the loss).
Clip fraction (``ratio_sums``): policy tokens whose ratio left [1 - eps_low, 1 + eps_high].

With one optimizer step per batch (on-policy) ratio == 1 and the surrogate's gradient equals
REINFORCE's ``-A * grad logp``; clipping matters once a batch is reused for several epochs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class PolicyLossConfig:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    """Coefficient of the k3 KL to the reference policy as a loss term (0 = off)."""
    entropy_coef: float = 0.0
    ratio_cap: Optional[float] = 10.0
    """Dual-clip: cap on the ratio for negative advantages (None = off)."""

    def __post_init__(self):
        if self.clip_eps_low < 0 or self.clip_eps_high < 0:
            raise ValueError("clip epsilons must be >= 0")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("kl_coef and entropy_coef must be >= 0")


def k1_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k1 estimator of KL(pi || ref) per token: log pi - log ref (signed, unbiased)."""
    return logp - ref_logp


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: non-negative, unbiased."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      cfg: PolicyLossConfig) -> torch.Tensor:
    """Per-token loss of PPO's clipped objective (with the dual clip when ``cfg.ratio_cap``)."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    if cfg.ratio_cap is not None:
        # dual clip: bound the loss of a huge ratio on a negative advantage
        capped = -cfg.ratio_cap * advantages
        loss = torch.where(advantages < 0, torch.minimum(loss, capped), loss)
    return loss


def ratio_sums(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
               cfg: PolicyLossConfig) -> torch.Tensor:
    """[3] float64 over policy tokens: (sum of pi/pi_old, ratios outside [1 - eps_low,
    1 + eps_high], tokens); summed over ranks, ratio_mean = [0] / [2], clip_fraction = [1] / [2]."""
    m = mask.double()
    ratio = torch.exp(logp.detach().double() - old_logp.double())
    out = ((ratio < 1.0 - cfg.clip_eps_low) | (ratio > 1.0 + cfg.clip_eps_high)).double()
    return torch.stack([(ratio * m).sum(), (out * m).sum(), m.sum()])


def masked_sums(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[2] float64: (sum of ``values`` over policy tokens, policy tokens); e.g. the entropy."""
    m = mask.float()
    return torch.stack([(values.detach().double() * m).sum(), m.double().sum()])


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                cfg: PolicyLossConfig, ref_logp: Optional[torch.Tensor] = None,
                entropy: Optional[torch.Tensor] = None) -> torch.Tensor:
    loss = clipped_surrogate(logp, old_logp, advantages, cfg)
    if cfg.kl_coef:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs reference logprobs: enable the reference model "
                             "(algorithm.kl_mode=loss) or set kl_coef=0")
        loss = loss + cfg.kl_coef * k3_kl(logp, ref_logp)
    if cfg.entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs per-token entropies from the forward pass")
        loss = loss - cfg.entropy_coef * entropy
    return loss
