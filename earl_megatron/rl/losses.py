"""Per-token policy losses: PPO-clip, GSPO (sequence and token variants) and CISPO, with the
KL estimators and the weights that aggregate per-token losses (docs/algorithms.md).

Every loss function returns a per-token loss [B, T]; the step runner multiplies it by the loss
mask, and Megatron's per-token path divides the batch's sum by the GLOBAL number of policy
tokens (runtime/step.py), so env/tool/prompt tokens never contribute. Other aggregations are
per-sample weights on that token mean (``aggregation_weights``), exact over dp ranks, cp chunks
and micro-batches. ``logp`` is the current policy's log-probability of each target token (with
Megatron-Core ``-cross_entropy``, vocab-parallel under TP); ``old_logp`` the old policy's (the
LOGPROB stage's re-scoring or the engine's); ``ref_logp`` the reference policy's.

    r          = exp(logp - old_logp)
    ppo_clip   = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A), and for A < 0 at most
                 dual_clip * |A| (the dual clip)
    gspo       : s_i = exp(mean over episode i's policy tokens of (logp - old_logp)), and per
                 token s_it = s_i * exp(logp_t - sg(logp_t)) (its value s_i; its gradient
                 s_i * grad logp_t), then ppo_clip's min with s_it in place of r (no dual clip),
                 the advantage the episode's mean advantage ("gspo") or the token's own
                 ("gspo_token"); with seq_mean_token_mean the gradient is GSPO's
                 -A_i * grad s_i exactly
    cispo      = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp
    loss       = policy term + kl_coef * KL estimator - entropy_coef * entropy

KL estimators of KL(pi || ref) per token (Schulman's; verl's names): ``k1`` = logp - ref_logp
(signed), ``k2`` = (logp - ref_logp)^2 / 2, ``k3`` = exp(ref_logp - logp) - (ref_logp - logp)
- 1 (>= 0), ``low_var_kl`` = k3 with the log-ratio clamped to [-20, 20] and the value to
[-10, 10]. In the loss (algorithm.kl_mode=loss, default k3) or in the reward (kl_mode=reward,
default k1; rl/advantages.py).

GSPO's sequence sums run over an episode's whole token range: under context parallelism a rank
holds two chunks of each episode, so ``sequence_terms`` takes a ``reduce`` (the trainer's sum
over the cp group; runtime/step.py's loss runs on every cp rank of a micro-batch together).

Clip fraction (``ratio_sums``): policy tokens whose ratio (GSPO: the sequence ratio) left
[1 - eps_low, 1 + eps_high]. On-policy (one optimizer step per batch) r == 1 and every loss's
gradient is REINFORCE's -A * grad logp (GSPO's: the episode's mean of it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from earl_megatron.config.algorithm import KL_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES

GSPO_LOG_RATIO_MAX = 10.0
"""GSPO's sequence log-ratio is clamped above here before exp (verl's bound), so a far-off
sequence cannot overflow; far above any clip range, so it never changes a clipped loss."""


@dataclass(frozen=True)
class PolicyLossConfig:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    """Coefficient of the KL to the reference policy as a loss term (0 = off)."""
    entropy_coef: float = 0.0
    ratio_cap: Optional[float] = 10.0
    """Dual-clip: cap on the ratio for negative advantages (None = off); ppo_clip only."""
    kind: str = "ppo_clip"
    """The policy term: ppo_clip, gspo, gspo_token or cispo (module docstring)."""
    kl_estimator: str = "k3"
    """The KL estimator of the loss term (k1, k2, k3, low_var_kl)."""

    def __post_init__(self):
        if self.clip_eps_low < 0 or self.clip_eps_high < 0:
            raise ValueError("clip epsilons must be >= 0")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("kl_coef and entropy_coef must be >= 0")
        if self.kind not in POLICY_LOSSES:
            raise ValueError(f"policy loss {self.kind!r}: use one of {POLICY_LOSSES}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"KL estimator {self.kl_estimator!r}: use one of {KL_ESTIMATORS}")

    @property
    def sequence_level(self) -> bool:
        """GSPO's variants read sums over each episode's tokens (``sequence_terms``)."""
        return self.kind.startswith("gspo")


def k1_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k1 estimator of KL(pi || ref) per token: log pi - log ref (signed, unbiased)."""
    return logp - ref_logp


