"""The tensor table: hand-checked rows, TE-spec names that describe the same bytes as the
local spec's, and Megatron-Core's own record of the TE renames."""

import pytest

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import enumerate_layouts
from earl_megatron.plan.tensor_table import TE_RENAMES, num_parameters, tensor_table
from earl_megatron.runtime.switcher import plan_names

CFGS = [ModelConfig.tiny("llama"), ModelConfig.tiny("qwen2", tie_word_embeddings=True),
        ModelConfig.tiny("qwen3", kv_channels=12)]


def test_rows_by_hand():
    t = tensor_table(ModelConfig.tiny("qwen2"))   # h=64 f=128 8 heads 4 groups d=8 vocab 128
    qkv = t.row("decoder.layers.2.self_attention.linear_qkv.weight")
    assert (qkv.shape, qkv.split_dim, qkv.stride, qkv.layer) == ((128, 64), 0, 1, 2)
    assert t.row("decoder.layers.2.self_attention.linear_qkv.bias").shape == (128,)
    fc1 = t.row("decoder.layers.0.mlp.linear_fc1.weight")
    assert (fc1.shape, fc1.stride, fc1.combine) == ((256, 64), 2, "fc1")
    assert fc1.tp_rows(1, 2) == ((64, 128), (192, 256))        # [gate_1; up_1]
    assert t.row("decoder.layers.0.mlp.linear_fc2.weight").split_dim == 1
    norm = t.row("decoder.layers.1.pre_mlp_layernorm.weight")
    assert norm.split_dim is None and norm.te_name == \
        "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"
    assert t.row(norm.te_name) is norm
    # 4 layers x (128*64 + 128 + 64*64 + 256*64 + 64*128 + 2*64) + 64 + 2 * 128*64
    assert num_parameters(t.cfg) == 4 * (8192 + 128 + 4096 + 16384 + 8192 + 128) + 64 + 16384
    with pytest.raises(KeyError, match="add it to plan/tensor_table.py"):
        t.row("decoder.layers.0.mystery.weight")


def test_qwen3_q_and_k_norms_per_head():
    t = tensor_table(CFGS[2])          # h=64, 8 heads of head_dim 12 (96 != 64), 4 groups
    for x in "qk":
        norm = t.row(f"decoder.layers.3.self_attention.{x}_layernorm.weight")
        assert (norm.shape, norm.split_dim, norm.layer, norm.te_name) == (
            (12,), None, 3, norm.name)                    # same name in the TE spec
        assert norm.tp_rows(1, 2) == ((0, 12),)           # replicated on every tp rank
    assert t.row("decoder.layers.0.self_attention.linear_qkv.weight").shape == (96 + 96, 64)
    assert t.row("decoder.layers.0.self_attention.linear_proj.weight").shape == (64, 96)
    # 4 layers x (192*64 + 64*96 + 2*12 + 256*64 + 64*128 + 2*64) + 64 + 2 * 128*64
    assert num_parameters(t.cfg) == 4 * (12288 + 6144 + 24 + 16384 + 8192 + 128) + 64 + 16384


def test_tied_output_layer():
    t = tensor_table(CFGS[1])
    out = t.row("output_layer.weight")
    assert out.tied_to == "embedding.word_embeddings.weight" and out.hf == ()
    assert out not in t.full_rows
    assert out not in t.on_pp_stage(0, 1)              # pp 1: the embedding itself
    assert out in t.on_pp_stage(1, 2)                  # pp 2: a replica on the last pp_stage
    assert t.source_of("output_layer.weight", 1, 2).name == "embedding.word_embeddings.weight"


@pytest.mark.parametrize("cfg", CFGS, ids=["llama", "qwen2_tied", "qwen3"])
def test_te_and_local_spec_describe_the_same_bytes_on_every_rank(cfg):
    """Per pp_stage of every layout, the parameters named the TE way and the local way map to
    the same rows and plan names: the same elements, shapes and placement."""
    table = tensor_table(cfg)
    layouts = enumerate_layouts(8, cfg)
    for lay in layouts:
        for pp_rank in range(lay.pp):
            rows = table.on_pp_stage(pp_rank, lay.pp)
            local = [r.local_name(lay.pp, cfg.num_layers) for r in rows]
            te = [r.local_name(lay.pp, cfg.num_layers, te=True) for r in rows]
            # the two pre-norms of every layer are renamed, nothing else
            layers = {r.layer for r in rows if r.layer is not None}
            assert len(set(te)) == len(te)
            assert sum(a != b for a, b in zip(te, local)) == 2 * len(layers)
            by_local = plan_names(cfg, lay, pp_rank, local)
            by_te = plan_names(cfg, lay, pp_rank, te)
            assert list(by_local.values()) == list(by_te.values()) == local
            for a, b in zip(local, te):
                ra, rb = (table.source_of(n, pp_rank, lay.pp) for n in (a, b))
                assert ra is rb and ra.local_numel(lay.tp) == rb.local_numel(lay.tp)
            assert sum(table.source_of(n, pp_rank, lay.pp).local_numel(lay.tp) for n in te) \
                == table.elements_on(pp_rank, lay.tp, lay.pp)
    assert len(layouts) > 5


