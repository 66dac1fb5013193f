"""Teacher-forced logprobs of whole sequences: the trainer's side of the engine consistency check.

``recompute_logprobs(mol, sequences)`` scores token lists with the LOGPROB stage's own code path,
``runtime.step.forward_logprobs`` (Megatron's forward-only schedule for ``mol.layout``,
vocab-parallel log-softmax of the TP-sharded logits), so an engine's logprobs are checked
against what the trainer computes, not against a third implementation. The sequences become a
``TokenBatch`` cut by ``step.local_microbatches`` (dp blocks, cp zigzag); this module only pads
and gathers::

    sequences (dp=2, mbs=1)    A B C          -> padded to 4 rows (a multiple of dp x mbs) with
                                                 1-token filler rows: replica 0 scores A B,
                                                 replica 1 scores C and the filler
    last pp_stage [b, s_local] -> broadcast over pp -> all-gather over cp (zigzag back to
                                 positions) -> all-gather over dp -> every rank, prompt order

Entry j of a result is log p(seq[j] | seq[:j]) at ``temperature``; entry 0 has no context and
is 0.0, which aligns the result with ``Episode.logprobs``. Right padding (to the longest
sequence, a multiple of 2*cp) cannot change earlier tokens under the causal mask. Every rank
passes the same sequences and gets all results.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from earl_megatron.rollout.engine import check_prompts
from earl_megatron.runtime import groups


@torch.no_grad()
def recompute_logprobs(mol, sequences: Sequence[Sequence[int]], *, temperature: float = 1.0,
                       micro_batch_size: int = 1, pad_token_id: int = 0) -> list[list[float]]:
    """Per-token logprobs of every sequence under ``mol`` (any layout, DDP-wrapped or not)."""
    from earl_megatron.models.cp_attention import zigzag_positions
    from earl_megatron.runtime.step import TokenBatch, forward_logprobs, local_microbatches

    check_prompts(sequences)
    layout, coords = mol.layout, mol.coords
    if temperature <= 0:
        temperature = 1.0  # greedy decoding reports logprobs at T=1 (engine.py)
    n = len(sequences)
    mbs = max(1, min(micro_batch_size, -(-n // layout.dp)))
    rows = -(-n // (layout.dp * mbs)) * layout.dp * mbs
    seq = max(1, max(len(s) for s in sequences) - 1)
    if layout.cp > 1:
        seq = -(-seq // (2 * layout.cp)) * (2 * layout.cp)
    tokens = torch.full((rows, seq + 1), pad_token_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        tokens[i, :len(s)] = torch.tensor(list(s), dtype=torch.long)
    batch = TokenBatch(tokens=tokens, loss_mask=torch.ones(rows, seq + 1))
    mbs_list = local_microbatches(batch, layout, coords, mbs, device=groups.device())
    out = forward_logprobs(mol, mbs_list, seq_len=seq // layout.cp, micro_batch_size=mbs,
                           temperature=temperature)
    per_dp = rows // layout.dp
    local = torch.empty(per_dp, seq // layout.cp, dtype=torch.float32, device=groups.device())
    if out:
        local = torch.cat(out, dim=0).float()
    if layout.pp > 1:
        pp_ranks = dist.get_process_group_ranks(groups.pp_group())
        dist.broadcast(local, src=pp_ranks[-1], group=groups.pp_group())
    full = local
    if layout.cp > 1:
        parts = [torch.empty_like(local) for _ in range(layout.cp)]
        dist.all_gather(parts, local.contiguous(), group=groups.cp_group())
        full = torch.empty(per_dp, seq, dtype=torch.float32, device=local.device)
        for r, part in enumerate(parts):
            full[:, zigzag_positions(seq, layout.cp, r, device=local.device)] = part
    if layout.dp > 1:
        parts = [torch.empty_like(full) for _ in range(layout.dp)]
        dist.all_gather(parts, full.contiguous(), group=groups.dp_group())
        full = torch.cat(parts, dim=0)
    full = full.cpu()
    return [[0.0] + full[i, :len(s) - 1].tolist() for i, s in enumerate(sequences)]
