"""Full Megatron tensors <-> TP shards: bit-exact round trips and the SwiGLU stride."""

import pytest
import torch

from earl_megatron.config.model import ModelConfig
from earl_megatron.models.sharding import reference_weights, shard, unshard
from earl_megatron.plan.tensor_table import tensor_table


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_roundtrip_bit_exact(family, tp):
    cfg = ModelConfig.tiny(family)
    table = tensor_table(cfg)
    full = reference_weights(cfg, seed=0)
    for name, t in full.items():
        row = table.row(name)
        parts = [shard(row, t, r, tp) for r in range(tp)]
        assert torch.equal(unshard(row, parts), t), name
        if row.split_dim is not None and tp > 1:
            assert sum(p.numel() for p in parts) == t.numel()
            assert all(p.numel() == row.local_numel(tp) for p in parts)


def test_swiglu_rank_holds_gate_and_up_slices():
    cfg = ModelConfig(num_layers=1, hidden_size=3, ffn_hidden_size=8, num_attention_heads=1,
                      num_query_groups=1, vocab_size=4)
    row = tensor_table(cfg).row("decoder.layers.0.mlp.linear_fc1.weight")
    f, h, tp = 8, 3, 2
    gate = torch.arange(f * h).view(f, h).float()
    up = 1000 + torch.arange(f * h).view(f, h).float()
    full = torch.cat([gate, up])
    s1 = shard(row, full, 1, tp)
    assert torch.equal(s1, torch.cat([gate[4:], up[4:]]))
    # a plain dim-0 split would give rank 1 only "up" rows: the stride matters
    assert not torch.equal(s1, full.chunk(2)[1])


def test_shard_refuses_a_size_that_does_not_divide():
    cfg = ModelConfig.tiny()
    row = tensor_table(cfg).row("decoder.layers.0.mlp.linear_fc1.weight")
    with pytest.raises(ValueError, match="does not divide by tp=2"):
        shard(row, torch.zeros(6, 64), 0, 2)
