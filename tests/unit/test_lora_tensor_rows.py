"""The tensor table's LoRA rows (plan/tensor_table.py): each targeted linear's A and B, split as
models/lora.py splits them, and the wrapped base's live names mapped to the base's row (single
process, no model)."""

from dataclasses import replace

import torch

from earl_megatron.config.lora import LoraSpec
from earl_megatron.models.lora import _slice
from earl_megatron.models.sharding import reference_weights
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.tensor_table import num_parameters, tensor_table
from earl_megatron.runtime.switcher import plan_names
from earl_megatron.testing.configs import tiny_connect_four
from earl_megatron.weights.hf_mapping import rules


def _cfg(tmp_path, **lora):
    base = tiny_connect_four(str(tmp_path)).model
    return base, replace(base, lora=LoraSpec(rank=4, alpha=8, **lora))


def test_adapter_rows_follow_their_base(tmp_path):
    base, cfg = _cfg(tmp_path)
    h, f, n = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim
    table = tensor_table(cfg)
    adapters = [r for r in table.rows if r.adapter]
    assert len(adapters) == 8 * n   # A and B of 4 linears per layer
    # the docs' tiny model: 152,128 base parameters + 13,312 adapter elements at rank 4
    assert num_parameters(base) == 152_128 and num_parameters(cfg) == 152_128 + 13_312
    layer = "decoder.layers.1."
    for linear, out, inp, split_a, split_b, stride in (
            ("self_attention.linear_qkv", qkv, h, None, 0, 1),
            ("self_attention.linear_proj", h, h, 1, None, 1),
            ("mlp.linear_fc1", 2 * f, h, None, 0, 2),
            ("mlp.linear_fc2", h, f, 1, None, 1)):
        a, b = table.row(f"{layer}{linear}.lora_a"), table.row(f"{layer}{linear}.lora_b")
        assert (a.shape, a.split_dim) == ((4, inp), split_a)
        assert (b.shape, b.split_dim) == ((out, 4), split_b)
        assert (a.stride if split_a is not None else b.stride) == stride and a.layer == b.layer == 1
        assert a.hf == b.hf == () and a.combine == b.combine == "lora"
        # the live name of the wrapped base is the base's row
        assert table.row(f"{layer}{linear}.base.weight") is table.row(f"{layer}{linear}.weight")
        # each tp rank's rows (the plan's view) are the rows LoraLinear keeps (its _slice)
        for row, split in ((a, split_a), (b, split_b)):
            full = torch.arange(row.numel).reshape(row.shape)
            for tp_rank in range(2):
                mine = torch.cat([full.narrow(split or 0, s, e - s)
                                  for s, e in row.tp_rows(tp_rank, 2)], dim=split or 0)
                want = full if split is None else _slice(full, split, row.stride, tp_rank, 2)
                assert torch.equal(mine, want), (row.name, tp_rank)
    # model order: LoraLinear's base.weight, lora_a, lora_b
    names = [r.name for r in table.rows]
    i = names.index(f"{layer}mlp.linear_fc1.weight")
    assert names[i + 1:i + 3] == [f"{layer}mlp.linear_fc1.lora_a", f"{layer}mlp.linear_fc1.lora_b"]
    # HF mapping and the deterministic weights know the base only (adapters are drawn by seed)
    assert rules(cfg) == rules(base)
    ref, ref_base = reference_weights(cfg), reference_weights(base)
    assert ref.keys() == ref_base.keys() and all(torch.equal(ref[k], ref_base[k]) for k in ref)


def test_plan_names_of_a_lora_rank_on_pp2(tmp_path):
    _, cfg = _cfg(tmp_path, targets=("linear_qkv", "linear_fc2"))
    cfg = replace(cfg, add_qkv_bias=True)
    table = tensor_table(cfg)
    assert len([r for r in table.rows if r.adapter]) == 4 * cfg.num_layers
    assert not any(r.adapter for r in table.rows if "linear_proj" in r.name or "fc1" in r.name)
    lay = ParallelLayout.parse("pp2")
    live = ["decoder.layers.0.self_attention.linear_qkv.base.weight",
            "decoder.layers.0.self_attention.linear_qkv.base.bias",
            "decoder.layers.1.self_attention.linear_qkv.lora_b",
            "decoder.layers.1.mlp.linear_fc2.lora_a"]
    # pp rank 1 holds layers 2, 3 under local indices 0, 1; the plan names the base by its row
    assert plan_names(cfg, lay, 1, live) == {
        live[0]: "decoder.layers.0.self_attention.linear_qkv.weight",
        live[1]: "decoder.layers.0.self_attention.linear_qkv.bias", live[2]: live[2],
        live[3]: live[3]}
    assert table.global_name(live[3], 1, 2) == "decoder.layers.3.mlp.linear_fc2.lora_a"
    held = {r.name for r in table.held_on(lay, 1)}
    assert "decoder.layers.3.mlp.linear_fc2.lora_b" in held
    assert "decoder.layers.1.mlp.linear_fc2.lora_b" not in held
