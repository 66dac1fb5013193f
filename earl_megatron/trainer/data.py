"""Episodes -> per-sample training tensors -> this rank's micro-batches after a dispatch.

Each episode becomes one sample of ``L`` *predictions* (L = the longest episode of its
micro-batch minus one, rounded up to a multiple of 2 * cp_max so any CP split is even; the
micro-batches come from plan/batching.py), shifted once here so a CP split never separates an
input from its label:

    token ids     t0 t1 t2 ... t_n
    input_ids     t0 t1 ... t_{n-1}  pad...        (what the model reads)
    labels        t1 t2 ... t_n      pad...        (what it predicts)
    loss_mask     m1 m2 ... m_n      0...          (1 on policy tokens only)
    old_logprobs  lp1 ... lp_n       0...
    ref_logprobs  rlp1 ... rlp_n     0...      (kl on: the reference policy's, LOGPROB stage)
    token_rewards 0 .. r_1 .. r_2 .. 0...      (turn k's reward on its last policy token)
    advantages    a1  ... a_n        0...

The dispatcher moves these 1-D tensors from the rollout layout (every rank of a replica holds its
replica's episodes) to the consumer layout (dp block and cp chunks); ``microbatches`` stacks what
arrived into Megatron's micro-batches. The LOGPROB stage sends only ``LOGPROB_TENSORS`` to the
reference model and its ``REF_LOGPROBS`` back to every rank of each rollout replica.
Invariant: every policy token of every episode is in exactly one micro-batch of exactly one dp
rank (the dispatcher's exactly-once guarantee).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from earl_megatron.models.cp_attention import zigzag_positions
from earl_megatron.plan.placement import TensorSpec

TRAIN_TENSORS = (
    TensorSpec("input_ids", "int64", per_token=True, pp_stages="first"),
    TensorSpec("labels", "int64", per_token=True, pp_stages="last"),
    TensorSpec("loss_mask", "float32", per_token=True, pp_stages="last"),
    TensorSpec("old_logprobs", "float32", per_token=True, pp_stages="last"),
    TensorSpec("advantages", "float32", per_token=True, pp_stages="last"),
)
REF_LOGPROBS = TensorSpec("ref_logprobs", "float32", per_token=True, pp_stages="all")
"""The reference policy's logprobs: produced on the LOGPROB layout's last pp_stage, returned to
every rank of a rollout replica ("all"), read by the loss on the TRAIN layout's last pp_stage."""
LOGPROB_TENSORS = TRAIN_TENSORS[:2]
"""What the LOGPROB stage's forward reads: input_ids (first pp_stage) and labels (last)."""


def train_tensors(with_ref: bool) -> tuple[TensorSpec, ...]:
    """TRAIN_TENSORS, plus the reference logprobs when the loss reads them (kl_mode=loss)."""
    if not with_ref:
        return TRAIN_TENSORS
    return TRAIN_TENSORS + (TensorSpec("ref_logprobs", "float32", True, "last"),)


def shifted_ids(token_ids: Sequence[int], length: int, pad_id: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of ``length`` predictions each: the tokens padded, shifted once."""
    n = len(token_ids)
    if n - 1 > length:
        raise ValueError(f"episode of {n} tokens does not fit {length} predictions")
    ids = torch.full((length + 1,), pad_id, dtype=torch.long)
    ids[:n] = torch.tensor(token_ids, dtype=torch.long)
    return ids[:-1].clone(), ids[1:].clone()


def padded(values: torch.Tensor, length: int, fill: float = 1.0) -> torch.Tensor:
    """A sample's per-prediction ``values`` [n - 1] as a [length] row, ``fill`` after them."""
    if values.numel() > length:
        raise ValueError(f"{values.numel()} values do not fit a row of {length} predictions")
    out = torch.full((length,), fill, dtype=torch.float32)
    out[:values.numel()] = values.float()
    return out


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


def microbatches(received: dict, sample_ids: Sequence[Sequence[int]], *,
                 seq_lens: Sequence[int], cp: int, cp_rank: int, rows: int = 0,
                 tensors: Sequence[TensorSpec] = TRAIN_TENSORS) -> list[dict]:
    """Stack this rank's dispatched samples into micro-batches (one list of ids per batch).

    ``seq_lens[i]`` is micro-batch i's padded length (plan/batching.py: every sample in it was
    built with that length). ``received[name][sid]`` is this rank's part of sample ``sid`` (its
    CP chunks in Megatron's order); pp_stages that do not need a tensor simply did not receive
    it and get zeros, which the model never reads there. ``rows`` pads each micro-batch with
    all-masked rows up to that many samples (Megatron's schedule wants one size everywhere).
    """
    out = []
    for ids, seq_len in zip(sample_ids, seq_lens, strict=True):
        pos = zigzag_positions(seq_len, cp, cp_rank)
        local_len = pos.numel()
        n = max(rows, len(ids))
        mb = {"position_ids": pos.unsqueeze(0).expand(n, -1)}
        for spec in tensors:
            got = received.get(spec.name, {})
            dtype = torch.long if spec.dtype == "int64" else torch.float32
            stacked = torch.zeros(n, local_len, dtype=dtype)
            for i, s in enumerate(ids):
                if s in got:
                    if got[s].numel() != local_len:
                        raise RuntimeError(f"sample {s} of {spec.name!r} has {got[s].numel()} "
                                           f"tokens here, its micro-batch {local_len}")
                    stacked[i] = got[s]
            mb[spec.name] = stacked
        out.append(mb)
    return out
