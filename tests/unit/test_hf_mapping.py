"""HF <-> Megatron-Core mapping (pure) and safetensors directory I/O, in one process."""

import json

import pytest
import torch

from earl_megatron.config.model import ModelConfig
from earl_megatron.weights import hf_mapping as hfm
from earl_megatron.weights.hf_io import HFCheckpointError, HFCheckpoint, read_header, write_hf_dir
from earl_megatron.models.sharding import reference_weights, shard
from earl_megatron.plan.tensor_table import tensor_table


def _rows(values, width=3):
    """A [len(values), width] tensor whose row i is filled with values[i]."""
    return torch.tensor(values, dtype=torch.float32)[:, None].expand(-1, width).contiguous()


# ----------------------------------------------------------------------------- table
def test_table_llama_untied_and_qwen2_tied():
    llama = hfm.rules(ModelConfig.tiny("llama", num_layers=2))
    # embedding + 6 per layer + final norm + output layer
    assert len(llama) == 1 + 6 * 2 + 1 + 1
    by = {r.name: r for r in llama}
    qkv = by["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert (qkv.hf, qkv.combine) == (
        ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
         "model.layers.1.self_attn.v_proj.weight"), "qkv")
    assert by["decoder.layers.0.pre_mlp_layernorm.weight"].hf == (
        "model.layers.0.post_attention_layernorm.weight",)
    assert by["decoder.layers.0.mlp.linear_fc1.weight"].hf == (
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")
    assert by["output_layer.weight"].hf == ("lm_head.weight",)
    assert "decoder.layers.0.self_attention.linear_qkv.bias" not in by

    qwen = ModelConfig.tiny("qwen2", num_layers=2, tie_word_embeddings=True)
    names = {r.name for r in hfm.rules(qwen)}
    assert "output_layer.weight" not in names
    assert "decoder.layers.1.self_attention.linear_qkv.bias" in names
    shapes = hfm.hf_shapes(qwen)
    assert "lm_head.weight" not in shapes
    # tiny: 8 heads x head_dim 8 = 64 q rows, 4 KV groups x 8 = 32 k rows
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (64, 64)
    assert shapes["model.layers.0.self_attn.k_proj.bias"] == (32,)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 128)


def test_table_qwen3_qk_norms_and_head_dim_apart_from_hidden():
    # hidden 48, 6 heads of head_dim 16 (6 * 16 = 96 != 48), 2 KV heads
    cfg = ModelConfig.tiny("qwen3", num_layers=2, hidden_size=48, num_attention_heads=6,
                           num_query_groups=2, kv_channels=16)
    assert (cfg.qk_layernorm, cfg.add_qkv_bias, cfg.head_dim) == (True, False, 16)
    by = {r.name: r for r in hfm.rules(cfg)}
    assert len(by) == 1 + 8 * 2 + 1 + 1          # + q_norm and k_norm per layer
    for x in "qk":
        norm = by[f"decoder.layers.1.self_attention.{x}_layernorm.weight"]
        assert (norm.hf, norm.shape, norm.split_dim, norm.combine, norm.te_name) == (
            (f"model.layers.1.self_attn.{x}_norm.weight",), (16,), None, "copy", norm.name)
    assert "decoder.layers.0.self_attention.linear_qkv.bias" not in by
    assert by["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (96 + 2 * 32, 48)
    shapes = hfm.hf_shapes(cfg)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (96, 48)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (48, 96)
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == (16,)


# ----------------------------------------------------------------------------- transforms
def test_qkv_rows_grouped_per_kv_group():
    # 4 query heads in 2 KV groups, head_dim 1: q heads 0,1 belong to group 0, 2,3 to group 1
    cfg = ModelConfig(family="qwen2", hidden_size=4, num_attention_heads=4, num_query_groups=2,
                      num_layers=1, ffn_hidden_size=4, vocab_size=8, add_qkv_bias=True)
    rule = tensor_table(cfg).row("decoder.layers.0.self_attention.linear_qkv.weight")
    q, k, v = _rows([0, 1, 2, 3], 4), _rows([10, 11], 4), _rows([20, 21], 4)
    qkv = hfm.combine(rule, cfg, [q, k, v])
    assert qkv[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    bias_rule = tensor_table(cfg).row("decoder.layers.0.self_attention.linear_qkv.bias")
    bias = hfm.combine(bias_rule, cfg, [q[:, 0], k[:, 0], v[:, 0]])
    assert bias.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    back = hfm.split(rule, cfg, qkv)
    assert torch.equal(back[rule.hf[0]], q) and torch.equal(back[rule.hf[2]], v)
    # tp rank 1 of 2 reads only group 1: q rows 2..4, k and v row 1
    assert hfm.sources(rule, cfg, 1, 2) == [
        hfm.SourceSlice(rule.hf[0], 0, 2, 4), hfm.SourceSlice(rule.hf[1], 0, 1, 2),
        hfm.SourceSlice(rule.hf[2], 0, 1, 2)]


def test_fc1_is_gate_then_up_and_tp_rank_holds_both_halves():
    cfg = ModelConfig(hidden_size=4, num_attention_heads=2, num_query_groups=2, num_layers=1,
                      ffn_hidden_size=4, vocab_size=8)
    rule = tensor_table(cfg).row("decoder.layers.0.mlp.linear_fc1.weight")
    gate, up = _rows([0, 1, 2, 3], 4), _rows([10, 11, 12, 13], 4)
    assert hfm.combine(rule, cfg, [gate, up])[:, 0].tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    parts = [_read({"g": gate, "u": up}, s, rename={rule.hf[0]: "g", rule.hf[1]: "u"})
             for s in hfm.sources(rule, cfg, 1, 2)]
    assert hfm.combine(rule, cfg, parts)[:, 0].tolist() == [2, 3, 12, 13]


def _read(tensors, src, rename=None):
    t = tensors[(rename or {}).get(src.hf_name, src.hf_name)]
    if src.dim is None:
        return t
    return t.narrow(src.dim, src.start, src.stop - src.start)


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", True), ("qwen3", False),
                                         ("qwen3", True), ("qwen3_moe", False)])
