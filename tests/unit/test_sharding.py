"""Full Megatron tensors <-> TP shards: bit-exact round trips and the SwiGLU stride."""

import pytest
import torch

from earl_megatron.config.model import ModelConfig
from earl_megatron.weights.sharding import (global_name, local_name, reference_weights, shard,
                                            tp_split_dim, unshard)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_roundtrip_bit_exact(family, tp):
    cfg = ModelConfig.tiny(family)
    full = reference_weights(cfg, seed=0)
    for name, t in full.items():
        parts = [shard(name, t, r, tp) for r in range(tp)]
        assert torch.equal(unshard(name, parts), t), name
        if tp_split_dim(name) is not None and tp > 1:
            assert sum(p.numel() for p in parts) == t.numel()


def test_swiglu_rank_holds_gate_and_up_slices():
    f, h, tp = 8, 3, 2
    gate = torch.arange(f * h).view(f, h).float()
    up = 1000 + torch.arange(f * h).view(f, h).float()
    full = torch.cat([gate, up])
    s1 = shard("decoder.layers.0.mlp.linear_fc1.weight", full, 1, tp)
    assert torch.equal(s1, torch.cat([gate[4:], up[4:]]))
    # a plain dim-0 split would give rank 1 only "up" rows: the stride matters
    assert not torch.equal(s1, full.chunk(2)[1])


def test_split_dims_and_unknown_name():
    assert tp_split_dim("embedding.word_embeddings.weight") == 0
    assert tp_split_dim("decoder.layers.3.self_attention.linear_proj.weight") == 1
    assert tp_split_dim("decoder.layers.3.input_layernorm.weight") is None
    with pytest.raises(KeyError, match="no TP split rule"):
        tp_split_dim("decoder.layers.0.mystery.weight")


def test_layer_names_follow_pp_offsets():
    assert global_name("decoder.layers.1.mlp.linear_fc2.weight", 1, 2) == \
        "decoder.layers.3.mlp.linear_fc2.weight"
    assert local_name("decoder.layers.3.mlp.linear_fc2.weight", 2) == \
        (1, "decoder.layers.1.mlp.linear_fc2.weight")
    assert local_name("output_layer.weight", 2) == (None, "output_layer.weight")