def test_te_renames_are_megatrons_own():
    """Megatron-Core's local spec declares the keys its norms take in the TE layout (so that
    checkpoints of both specs agree): they are the table's TE names."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    keys_map = get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map
    for local, te in TE_RENAMES.items():
        prefix = local.split(".")[0] + "."
        assert keys_map[prefix] + local[len(prefix):] == te


def test_preset_parameter_counts_are_the_published_ones():
    """plan/presets.py's comments: each model's published parameter count (Qwen3-8B with its
    q/k norms and head_dim 128)."""
    from earl_megatron.plan.presets import PRESETS

    assert {n: num_parameters(m) for n, m in PRESETS.items()} == {
        "qwen2.5-7b": 7_615_616_512, "qwen2.5-72b": 72_706_203_648,
        "llama3-8b": 8_030_261_248, "qwen3-8b": 8_190_735_360, "tiny": 164_416,
        "qwen3-30b-a3b": 30_532_122_624}


MOE = ModelConfig.tiny("qwen3_moe")    # h=64, 4 experts of width 32, top 2, q/k norms


def test_moe_rows_by_hand():
    t = tensor_table(MOE)
    router = t.row("decoder.layers.1.mlp.router.weight")
    assert (router.shape, router.split_dim, router.expert, router.hf) == (
        (4, 64), None, None, ("model.layers.1.mlp.gate.weight",))
    fc1 = t.row("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight")
    assert (fc1.shape, fc1.split_dim, fc1.stride, fc1.expert, fc1.combine) == (
        (64, 64), 0, 2, 3, "fc1")
    assert fc1.hf == ("model.layers.1.mlp.experts.3.gate_proj.weight",
                      "model.layers.1.mlp.experts.3.up_proj.weight")
    assert fc1.te_name == "decoder.layers.1.mlp.experts.linear_fc1.weight3"
    assert t.row(fc1.te_name) is fc1
    fc2 = t.row("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight")
    assert (fc2.shape, fc2.split_dim, fc2.hf) == (
        (64, 32), 1, ("model.layers.1.mlp.experts.3.down_proj.weight",))
    with pytest.raises(KeyError):
        t.row("decoder.layers.0.mlp.linear_fc1.weight")      # no dense MLP in an MoE layer
    attn = 128 * 64 + 64 * 64 + 2 * 8 + 2 * 64               # qkv, proj, q/k norms, 2 norms
    experts = 4 * (64 * 64 + 64 * 32)
    assert num_parameters(MOE) == 4 * (attn + 4 * 64 + experts) + 64 + 2 * 128 * 64
    assert t.expert_elements() == 4 * experts
    assert t.active_elements() == num_parameters(MOE) - 4 * experts // 2   # top 2 of 4


def test_moe_rows_held_named_and_counted_per_rank():
    """Every rank of every MoE layout holds its pp_stage's dense rows and its ep rank's experts,
    under local names that map back to the global rows; the per-rank element count is
    ``elements_on``'s; each expert is held by exactly etp x edp ranks of its pp_stage."""
    from earl_megatron.plan.layout import ParallelLayout

    t = tensor_table(MOE)
    layouts = enumerate_layouts(8, MOE, expert_tp="both")
    assert ParallelLayout(ep=4, tp=2, dp=4) in layouts
    for lay in layouts:
        holders: dict[str, int] = {}
        for r in range(lay.world_size):
            rows = t.held_on(lay, r)
            names = [t.name_on(row, lay) for row in rows]
            assert len(set(names)) == len(names)
            assert [t.source_on(n, lay, r) for n in names] == [
                t.row(row.tied_to) if row.tied_to else row for row in rows]
            mine = lay.experts_of(lay.expert_coords(r).ep, 4)
            assert {row.expert for row in rows if row.expert is not None} <= set(mine)
            assert sum(row.local_numel(row.tp_of(lay)) for row in rows) == t.elements_on(
                lay.coords(r).pp, lay.tp, lay.pp, lay.ep, lay.expert_tp)
            for row in rows:
                holders[row.name] = holders.get(row.name, 0) + 1
        for row in t.full_rows:
            if row.expert is not None:
                assert holders[row.name] == lay.world_size // lay.pp // lay.ep, (lay, row.name)
