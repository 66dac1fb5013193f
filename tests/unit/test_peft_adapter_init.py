"""A PEFT adapter as run.init, in one process (weights/peft_import.py): the fused adapter of each
Megatron linear computes, module by module, what PEFT's adapters compute; this project's own
exports come back at their rank, bit-exact; run.init=ADAPTER gives the base's model with the
adapter's model.lora; each unsupported adapter is one error naming the fix.

The adapter is made by ``peft`` itself on a tiny Llama saved with transformers (8 heads in 4 KV
groups, so linear_qkv's rows interleave per group), with ``init_lora_weights=False`` (B is not
zero) on q, v, o, gate, up and down: k_proj has none, and q and v (gate and up) have A's of their
own, as PEFT draws them.
"""

import json

import pytest
import torch

from earl_megatron.config.checks import ConfigError

MODULES = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from earl_megatron.testing.peft_check import peft_adapter
    from earl_megatron.testing.tiny_models import tiny_model

    cfg = tiny_model("llama")
    return (cfg, *peft_adapter(tmp_path_factory.mktemp("peft"), cfg, MODULES))


def _tensors(adapter_dir):
    from safetensors.torch import load_file
    return load_file(adapter_dir / "adapter_model.safetensors")


def test_the_fused_adapters_compute_what_peft_computes(made):
    from earl_megatron.weights import hf_mapping as hfm
    from earl_megatron.weights.peft_export import PEFT_PREFIX, adapted_linears
    from earl_megatron.weights.peft_import import fused, read_adapter

    cfg, base, adapter_dir = made
    adapter = read_adapter(adapter_dir)
    assert (adapter.base, adapter.r, adapter.alpha) == (base, 4, 8.0)
    tensors = _tensors(adapter_dir)
    spec, full = fused(adapter, cfg, tensors)
    # q and v (gate and up) bring A's of their own: stacked, rank 2 x 4; every linear padded to it
    assert (spec.rank, spec.alpha, spec.scaling) == (8, 16.0, 2.0)
    assert spec.targets == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    for lin in adapted_linears(cfg.with_(lora=spec)):
        a, b = full[lin.base.name[:-len(".weight")]]
        assert a.shape[0] == b.shape[1] == 8
        xin = torch.randn(3, a.shape[1], generator=torch.Generator().manual_seed(1))
        ours = hfm.split(lin.base, cfg, (xin @ a.T @ b.T).T)   # per HF module, [rows, 3]
        for hf_name, got in ours.items():
            m = PEFT_PREFIX + hf_name[:-len(".weight")]
            want = (tensors[m + ".lora_B.weight"] @ tensors[m + ".lora_A.weight"] @ xin.T
                    if m + ".lora_A.weight" in tensors else torch.zeros_like(got))
            assert torch.allclose(got, want, atol=1e-6), hf_name


def test_an_exported_adapter_comes_back_at_its_rank_bit_exact(made, tmp_path):
    from earl_megatron.config.lora import LoraSpec
    from earl_megatron.weights.peft_export import adapted_linears, peft_tensors, write_peft
    from earl_megatron.weights.peft_import import fused, read_adapter

    cfg, base, _ = made
    spec = LoraSpec(rank=4, alpha=8, targets=("linear_qkv", "linear_fc2"))
    gen = torch.Generator().manual_seed(2)
    ours, tensors = {}, {}
    for lin in adapted_linears(cfg.with_(lora=spec)):
        a, b = torch.randn(*lin.a.shape, generator=gen), torch.randn(*lin.b.shape, generator=gen)
        ours[lin.base.name[:-len(".weight")]] = (a, b)
        tensors.update(peft_tensors(lin, cfg, a, b))
    write_peft(tmp_path, cfg.with_(lora=spec), tensors, str(base))
    got_spec, got = fused(read_adapter(tmp_path), cfg, tensors)
    assert got_spec == spec
    assert got.keys() == ours.keys()
    assert all(torch.equal(got[k][0], a) and torch.equal(got[k][1], b)
               for k, (a, b) in ours.items())


