"""Episodes -> per-sample training tensors -> this rank's micro-batches after a dispatch.

Each episode becomes one sample of ``L`` *predictions* (L = the batch's longest episode minus one,
rounded up to a multiple of 2 * cp_max so any CP split is even), shifted once here so a CP split
never separates an input from its label:

    token ids     t0 t1 t2 ... t_n
    input_ids     t0 t1 ... t_{n-1}  pad...        (what the model reads)
    labels        t1 t2 ... t_n      pad...        (what it predicts)
    loss_mask     m1 m2 ... m_n      0...          (1 on policy tokens only)
    old_logprobs  lp1 ... lp_n       0...
    advantages    a1  ... a_n        0...

The dispatcher moves these 1-D tensors from the rollout layout (every rank of a replica holds its
replica's episodes) to the consumer layout (dp block and cp chunks); ``microbatches`` stacks what
arrived into Megatron's micro-batches. Invariant: every policy token of every episode is in
exactly one micro-batch of exactly one dp rank (the dispatcher's exactly-once guarantee).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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


def padded_length(max_tokens: int, multiple: int) -> int:
    """Prediction length for episodes of at most ``max_tokens`` tokens."""
    preds = max(max_tokens - 1, 1)
    return -(-preds // multiple) * multiple


@dataclass(frozen=True)
class SampleTensors:
    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    reward: float


def episode_tensors(token_ids: Sequence[int], loss_mask: Sequence[int],
                    logprobs: Sequence[float], reward: float, length: int,
                    pad_id: int = 0) -> SampleTensors:
    n = len(token_ids)
    if n - 1 > length:
        raise ValueError(f"episode of {n} tokens does not fit {length} predictions")
    ids = torch.full((length + 1,), pad_id, dtype=torch.long)
    ids[:n] = torch.tensor(token_ids, dtype=torch.long)
    mask = torch.zeros(length + 1)
    mask[:n] = torch.tensor(loss_mask, dtype=torch.float32)
    lp = torch.zeros(length + 1)
    lp[:n] = torch.tensor(logprobs, dtype=torch.float32)
    return SampleTensors(input_ids=ids[:-1].clone(), labels=ids[1:].clone(),
                         loss_mask=mask[1:].clone(), old_logprobs=lp[1:].clone(),
                         reward=float(reward))


def microbatches(received: dict, sample_ids: Sequence[Sequence[int]], *, seq_len: int,
                 cp: int, cp_rank: int) -> list[dict]:
    """Stack this rank's dispatched samples into micro-batches (one list of ids per batch).

    ``received[name][sid]`` is this rank's part of sample ``sid`` (its CP chunks in Megatron's
    order); pp_stages that do not need a tensor simply did not receive it and get zeros, which
    the model never reads there.
    """
    pos = zigzag_positions(seq_len, cp, cp_rank)
    local_len = pos.numel()
    out = []
    for ids in sample_ids:
        mb = {"position_ids": pos.unsqueeze(0).expand(len(ids), -1)}
        for spec in TRAIN_TENSORS:
            got = received.get(spec.name, {})
            dtype = torch.long if spec.dtype == "int64" else torch.float32
            rows = [got[s] if s in got else torch.zeros(local_len, dtype=dtype) for s in ids]
            mb[spec.name] = torch.stack(rows).to(dtype)
        out.append(mb)
    return out
