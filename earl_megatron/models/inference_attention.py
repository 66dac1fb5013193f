"""Core attention for inference: Megatron's DotProductAttention, fused where it decodes.

``InferenceAttention`` fills the ``core_attention`` slot of Megatron's local layer spec at
cp = 1 (provider.layer_spec; TE specs bring their own fused attention). It is Megatron's
``DotProductAttention`` (same constructor, attributes, state dict and math) with one change:
in eval mode with an explicit mask (what the embedded engine passes: KV-cached prefill and
decode) it skips the two costs of the unfused path:

- GQA: ``repeat_interleave`` copies every cached key and value ``heads / groups`` times per
  layer and step; here queries are folded onto their group instead::

      heads 6, groups 2: query heads [0 1 2 | 3 4 5] -> group 0 | group 1 (Megatron's order)
      decode (sq = 1): q [b, 6, hn] -> [b * 2, 3, hn]; scores = q @ k^T per (row, group)

- prefill (sq > 1): ``torch.nn.functional.scaled_dot_product_attention`` (enable_gqa) instead
  of baddbmm + masked softmax + bmm over materialised [b, heads, sq, sk] scores.

Masks keep Megatron's convention (True = hidden) and value -10000, added to the scores (a
hidden score ends ~-10000 below the row's maximum, so its weight is exactly 0 in fp32 as with
Megatron's masked_fill, and a fully hidden row stays finite, never NaN). Training, a missing mask (the trainer's logprob pass: Megatron's causal default), packed
sequences, attention bias, softmax offsets and query-key layer scaling run
``DotProductAttention.forward`` unchanged, so training numerics do not move. Tested: equal to
DotProductAttention within fp32 rounding (tests/unit/test_inference_attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

_HIDDEN = -10000.0  # Megatron's attention_mask_func fill value


class InferenceAttention(DotProductAttention):
    """DotProductAttention with a fused eval path (module docstring)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if (self.training or attention_mask is None or packed_seq_params is not None
                or attention_bias is not None or self.softmax_offset is not None
                or self.config.apply_query_key_layer_scaling):
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        sq, b, heads, hn = query.shape
        sk, groups = key.shape[0], key.shape[2]
        if sq == 1:
            return self._decode(query, key, value, attention_mask, b, heads, groups, hn, sk)
        bias = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
        bias.masked_fill_(attention_mask, _HIDDEN)
        out = F.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
            attn_mask=bias, scale=self.softmax_scale, enable_gqa=groups != heads)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)

    def _decode(self, query, key, value, mask, b, heads, groups, hn, sk):
        rep = heads // groups
        # [1, b, heads, hn] -> [b * groups, rep, hn]; the cache views [sk, b, groups, hn] become
        # [b * groups, hn, sk] and [b * groups, sk, hn] without a copy (b and groups are adjacent)
        q = query.reshape(b * groups, rep, hn)
        # the mask [b or 1, 1, 1, sk] as an additive bias [b * groups, 1, sk], broadcast over
        # the rep queries of a group inside baddbmm (no pass over the scores to mask them)
        bias = torch.zeros((mask.shape[0], groups, 1, sk), dtype=query.dtype,
                           device=query.device).masked_fill_(mask, _HIDDEN)
        scores = torch.baddbmm(bias.expand(b, groups, 1, sk).reshape(b * groups, 1, sk), q,
                               key.permute(1, 2, 3, 0).reshape(b * groups, hn, sk),
                               alpha=self.softmax_scale)
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs, value.permute(1, 2, 0, 3).reshape(b * groups, sk, hn))
        return out.view(1, b, heads * hn)