def test_an_moe_adapter_on_the_attention_comes_back_and_one_on_experts_is_refused(tmp_path):
    from earl_megatron.config.lora import LoraSpec
    from earl_megatron.testing.tiny_models import tiny_model
    from earl_megatron.weights.peft_export import adapted_linears, peft_tensors, write_peft
    from earl_megatron.weights.peft_import import fused, read_adapter

    cfg = tiny_model("qwen3_moe")
    spec = LoraSpec(rank=2, alpha=4, targets=("linear_qkv", "linear_proj"))
    gen = torch.Generator().manual_seed(4)
    tensors = {}
    for lin in adapted_linears(cfg.with_(lora=spec)):
        tensors.update(peft_tensors(lin, cfg, torch.randn(*lin.a.shape, generator=gen),
                                    torch.randn(*lin.b.shape, generator=gen)))
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    write_peft(tmp_path, cfg.with_(lora=spec), tensors, str(tmp_path / "base"))
    assert fused(read_adapter(tmp_path), cfg, tensors)[0] == spec
    expert = "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight"
    with pytest.raises(ValueError, match="experts excepted"):
        fused(read_adapter(tmp_path), cfg, dict(tensors, **{expert: torch.zeros(2, 64)}))


def test_run_init_takes_the_base_and_the_adapters_lora(made):
    from earl_megatron.train import apply_run_init

    cfg, base, adapter_dir = made
    d = apply_run_init({"model": {"lora": {"rank": 0}}, "run": {"init": str(adapter_dir)}},
                       ())
    assert d["model"]["hidden_size"] == cfg.hidden_size
    assert d["model"]["lora"]["rank"] == 8 and d["model"]["lora"]["alpha"] == 16.0
    with pytest.raises(ConfigError, match="differs from the PEFT adapter"):
        apply_run_init({"model": {"lora": {"rank": 16}}, "run": {"init": str(adapter_dir)}},
                       ("model.lora.rank",))


@pytest.mark.parametrize("change,match", [
    ({"use_dora": True}, "use_dora"),
    ({"peft_type": "IA3"}, "only LoRA adapters"),
    ({"base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M"}, "not a local model directory"),
    ({"layers_to_transform": [0]}, "layers_to_transform"),
])
def test_an_adapter_lora_here_cannot_compute_is_one_error(made, tmp_path, change, match):
    import shutil

    from earl_megatron.train import init_config

    _, _, adapter_dir = made
    bad = tmp_path / "adapter"
    shutil.copytree(adapter_dir, bad)
    conf = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**conf, **change}))
    with pytest.raises(ConfigError, match=match) as e:
        init_config(str(bad))
    assert str(e.value).startswith(f"run.init={bad}: ") and "\n" not in str(e.value)


def test_tensors_lora_here_cannot_place_are_refused(made, tmp_path):
    import shutil

    from safetensors.torch import save_file

    from earl_megatron.weights.peft_import import fused, read_adapter

    cfg, _, adapter_dir = made
    bad = tmp_path / "adapter"
    shutil.copytree(adapter_dir, bad)
    tensors = _tensors(adapter_dir)
    head = dict(tensors, **{"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)})
    with pytest.raises(ValueError, match="lm_head"):
        fused(read_adapter(bad), cfg, head)
    layer0 = {k: v for k, v in tensors.items() if "layers.0." in k or "o_proj" not in k}
    with pytest.raises(ValueError, match=r"\['linear_proj'\] in some layers only"):
        fused(read_adapter(bad), cfg, layer0)
    (bad / "adapter_model.safetensors").unlink()
    save_file({}, str(bad / "adapter_model.bin"))
    with pytest.raises(ValueError, match="safetensors"):
        read_adapter(bad)