def test_sources_give_exactly_the_tp_shard_and_split_inverts(family, tied):
    cfg = ModelConfig.tiny(family, num_layers=2, tie_word_embeddings=tied,
                           **({"kv_channels": 12} if family == "qwen3" else {}))
    hf = hfm.to_hf(cfg, reference_weights(cfg, seed=3))
    assert set(hf) == set(hfm.hf_shapes(cfg))
    assert all(tuple(hf[n].shape) == s for n, s in hfm.hf_shapes(cfg).items())
    full = hfm.to_megatron(cfg, hf)
    assert set(full) == set(reference_weights(cfg))
    for name, t in hfm.to_hf(cfg, full).items():
        assert torch.equal(t, hf[name]), name
    for tp in (1, 2, 4):
        for rule in hfm.rules(cfg):
            for r in range(tp):
                got = hfm.combine(rule, cfg, [_read(hf, s) for s in hfm.sources(rule, cfg, r, tp)])
                assert torch.equal(got, shard(rule, full[rule.name], r, tp)), (rule, tp, r)


# ----------------------------------------------------------------------------- configs
def _hf_llama_dict(**changes):
    d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256,
         "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
         "tie_word_embeddings": False, "hidden_act": "silu", "dtype": "bfloat16"}
    d.update(changes)
    return d


_HF_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
           "num_experts": 8, "moe_intermediate_size": 32, "num_experts_per_tok": 2,
           "norm_topk_prob": True, "router_aux_loss_coef": 0.01, "decoder_sparse_step": 1,
           "mlp_only_layers": [], "output_router_logits": True, "head_dim": 8}


def test_moe_config_parsing_both_expert_count_keys_and_round_trip():
    cfg = hfm.from_hf_config(_hf_llama_dict(**_HF_MOE))
    assert (cfg.family, cfg.num_experts, cfg.moe_ffn_hidden_size, cfg.moe_router_topk,
            cfg.moe_norm_topk_prob, cfg.moe_aux_loss_coeff, cfg.qk_layernorm) == (
        "qwen3_moe", 8, 32, 2, True, 0.01, True)
    # transformers 5 saves the expert count as num_local_experts (the hub says num_experts)
    saved = _hf_llama_dict(**{k: v for k, v in _HF_MOE.items() if k != "num_experts"},
                           num_local_experts=8)
    assert hfm.from_hf_config(saved) == cfg
    # norm_topk_prob absent: transformers' default, false
    plain = {k: v for k, v in _HF_MOE.items() if k != "norm_topk_prob"}
    assert not hfm.from_hf_config(_hf_llama_dict(**plain)).moe_norm_topk_prob
    for base in (None, saved):
        hf = hfm.to_hf_config(cfg, base=base)
        assert (hf["model_type"], hf["architectures"], hf["num_experts"],
                hf["moe_intermediate_size"], hf["num_experts_per_tok"], hf["norm_topk_prob"],
                hf["router_aux_loss_coef"], hf["mlp_only_layers"], hf["decoder_sparse_step"]) \
            == ("qwen3_moe", ["Qwen3MoeForCausalLM"], 8, 32, 2, True, 0.01, [], 1)
        assert hf.get("num_local_experts", 8) == 8
        assert hfm.from_hf_config(json.loads(json.dumps(hf))) == cfg
    tiny = ModelConfig.tiny("qwen3_moe")
    assert hfm.from_hf_config(hfm.to_hf_config(tiny)) == tiny
    shapes = hfm.hf_shapes(tiny)   # per expert, as the hub stores them
    assert shapes["model.layers.3.mlp.gate.weight"] == (4, 64)
    assert shapes["model.layers.3.mlp.experts.3.gate_proj.weight"] == (32, 64)
    assert shapes["model.layers.3.mlp.experts.3.down_proj.weight"] == (64, 32)
    assert not any(".mlp.up_proj" in n or "gate_up_proj" in n for n in shapes)


