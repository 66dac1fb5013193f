"""AllGatherKVAttention equals Megatron's DotProductAttention at cp=1 (incl. cached decoding)."""

import torch

from earl_megatron.models.cp_attention import zigzag_positions
from earl_megatron.testing.multiproc import run_distributed


def test_zigzag_positions_partition_and_balance():
    s, cp = 16, 4
    parts = [zigzag_positions(s, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(s))
    # causal work (sum of positions + 1) is equal on every cp rank
    assert len({int((p + 1).sum()) for p in parts}) == 1
    assert parts[0].tolist() == [0, 1, 14, 15]


def _compare_with_megatron():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.models.cp_attention import AllGatherKVAttention
    from earl_megatron.models.provider import transformer_config
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.cpu_backend import cpu_backend

    cfg = ModelConfig.tiny()
    lay = ParallelLayout()
    out = {}
    with cpu_backend():
        groups.build_groups(lay, cfg, seed=0)
        tcfg = transformer_config(cfg, lay)
        ref = DotProductAttention(tcfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                  attention_type="self")
        mine = AllGatherKVAttention(tcfg, layer_number=1, attn_mask_type=AttnMaskType.causal)
        g = torch.Generator().manual_seed(0)
        s, b, d = 12, 2, cfg.head_dim
        q = torch.randn(s, b, cfg.num_attention_heads, d, generator=g)
        k = torch.randn(s, b, cfg.num_query_groups, d, generator=g)
        v = torch.randn(s, b, cfg.num_query_groups, d, generator=g)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
        out["full"] = (ref(q, k, v, mask) - mine(q, k, v, None)).abs().max().item()
        # decoding the last token against the whole key cache equals the last row of full attn
        last = mine(q[-1:], k, v, None)
        out["decode"] = (last - ref(q, k, v, mask)[-1:]).abs().max().item()
        groups.destroy_groups()
    return out


def test_matches_dot_product_attention():
    diffs = run_distributed(_compare_with_megatron, 1, timeout=120)[0]
    assert diffs["full"] < 1e-5, diffs
    assert diffs["decode"] < 1e-5, diffs
