"""PPO's critic math: GAE over agent turns, the clipped value loss and explained variance (pure
tensor math; issue #45, docs/algorithms.md "PPO (issue #45)").

The trainer calls it under ``algorithm.name=ppo`` (trainer/critic.py: GAE on the VALUES stage's
values, the value loss in the CRITIC TRAIN stage, the metrics). Per-sample tensors are rl/advantages.py's label-aligned [T] rows:
position t predicts token t + 1, ``mask`` is 1 where that token is a policy token (the actions)
and 0 on prompt, environment, tool and padding positions, and ``token_rewards`` holds each turn's
reward on the turn's last policy token. ``values`` are the critic's outputs at the same positions:
``V_t`` is the value of the context up to token t, the state in which the policy picks token
t + 1.

GAE (Schulman et al. 2016) over the episode's POLICY tokens only. Let p_0 < p_1 < ... < p_{n-1}
be the positions with mask 1. The recursion runs over them in order and skips every masked
position entirely::

    V_next(p_i) = V(p_{i+1}) for i < n - 1, and 0 after the last policy token (episode end)
    delta(p_i)  = r(p_i) + gamma * V_next(p_i) - V(p_i)
    A(p_i)      = delta(p_i) + gamma * lam * A(p_{i+1})            (A after the end: 0)
    R(p_i)      = A(p_i) + V(p_i)                                  (the critic's target)

What a value means across a tool's answer: the "next state" of a turn's last policy token is the
first policy token of the next turn, whose context already holds the environment's (or tool's)
answer. The answer is part of the environment's transition, not a sequence of actions: its
tokens get no value, no reward, no advantage, and cost no discount step (gamma and lam apply
once per policy token, whatever the answer's length). So V_t estimates the return of the rest
of the episode from state t, the environment's answers included in the expectation; the critic's
outputs on masked positions are never read. This is the per-turn returns' masking
(``advantages.turn_returns``: environment tokens carry nothing) with a per-TOKEN discount:
gamma = lam = 1 gives ``A_t = G_t - V_t`` with ``G_t`` the plain sum of the rewards from t to the
episode's end, and R equals ``turn_returns(rewards, mask, 1.0)``; lam = 1 makes R the discounted
Monte-Carlo return whatever the values; lam = 0 makes A the one-step TD error.

Value loss (PPO2's clipped form, as verl, OpenRLHF and the baselines use it), per token::

    0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)    (clip c given)
    0.5 * (V - R)^2                                                 (clip None)

masked (0 off the policy tokens), to be aggregated like the policy loss. Its clip fraction counts
the policy tokens where the clipped term is the larger (verl's ``vf_clipfrac``: the clip decided
the loss, so V's gradient there is 0 once V left the range).

Statistics come as sums that the trainer all-reduces, as rl/advantages.py's moments do:
``value_clip_sums`` gives (clipped tokens, tokens); explained variance ``1 - Var(R - V) / Var(R)``
over the batch's policy tokens takes ``explained_variance_inputs`` (the returns as group 0, the
residuals R - V as group 1) through advantages.moment_sums / squared_deviations (on one process)
or runtime/reduce.global_moments (over ranks), and ``explained_variance`` reads the result.

Invariants: advantages, returns and the value loss are exactly 0 where mask == 0, and the
values there never change them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from earl_megatron.rl.advantages import Moments


def _same_shape(what: str, **rows: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in rows.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"{what}: tensors must have one shape (label-aligned rows of the same "
                         f"sample), got {shapes}")


def _unit_interval(**knobs: float) -> None:
    for name, v in knobs.items():
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"GAE: {name}={v} must be in [0, 1] (1 = no discount / "
                             f"Monte-Carlo returns, 0 = one step)")


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), float32 [T] each, of ONE episode's label-aligned row by GAE over its
    policy tokens (module docstring); 0 off the mask. Rewards and values on masked positions are
    ignored (the rewards as ``advantages.turn_returns`` ignores them)."""
    _same_shape("gae", token_rewards=token_rewards, values=values, mask=mask)
    if token_rewards.dim() != 1:
        raise ValueError(f"gae takes one episode's [T] row, got shape {tuple(values.shape)}: "
                         "call it per sample")
    _unit_interval(gamma=gamma, lam=lam)
    on = mask > 0
    pos = on.nonzero().flatten()
    # the recursion is sequential: a loop over Python floats (float64), not over tensor elements
    # (each tensor op costs microseconds); 10 ms for 5,758 policy tokens here (2 loaded cores)
    r = token_rewards.detach().double()[pos].tolist()
    v = values.detach().double()[pos].tolist()
    adv = [0.0] * len(pos)
    a, v_next = 0.0, 0.0
    for i in range(len(pos) - 1, -1, -1):
        a = r[i] + gamma * v_next - v[i] + gamma * lam * a
        adv[i], v_next = a, v[i]
    advantages = torch.zeros(mask.shape, dtype=torch.float64)
    returns = torch.zeros(mask.shape, dtype=torch.float64)
    if len(pos):
        a_on = torch.tensor(adv, dtype=torch.float64)
        advantages[pos] = a_on
        returns[pos] = a_on + torch.tensor(v, dtype=torch.float64)
    return advantages.float(), returns.float()