def test_config_parsing_new_and_old_rope_keys_and_round_trip():
    cfg = hfm.from_hf_config(_hf_llama_dict())
    assert cfg == ModelConfig(family="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128,
                              num_attention_heads=8, num_query_groups=2, vocab_size=128,
                              max_position_embeddings=256, rotary_base=5e5, norm_epsilon=1e-5,
                              params_dtype="bfloat16")
    old = _hf_llama_dict(rope_theta=1e6, torch_dtype="float32")
    del old["rope_parameters"], old["dtype"]
    assert hfm.from_hf_config(old).rotary_base == 1e6
    assert hfm.from_hf_config(old).params_dtype == "float32"
    # head_dim that is not hidden/heads becomes kv_channels
    assert hfm.from_hf_config(_hf_llama_dict(head_dim=16)).head_dim == 16
    qwen = hfm.from_hf_config({**_hf_llama_dict(), "architectures": ["Qwen2ForCausalLM"],
                               "model_type": "qwen2", "tie_word_embeddings": True})
    assert qwen.add_qkv_bias and qwen.tie_word_embeddings and qwen.family == "qwen2"
    qwen3 = hfm.from_hf_config({**_hf_llama_dict(head_dim=128), "architectures":
                                ["Qwen3ForCausalLM"], "model_type": "qwen3"})
    assert (qwen3.family, qwen3.qk_layernorm, qwen3.add_qkv_bias, qwen3.head_dim) == (
        "qwen3", True, False, 128)
    for c in (cfg, qwen, qwen3, ModelConfig.tiny("llama", kv_channels=16)):
        hf = hfm.to_hf_config(c, base={"bos_token_id": 7, "torch_dtype": "float16"})
        assert hf["bos_token_id"] == 7 and "torch_dtype" not in hf
        assert hf["rope_parameters"]["rope_theta"] == c.rotary_base == hf["rope_theta"]
        assert hfm.from_hf_config(json.loads(json.dumps(hf))) == c


@pytest.mark.parametrize("changes,words", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 4096},
     ["MistralForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM"]),
    ({"architectures": ["MixtralForCausalLM"]}, ["MixtralForCausalLM", "MoE"]),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     ["rope_type='llama3'", "Llama 3.1"]),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True},
     ["Qwen2ForCausalLM", "use_sliding_window"]),
    ({"hidden_act": "gelu"}, ["gelu"]),
    ({"architectures": ["Qwen3ForCausalLM"], "attention_bias": True},
     ["Qwen3ForCausalLM", "attention_bias"]),
    ({"architectures": ["Qwen3ForCausalLM"], "num_experts": 128},
     ["Qwen3ForCausalLM", "mixture of experts", "Qwen3MoeForCausalLM"]),
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128},
     ["Qwen3MoeForCausalLM", "no moe_intermediate_size"]),
    ({**_HF_MOE, "mlp_only_layers": [0]}, ["mlp_only_layers=[0]", "mlp_only_layers=[]"]),
    ({**_HF_MOE, "decoder_sparse_step": 2}, ["decoder_sparse_step=2", "every layer"]),
    ({**_HF_MOE, "shared_expert_intermediate_size": 512},
     ["shared_expert_intermediate_size=512", "shared experts"]),
])
def test_unsupported_architectures_are_named(changes, words):
    with pytest.raises(hfm.UnsupportedModelError) as e:
        hfm.from_hf_config(_hf_llama_dict(**changes))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("cfg,words", [
    (ModelConfig.tiny("qwen3", qk_layernorm=False), ["qwen3", "qk_layernorm=False"]),
    (ModelConfig.tiny("llama", qk_layernorm=True), ["llama", "qk_layernorm=True", "unset"]),
    (ModelConfig.tiny("qwen2", add_qkv_bias=False), ["Qwen2ForCausalLM", "add_qkv_bias=True"]),
])
def test_configs_without_an_hf_architecture_are_refused_on_export(cfg, words):
    with pytest.raises(hfm.UnsupportedModelError) as e:
        hfm.to_hf_config(cfg)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


