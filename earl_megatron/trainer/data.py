"""Episodes -> per-sample training tensors: label-aligned rows of ``L`` predictions each.

L is the longest episode of the sample's micro-batch (plan/batching.py) minus one; the rows the
step reads are drawn in runtime/step_inputs.py. A sample also carries what scoring reads:

    token_rewards 0 .. r_1 .. r_2 .. 0...      (turn k's reward on its last policy token)
    ref_logprobs  rlp1 ... rlp_n     0...      (kl on: the reference policy's, LOGPROB stage)

Invariant: every policy token of every episode is in exactly one micro-batch of exactly one dp
rank (the dispatcher's exactly-once guarantee).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from earl_megatron.runtime.step_inputs import shifted_ids


@dataclass(frozen=True)
class SampleTensors:
    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    reward: float
    token_rewards: torch.Tensor
    """[length]: each turn's reward at the turn's last policy token (label-aligned), 0 elsewhere;
    an episode without per-turn rewards has its whole reward on the last policy token."""
    ref_logprobs: Optional[torch.Tensor] = None
    """[length], label-aligned, 0 off the policy tokens; None when kl_mode=off."""


def episode_tensors(token_ids: Sequence[int], loss_mask: Sequence[int],
                    logprobs: Sequence[float], reward: float, length: int,
                    pad_id: int = 0, turn_rewards: Sequence[float] = (),
                    ref_logprobs: Optional[torch.Tensor] = None) -> SampleTensors:
    """One episode's label-aligned tensors of ``length`` predictions (see the module docstring).

    ``turn_rewards`` (one per sampled turn, i.e. per run of policy tokens) must add up to
    ``reward``; empty means: all of ``reward`` on the last turn. ``ref_logprobs``: the reference
    policy's logprob of each of the episode's ``len(token_ids) - 1`` predictions.
    """
    n = len(token_ids)
    input_ids, labels = shifted_ids(token_ids, length, pad_id)
    mask = torch.zeros(length + 1)
    mask[:n] = torch.tensor(loss_mask, dtype=torch.float32)
    lp = torch.zeros(length + 1)
    lp[:n] = torch.tensor(logprobs, dtype=torch.float32)
    ends = [j for j in range(n) if loss_mask[j] and (j + 1 == n or not loss_mask[j + 1])]
    per_turn = list(turn_rewards) if turn_rewards else [0.0] * (len(ends) - 1) + [float(reward)]
    if ends and len(per_turn) != len(ends):
        raise ValueError(f"{len(per_turn)} turn rewards for an episode with {len(ends)} sampled "
                         "turns; give one reward per turn (Episode.turn_rewards)")
    if ends and abs(sum(per_turn) - float(reward)) > 1e-6 * max(1.0, abs(float(reward))):
        raise ValueError(f"turn rewards add up to {sum(per_turn)}, not the episode reward "
                         f"{reward}")
    rew = torch.zeros(length + 1)
    for j, r in zip(ends, per_turn):
        rew[j] = r
    ref = None
    if ref_logprobs is not None:
        if ref_logprobs.numel() != n - 1:
            raise ValueError(f"{ref_logprobs.numel()} reference logprobs for an episode of {n} "
                             f"tokens ({n - 1} predictions)")
        ref = torch.zeros(length)
        ref[:n - 1] = ref_logprobs.float()
        ref = ref * mask[1:]
    return SampleTensors(input_ids=input_ids, labels=labels,
                         loss_mask=mask[1:].clone(), old_logprobs=lp[1:].clone(),
                         reward=float(reward), token_rewards=rew[1:].clone(), ref_logprobs=ref)