def _loss_terms(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                mask: torch.Tensor, clip: Optional[float]
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(unclipped, clipped) per-token squared errors; clipped None without a clip."""
    _same_shape("value loss", values=values, old_values=old_values, returns=returns, mask=mask)
    if clip is not None and not clip > 0:
        raise ValueError(f"value clip {clip} must be > 0 (None: no clipping)")
    target = returns.detach().to(values.dtype)
    unclipped = (values - target) ** 2
    if clip is None:
        return unclipped, None
    old = old_values.detach().to(values.dtype)
    clipped_v = torch.clamp(values, old - clip, old + clip)
    return unclipped, (clipped_v - target) ** 2


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, clip: Optional[float]) -> torch.Tensor:
    """Per-token value loss (module docstring), 0 where mask == 0; differentiable in
    ``values`` only (``old_values`` and ``returns`` are targets)."""
    unclipped, clipped = _loss_terms(values, old_values, returns, mask, clip)
    loss = unclipped if clipped is None else torch.maximum(unclipped, clipped)
    return 0.5 * loss * mask.to(loss.dtype)


def value_clip_sums(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                    mask: torch.Tensor, clip: Optional[float]) -> torch.Tensor:
    """[2] float64: (policy tokens where the clipped term decided the loss, policy tokens);
    summed over ranks, clip fraction = [0] / [1] (0 clipped tokens without a clip)."""
    unclipped, clipped = _loss_terms(values.detach(), old_values, returns, mask, clip)
    m = mask.double()
    hit = torch.zeros_like(m) if clipped is None else (clipped > unclipped).double()
    return torch.stack([(hit * m).sum(), m.sum()])


def explained_variance_inputs(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, group_ids), float64 and long 1-D: this rank's policy tokens' returns (group 0) and
    residuals R - V (group 1), to pass with ``num_groups=2`` to runtime/reduce.global_moments
    (or advantages.moment_sums and squared_deviations on one process)."""
    _same_shape("explained variance", values=values, returns=returns, mask=mask)
    on = mask.flatten() > 0
    ret = returns.detach().double().flatten()[on]
    res = ret - values.detach().double().flatten()[on]
    ids = torch.arange(2).repeat_interleave(ret.numel())
    return torch.cat([ret, res]), ids


def explained_variance(moments: Moments) -> float:
    """``1 - Var(R - V) / Var(R)`` from the GLOBAL moments of ``explained_variance_inputs``:
    1 for perfect values, 0 for the returns' mean, below 0 for values worse than the mean;
    NaN when the returns do not vary (nothing to explain: no tokens, or one return)."""
    var_r, var_res = float(moments.std[0]) ** 2, float(moments.std[1]) ** 2
    if var_r == 0.0:
        return math.nan
    return 1.0 - var_res / var_r
