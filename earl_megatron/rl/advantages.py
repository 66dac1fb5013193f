"""Advantage estimators over per-token tensors (pure tensor math, no communication).

All tensors are [B, T] aligned with the token ids of an episode: ``mask`` is 1 on policy tokens
(the ones the loss trains) and 0 on prompt, environment and tool tokens; ``rewards`` is one
scalar per episode, credited at the episode's last policy token.

- REINFORCE++ (Hu et al. 2025, the EARL paper's estimator): per-token return
  ``G_t = r * [t is last policy token] - beta * sum_{t' >= t} kl_t'`` (the KL-in-reward form;
  beta = 0 gives the plain episode reward on every policy token), then advantages normalised by
  the mean and std over ALL policy tokens of the global batch. No critic, no group structure.
- Per-turn credit (multi-turn episodes): ``turn_returns`` takes the environment's reward of each
  turn at that turn's last policy token and discounts by ``gamma`` per turn,
  ``G_k = r_k + gamma * G_{k+1}`` over the turns k (runs of policy tokens), each turn's tokens
  sharing its ``G_k``. ``gamma = 1`` with only a final reward is the plain REINFORCE++ return.
- GRPO (Shao et al. 2024): ``A_i = (r_i - mean_group(r)) / (std_group(r) + eps)`` per prompt
  group, broadcast over the episode's policy tokens ("Dr. GRPO"-style ``scale=False`` skips the
  std division).
- ``batch_statistics`` returns the sums the normalisations need, so a distributed run can
  all-reduce them over the owners of the samples (runtime/dispatcher group reductions) and then
  call ``normalize`` with the global values: the result equals the single-process one.

Invariant: advantages are exactly 0 where mask == 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenStats:
    """Sums over policy tokens: enough for a global mean and std after an all-reduce."""

    count: float
    total: float
    total_sq: float

    def mean(self) -> float:
        return self.total / max(self.count, 1.0)

    def std(self) -> float:
        m = self.mean()
        var = self.total_sq / max(self.count, 1.0) - m * m
        return max(var, 0.0) ** 0.5

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.count, self.total, self.total_sq], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "TokenStats":
        c, s, sq = t.double().tolist()
        return cls(c, s, sq)


def last_policy_token(mask: torch.Tensor) -> torch.Tensor:
    """One-hot [B, T] of each row's last masked position (all zeros for rows with no policy token)."""
    idx = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, idx, torch.full_like(idx, -1)).max(dim=1).values
    onehot = torch.zeros_like(mask, dtype=torch.float32)
    rows = torch.nonzero(last >= 0).flatten()
    onehot[rows, last[rows]] = 1.0
    return onehot


def reinforce_pp_returns(rewards: torch.Tensor, mask: torch.Tensor,
                         kl: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token returns for REINFORCE++ (undiscounted, KL-in-reward when kl_coef > 0)."""
    mask = mask.float()
    token_rewards = rewards.float()[:, None] * last_policy_token(mask)
    if kl is not None and kl_coef:
        token_rewards = token_rewards - kl_coef * kl.float() * mask
    # reverse cumulative sum: G_t = sum_{t' >= t} r_t'
    returns = token_rewards.flip(1).cumsum(1).flip(1)
    return returns * mask


def turn_ids(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] index of the turn (run of policy tokens) each position belongs to; -1 off-policy."""
    m = mask > 0
    prev = torch.zeros_like(m)
    prev[:, 1:] = m[:, :-1]
    starts = (m & ~prev).long()
    return torch.where(m, starts.cumsum(1) - 1, torch.full_like(starts, -1))


def turn_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0
                 ) -> torch.Tensor:
    """Per-token returns with the reward of each turn and a per-turn discount ``gamma``.

    ``token_rewards`` [B, T] holds each turn's reward (anywhere inside the turn; conventionally
    its last policy token; rewards off the policy tokens are ignored). Every token of turn k gets
    ``G_k = sum_{j >= k} gamma^(j - k) r_j``: the turn is the action, its tokens share the credit.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma={gamma} must be in [0, 1]")
    ids = turn_ids(mask)
    k = int(ids.max().item()) + 1 if ids.numel() else 0
    if k == 0:
        return torch.zeros_like(token_rewards, dtype=torch.float32)
    on = ids >= 0
    per_turn = torch.zeros(mask.shape[0], k, dtype=torch.float64)
    per_turn.scatter_add_(1, ids.clamp(min=0), torch.where(on, token_rewards.double(),
                                                             torch.zeros_like(per_turn[:, :1])
                                                             .expand_as(ids)))
    g = torch.zeros(mask.shape[0], dtype=torch.float64)
    for j in range(k - 1, -1, -1):
        g = per_turn[:, j] + gamma * g
        per_turn[:, j] = g
    out = torch.gather(per_turn, 1, ids.clamp(min=0))
    return (out * on).float()


def batch_statistics(values: torch.Tensor, mask: torch.Tensor) -> TokenStats:
    m = mask.double()
    v = values.double() * m
    return TokenStats(count=float(m.sum()), total=float(v.sum()), total_sq=float((v * v).sum()))


def normalize(values: torch.Tensor, mask: torch.Tensor, stats: TokenStats,
              eps: float = 1e-6) -> torch.Tensor:
    """(values - mean) / (std + eps) on policy tokens, 0 elsewhere."""
    return ((values.float() - stats.mean()) / (stats.std() + eps)) * mask.float()


def reinforce_pp_advantages(rewards, mask, kl=None, kl_coef: float = 0.0,
                            stats: TokenStats | None = None) -> torch.Tensor:
    """REINFORCE++ advantages; pass global ``stats`` in a distributed run."""
    returns = reinforce_pp_returns(rewards, mask, kl, kl_coef)
    return normalize(returns, mask, stats or batch_statistics(returns, mask))


@dataclass(frozen=True)
class GroupStats:
    """Per-group sums of rewards: count, sum, sum of squares ([G] each)."""

    count: torch.Tensor
    total: torch.Tensor
    total_sq: torch.Tensor

    def as_tensor(self) -> torch.Tensor:
        return torch.stack([self.count, self.total, self.total_sq]).double()

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "GroupStats":
        return cls(t[0], t[1], t[2])


def group_statistics(rewards: torch.Tensor, group_ids: torch.Tensor, num_groups: int) -> GroupStats:
    r = rewards.double()
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_ids, torch.ones_like(r))
    total = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_ids, r)
    total_sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_ids, r * r)
    return GroupStats(count, total, total_sq)


def grpo_advantages(rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor,
                    num_groups: int, *, scale: bool = True, eps: float = 1e-6,
                    stats: GroupStats | None = None) -> torch.Tensor:
    """Group-normalised episode advantages broadcast over policy tokens."""
    s = stats or group_statistics(rewards, group_ids, num_groups)
    count = s.count.clamp(min=1.0)
    mean = s.total / count
    # unbiased std within the group, as GRPO implementations use; 0 for singleton groups
    var = ((s.total_sq - count * mean * mean) / (count - 1).clamp(min=1.0)).clamp(min=0.0)
    adv = rewards.double() - mean[group_ids]
    if scale:
        adv = adv / (var.sqrt()[group_ids] + eps)
    return adv.float()[:, None] * mask.float()