# ----------------------------------------------------------------------------- files
@pytest.fixture()
def hf_dir(tmp_path):
    cfg = ModelConfig.tiny("qwen2", num_layers=2)
    hf = hfm.to_hf(cfg, reference_weights(cfg, seed=5))
    files = write_hf_dir(tmp_path / "m", hf, hfm.to_hf_config(cfg), max_shard_bytes=40_000)
    return tmp_path / "m", cfg, hf, files


def test_sharded_directory_reads_whole_tensors_and_slices(hf_dir):
    path, cfg, hf, files = hf_dir
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in hf.values())
    ckpt = HFCheckpoint(path)
    ckpt.check_against(hfm.hf_shapes(cfg))
    assert ckpt.names() == sorted(hf)
    name = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(ckpt.read(name), hf[name])
    assert torch.equal(ckpt.read(hfm.SourceSlice(name, 1, 16, 48)), hf[name][:, 16:48])
    assert torch.equal(ckpt.read(hfm.SourceSlice(name, 0, 8, 9)), hf[name][8:9])


def test_missing_shard(hf_dir):
    path, _, _, files = hf_dir
    (path / files[1]).unlink()
    with pytest.raises(HFCheckpointError, match=f"{files[1]}.*do not exist"):
        HFCheckpoint(path)


def test_truncated_shard(hf_dir):
    path, _, _, files = hf_dir
    f = path / files[0]
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(HFCheckpointError, match="truncated shard.*100 missing"):
        HFCheckpoint(path)
    f.write_bytes(data[:5])
    with pytest.raises(HFCheckpointError, match="too short"):
        read_header(f)


def test_tensor_missing_from_index(hf_dir):
    path, cfg, _, _ = hf_dir
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    index_path.write_text(json.dumps(index))
    ckpt = HFCheckpoint(path)  # its shard still holds it, but the index decides
    with pytest.raises(HFCheckpointError,
                       match="up_proj.weight' is missing from model.safetensors"):
        ckpt.check_against(hfm.hf_shapes(cfg))


def test_shape_that_does_not_match_the_config(hf_dir):
    path, cfg, _, _ = hf_dir
    bigger = cfg.with_(ffn_hidden_size=256)
    with pytest.raises(HFCheckpointError, match=r"gate_proj.weight' .* has shape \(128, 64\) but "
                                              r"config.json implies \(256, 64\)"):
        HFCheckpoint(path).check_against(hfm.hf_shapes(bigger))


def test_checkpoint_parts_end_only_where_expert_indices_form_a_box():
    from earl_megatron.weights import dcp_parts as dcp

    fc1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    assert dcp.stack_index("decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.weight") \
        == (3, 2)
    assert dcp.stack_index("decoder.layers.3.mlp.router.weight") == (3,)
    assert dcp.stack_index("embedding.word_embeddings.weight") == ()

    def part(*indices):
        return {f"x{i}": (fc1, i, None) for i in indices}

    # within one layer any expert range is a box; across layers only whole layers are
    assert dcp.closes_boxes(part((0, 1), (0, 2)))
    assert dcp.closes_boxes(part((0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)))
    assert not dcp.closes_boxes(part((0, 0), (0, 1), (0, 2), (0, 3), (1, 0)))
    # a part that began inside layer 0's experts must end before layer 1's
    assert dcp.box_broken_by(part((0, 2), (0, 3)), fc1, (1, 0))
    assert not dcp.box_broken_by(part((0, 0), (0, 3)), fc1, (1, 0))
    assert not dcp.box_broken_by(part((0, 2)), fc1, (0, 3))
    with pytest.raises(AssertionError, match="not a box"):
        dcp.part_state_dict({f"x{i}": (fc1, i, torch.zeros(2, 2))
                             for i in [(0, 2), (0, 3), (1, 0)]})


def test_fused_experts_on_disk_are_refused_naming_the_fix(tmp_path):
    cfg = ModelConfig.tiny("qwen3_moe", num_layers=1)
    hf = hfm.to_hf(cfg, reference_weights(cfg, seed=2))
    p = "model.layers.0.mlp.experts."
    experts = range(cfg.num_experts)
    hf[p + "gate_up_proj"] = torch.stack([torch.cat([hf.pop(f"{p}{e}.gate_proj.weight"),
                                                     hf.pop(f"{p}{e}.up_proj.weight")])
                                          for e in experts])
    hf[p + "down_proj"] = torch.stack([hf.pop(f"{p}{e}.down_proj.weight") for e in experts])
    write_hf_dir(tmp_path / "m", hf, hfm.to_hf_config(cfg))
    with pytest.raises(HFCheckpointError, match="stores experts fused.*save_pretrained"):
        HFCheckpoint(tmp_path / "m").check_against(hfm.hf_shapes(cfg))