def k2_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k2 estimator per token: (log pi - log ref)^2 / 2 (>= 0, biased, low variance)."""
    return 0.5 * (logp - ref_logp) ** 2


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: non-negative, unbiased."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def low_var_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 with verl's clamps ("low_var_kl"): log-ratio in [-20, 20], the value in [-10, 10]."""
    d = torch.clamp(ref_logp - logp, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(d) - d - 1.0, min=-10.0, max=10.0)


KL_FUNCTIONS = {"k1": k1_kl, "k2": k2_kl, "k3": k3_kl, "low_var_kl": low_var_kl}


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """The per-token KL(pi || ref) estimate named ``estimator`` (module docstring)."""
    if estimator not in KL_FUNCTIONS:
        raise ValueError(f"KL estimator {estimator!r}: use one of {KL_ESTIMATORS}")
    return KL_FUNCTIONS[estimator](logp, ref_logp)


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      cfg: PolicyLossConfig) -> torch.Tensor:
    """Per-token loss of PPO's clipped objective (with the dual clip when ``cfg.ratio_cap``)."""
    ratio = torch.exp(logp - old_logp)
    loss = _clipped(ratio, advantages, cfg)
    if cfg.ratio_cap is not None:
        # dual clip: bound the loss of a huge ratio on a negative advantage
        capped = -cfg.ratio_cap * advantages
        loss = torch.where(advantages < 0, torch.minimum(loss, capped), loss)
    return loss


def _clipped(ratio: torch.Tensor, advantages: torch.Tensor, cfg: PolicyLossConfig
             ) -> torch.Tensor:
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


@dataclass(frozen=True)
class SequenceTerms:
    """Per-row values of GSPO, each broadcast over the row's tokens ([B, 1])."""

    log_ratio: torch.Tensor
    """The mean over the episode's policy tokens of logp - old_logp (detached)."""
    advantage: torch.Tensor
    """The mean over the episode's policy tokens of the advantage."""


def sequence_sums(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """[B, 3] float64 of this rank's part of each row: (sum of logp - old_logp, sum of A,
    policy tokens) over policy tokens, detached; summed over the cp chunks of a row they are the
    episode's (``sequence_terms``)."""
    m = mask.double()
    return torch.stack([((logp.detach().double() - old_logp.double()) * m).sum(-1),
                        (advantages.double() * m).sum(-1), m.sum(-1)], dim=-1)


def sequence_terms(sums: torch.Tensor) -> SequenceTerms:
    """``SequenceTerms`` from each row's WHOLE ``sequence_sums`` (a row without policy
    tokens: 0, it adds nothing to the loss)."""
    n = sums[:, 2].clamp(min=1.0)
    return SequenceTerms(log_ratio=(sums[:, 0] / n).float().unsqueeze(-1),
                         advantage=(sums[:, 1] / n).float().unsqueeze(-1))


def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
              cfg: PolicyLossConfig, seq: SequenceTerms) -> torch.Tensor:
    """GSPO's per-token loss (module docstring): the sequence ratio through each token's logp,
    clipped at the sequence level, with the episode's (gspo) or the token's (gspo_token)
    advantage."""
    ratio = _sequence_ratio(logp, seq)
    adv = seq.advantage.expand_as(advantages) if cfg.kind == "gspo" else advantages
    return _clipped(ratio, adv, cfg)


def _sequence_ratio(logp: torch.Tensor, seq: SequenceTerms) -> torch.Tensor:
    log_s = torch.clamp(seq.log_ratio, max=GSPO_LOG_RATIO_MAX)
    return torch.exp(logp - logp.detach() + log_s)


