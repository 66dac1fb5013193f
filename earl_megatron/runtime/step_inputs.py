"""What the step reads: the per-sample tensors the trainer sends, and the one micro-batch builder.

The data walks down: trainer/data.py makes rows of ``L`` predictions (shifted once, so a CP split
never separates an input from its label), the dispatcher moves them (default: ``TRAIN_TENSORS``),
``microbatches`` stacks them, runtime/step.py consumes them (``local_microbatches`` too)::

    token ids     t0 t1 t2 ... t_n
    input_ids     t0 t1 ... t_{n-1}  pad...        (what the model reads; first pp_stage)
    labels        t1 t2 ... t_n      pad...        (what it predicts; last pp_stage)
    loss_mask     m1 m2 ... m_n      0...          (float, 1 on policy tokens only)
    old_logprobs  lp1 ... lp_n       0...
    advantages    a1  ... a_n        0...
    ref_logprobs  rlp1 ... rlp_n     0...          (only when the loss reads them: kl_mode=loss)
    loss_weights  w   ... w          0...          (only when algorithm.loss_agg is not
                                                    token_mean: the sample's aggregation weight,
                                                    rl/losses.aggregation_weights)
    routes_<l>    e0  e1  ... e_{n-1} 0...         (int64, per layer l: the rollout's experts of
                                                    each input token, algorithm.routing_replay;
                                                    trainer/stages.with_routes adds them to the
                                                    LOGPROB and TRAIN tensors, every pp_stage)
"""

from __future__ import annotations

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
REF_LOGPROBS = TensorSpec("ref_logprobs", "float32", per_token=True, pp_stages="last")
"""Produced on the LOGPROB layout's last pp_stage, read by the loss on TRAIN's last pp_stage."""
LOSS_WEIGHTS = TensorSpec("loss_weights", "float32", per_token=True, pp_stages="last")
"""Each token's aggregation weight (the same on every token of a sample); read by the loss."""
LOGPROB_TENSORS = TRAIN_TENSORS[:2]
"""What the LOGPROB stage's forward reads: input_ids (first pp_stage) and labels (last)."""


def train_tensors(with_ref: bool, with_weights: bool = False) -> tuple[TensorSpec, ...]:
    """TRAIN_TENSORS, plus the reference logprobs when the loss reads them (kl_mode=loss) and
    the aggregation weights when the loss is not a plain token mean."""
    return TRAIN_TENSORS + ((REF_LOGPROBS,) if with_ref else ()) + \
        ((LOSS_WEIGHTS,) if with_weights else ())


def shifted_ids(token_ids: Sequence[int], length: int, pad_id: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of ``length`` predictions each: the tokens padded, shifted once."""
    n = len(token_ids)
    if n - 1 > length:
        raise ValueError(f"episode of {n} tokens does not fit {length} predictions")
    ids = torch.full((length + 1,), pad_id, dtype=torch.long)
    ids[:n] = torch.tensor(token_ids, dtype=torch.long)
    return ids[:-1].clone(), ids[1:].clone()


def microbatches(received: dict, sample_ids: Sequence[Sequence[int]], *,
                 seq_lens: Sequence[int], cp: int, cp_rank: int, rows: int = 0,
                 tensors: Sequence[TensorSpec] = TRAIN_TENSORS, device=None) -> list[dict]:
    """Stack this rank's samples into micro-batches (one list of ids per batch).

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
        out.append({k: (v.to(device) if device is not None else v) for k, v in mb.items()})
    return out
