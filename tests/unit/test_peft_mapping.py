"""The PEFT names of a LoRA checkpoint's adapters (weights/peft_export.py), without a model: which
HF modules each target becomes, how qkv's and fc1's B split (the base weight's own mapping, A
shared), the merged weight, adapter_config.json, and the run's recorded base. The export loaded
by ``peft`` against Megatron's logits: tests/distributed/test_peft_export.py."""

import json

import torch

from earl_megatron.config.lora import LoraSpec
from earl_megatron.testing.tiny_models import tiny_model
from earl_megatron.weights import hf_mapping as hfm
from earl_megatron.weights import peft_export as pe
from earl_megatron.weights.peft_import import recorded_base


def test_targets_become_hf_modules():
    cfg = tiny_model("llama", lora=LoraSpec(rank=2))
    assert pe.target_modules(cfg) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                      "up_proj", "v_proj"]
    assert len(pe.adapted_linears(cfg)) == 4 * 4
    attn = tiny_model("qwen3_moe", lora=LoraSpec(rank=2, targets=("linear_qkv", "linear_proj")))
    assert pe.target_modules(attn) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert pe.adapted_linears(tiny_model("llama")) == ()


def test_qkv_and_fc1_split_b_like_the_base_and_share_a():
    cfg = tiny_model("llama", lora=LoraSpec(rank=3, targets=("linear_qkv", "linear_fc1")))
    qkv, fc1 = pe.adapted_linears(cfg)[:2]
    for lin in (qkv, fc1):
        a = torch.randn(lin.a.shape, generator=torch.Generator().manual_seed(1))
        b = torch.randn(lin.b.shape, generator=torch.Generator().manual_seed(2))
        out = pe.peft_tensors(lin, cfg, a, b)
        base_b = hfm.split(lin.base, cfg, b)      # B's rows are the base weight's rows
        assert len(out) == 2 * len(lin.base.hf)
        for hf_name in lin.base.hf:
            m = "base_model.model." + hf_name[:-len(".weight")]
            assert torch.equal(out[m + ".lora_A.weight"], a)
            assert torch.equal(out[m + ".lora_B.weight"], base_b[hf_name])
            # each HF module's update is its rows of the fused update B A
            assert torch.allclose(out[m + ".lora_B.weight"] @ a,
                                  hfm.split(lin.base, cfg, b @ a)[hf_name], atol=1e-6)
        names = [n.rsplit(".", 3)[-3] for n in out if n.endswith("lora_B.weight")]
        assert names == (["q_proj", "k_proj", "v_proj"] if lin is qkv else
                         ["gate_proj", "up_proj"])
    w = torch.ones(4, 3, dtype=torch.bfloat16)
    m = pe.merged(w, torch.full((2, 3), 0.5), torch.ones(4, 2), 2.0)
    assert m.dtype == torch.bfloat16 and torch.equal(m, torch.full((4, 3), 3.0,
                                                                    dtype=torch.bfloat16))


def test_adapter_config_and_recorded_base(tmp_path):
    conf = pe.adapter_config(tiny_model("llama", lora=LoraSpec(rank=8, alpha=16, dropout=0.1,
                                                               targets=("linear_proj",))),
                             "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert {k: conf[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout",
                                 "target_modules", "base_model_name_or_path")} == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16,
        "lora_dropout": 0.1, "target_modules": ["o_proj"],
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    assert isinstance(conf["lora_alpha"], int)
    assert pe.adapter_config(tiny_model("llama", lora=LoraSpec(rank=4, alpha=6.5)),
                             None)["lora_alpha"] == 6.5

    ckpt = tmp_path / "run" / "checkpoints" / "iter_000003"
    ckpt.mkdir(parents=True)
    assert recorded_base(ckpt) is None                         # no resolved.json
    resolved = tmp_path / "run" / "resolved.json"
    for init, want in (("/models/smollm2", "/models/smollm2"), (None, None),
                       (str(tmp_path / "mcore"), None)):  # a Megatron checkpoint: not a base
        resolved.write_text(json.dumps({"run": {"init": init}}))
        (tmp_path / "mcore").mkdir(exist_ok=True)
        (tmp_path / "mcore" / "earl_model_config.json").write_text("{}")
        assert recorded_base(ckpt) == want, init