def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
               cfg: PolicyLossConfig) -> torch.Tensor:
    """CISPO's per-token loss: the clipped importance weight, stop-gradient, times A and logp
    (every token keeps a gradient, however far its ratio moved)."""
    ratio = torch.exp(logp.detach() - old_logp)
    weight = torch.clamp(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    return -weight * advantages * logp


def ratio_sums(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
               cfg: PolicyLossConfig, seq: Optional[SequenceTerms] = None) -> torch.Tensor:
    """[3] float64 over policy tokens: (sum of the ratio, ratios outside [1 - eps_low,
    1 + eps_high], tokens); summed over ranks, ratio_mean = [0] / [2], clip_fraction = [1] / [2].
    GSPO (``seq`` given): the sequence ratio of each token's episode."""
    m = mask.double()
    if seq is not None:
        log_r = torch.clamp(seq.log_ratio.double(), max=GSPO_LOG_RATIO_MAX).expand_as(m)
    else:
        log_r = logp.detach().double() - old_logp.double()
    ratio = torch.exp(log_r)
    out = ((ratio < 1.0 - cfg.clip_eps_low) | (ratio > 1.0 + cfg.clip_eps_high)).double()
    return torch.stack([(ratio * m).sum(), (out * m).sum(), m.sum()])


def masked_sums(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[2] float64: (sum of ``values`` over policy tokens, policy tokens); e.g. the entropy."""
    m = mask.float()
    return torch.stack([(values.detach().double() * m).sum(), m.double().sum()])


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                cfg: PolicyLossConfig, ref_logp: Optional[torch.Tensor] = None,
                entropy: Optional[torch.Tensor] = None,
                seq: Optional[SequenceTerms] = None,
                weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The per-token loss of ``cfg`` (module docstring). ``seq``: GSPO's per-row terms (from
    ``sequence_terms`` over whole episodes); ``weights``: the aggregation's per-token weights
    (``aggregation_weights`` on each token of its sample; None: token_mean)."""
    if cfg.sequence_level:
        if seq is None:
            raise ValueError(f"policy loss {cfg.kind} needs the episodes' sequence terms")
        loss = gspo_loss(logp, old_logp, advantages, cfg, seq)
    elif cfg.kind == "cispo":
        loss = cispo_loss(logp, old_logp, advantages, cfg)
    else:
        loss = clipped_surrogate(logp, old_logp, advantages, cfg)
    if cfg.kl_coef:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs reference logprobs: enable the reference model "
                             "(algorithm.kl_mode=loss) or set kl_coef=0")
        loss = loss + cfg.kl_coef * kl_estimate(logp, ref_logp, cfg.kl_estimator)
    if cfg.entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs per-token entropies from the forward pass")
        loss = loss - cfg.entropy_coef * entropy
    return loss if weights is None else loss * weights


def aggregation_weights(mode: str, tokens: dict, total_tokens: float, total_sequences: float,
                        norm_tokens: Optional[int] = None) -> dict:
    """{sample: w} such that the token mean of ``w * loss`` over the GLOBAL batch (what
    Megatron's per-token path computes: the sum over every policy token / total_tokens) is the
    ``mode`` aggregation of the losses. ``tokens``: each of this rank's samples' policy tokens;
    ``total_tokens`` / ``total_sequences``: the batch's policy tokens and samples with policy
    tokens (over every rank). With N = total_tokens, S = total_sequences, n = a sample's tokens:

        token_mean                 1
        seq_mean_token_mean        N / (S * n)       (1/S) sum_i (1/n_i) sum_t l_it
        seq_mean_token_sum         N / S             (1/S) sum_i sum_t l_it
        seq_mean_token_sum_norm    N / (S * C)       (1/(S*C)) sum_i sum_t l_it, C = norm_tokens
    """
    if mode not in LOSS_AGGS:
        raise ValueError(f"loss aggregation {mode!r}: use one of {LOSS_AGGS}")
    if mode == "token_mean" or total_sequences <= 0:
        return {s: 1.0 for s in tokens}
    per_seq = total_tokens / total_sequences
    if mode == "seq_mean_token_mean":
        return {s: per_seq / n if n else 0.0 for s, n in tokens.items()}
    if mode == "seq_mean_token_sum":
        return {s: per_seq for s in tokens}
    if not norm_tokens or norm_tokens < 1:
        raise ValueError("seq_mean_token_sum_norm needs its constant normaliser (tokens >= 1)")
    return {s: per_seq / norm_tokens for s in tokens}
