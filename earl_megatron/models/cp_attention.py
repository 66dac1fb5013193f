"""Core attention with context parallelism that needs no TransformerEngine.

Megatron-Core's ``DotProductAttention`` refuses ``context_parallel_size > 1`` (only TE's attention
supports CP). ``AllGatherKVAttention`` fills the same ``core_attention`` slot of the local layer
spec and works for any cp:

- Each CP rank holds the load-balanced ("zigzag") split Megatron uses everywhere else (rope,
  data): the sequence is cut into 2*cp chunks and cp rank i holds chunks i and 2*cp-1-i::

      cp=2, 8 tokens [t0..t7], chunks c0=[t0 t1] c1=[t2 t3] c2=[t4 t5] c3=[t6 t7]
      cp rank 0 holds [c0 c3] = [t0 t1 t6 t7];  cp rank 1 holds [c1 c2] = [t2 t3 t4 t5]

- Keys and values are all-gathered over the CP group (backward: all-reduce of the key/value
  gradients, then each rank keeps its own slice; gloo has no reduce_scatter), and the causal
  mask is built from the *global* positions of local queries and gathered keys, so every rank
  balances its causal work.
- With cp == 1 and sq < sk (KV-cached decoding) queries take the last sq positions.

Invariant: for the same inputs the result equals Megatron's DotProductAttention at cp=1 (tested),
and the loss at any cp equals the loss at cp=1 (distributed tests).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule

from earl_megatron.plan.placement import cp_chunks


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int,
                     device: Optional[torch.device] = None) -> torch.Tensor:
    """Global token positions held by ``cp_rank`` under the load-balanced split: the tokens of
    plan/placement.py's ``cp_chunks`` (the one definition), for a padded sequence."""
    if cp_size > 1 and seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} must be divisible by 2*cp = {2 * cp_size} "
                         "(pad the batch to a multiple of 2*cp)")
    return torch.cat([torch.arange(a, b, device=device)
                      for a, b in cp_chunks(seq_len, cp_size, cp_rank)])


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over a group; backward sums gradients and keeps the local slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        ctx.rank = dist.get_rank(group)
        ctx.local = x.shape[0]
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.local:(ctx.rank + 1) * ctx.local], None


class AllGatherKVAttention(MegatronModule):
    """Drop-in ``core_attention`` for the local spec with context parallelism on any backend."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, **kwargs):
        super().__init__(config=config)
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.tp_group = pg_collection.tp
        self.cp_group = getattr(pg_collection, "cp", None)
        tp = self.tp_group.size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.head_dim)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("AllGatherKVAttention does not implement attention dropout; "
                             "set attention_dropout=0.0 (RL fine-tuning runs without it)")

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None:
            raise ValueError("packed sequences are not supported by AllGatherKVAttention; "
                             "pass padded [b, s] batches")
        # query [sq, b, np, hn], key/value [sk, b, ng, hn]
        cp = self.cp_group.size() if self.cp_group is not None else 1
        sq, sk = query.shape[0], key.shape[0]
        if cp > 1:
            cp_rank = dist.get_rank(self.cp_group)
            key = _AllGatherSeq.apply(key, self.cp_group)
            value = _AllGatherSeq.apply(value, self.cp_group)
            total = key.shape[0]
            # gathered keys are [rank0's chunks, rank1's chunks, ...]: map to global positions
            k_pos = torch.cat([zigzag_positions(total, cp, r, query.device) for r in range(cp)])
            q_pos = zigzag_positions(total, cp, cp_rank, query.device)
        else:
            k_pos = torch.arange(sk, device=query.device)
            q_pos = torch.arange(sk - sq, sk, device=query.device)
        rep = self.heads // self.groups
        if rep > 1:
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat_interleave(rep, dim=2)
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 3, 0)    # [b, np, hn, sk]
        v = value.permute(1, 2, 0, 3)  # [b, np, sk, hn]
        scores = torch.matmul(q.float(), k.float()) * self.softmax_scale
        masked = k_pos[None, :] > q_pos[:, None]  # [sq, sk]
        if attention_mask is not None and cp == 1 and attention_mask.shape[-1] == sk \
                and attention_mask.shape[-2] == sq:
            masked = masked | attention_mask.bool()
        scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        ctx = torch.matmul(probs, v)  # [b, np, sq, hn]
        return ctx.permute(2, 0, 1, 3).reshape(sq, ctx.shape[0], self.heads * self.head_dim)
