"""A LoRA checkpoint exported with `earl convert mcore-to-hf` loads with ``peft`` onto the
original HF model and computes the Megatron model's logits (issue #46 item 5).

One 2-rank launch: tiny Llama (8 heads in 4 KV groups, so the qkv rows interleave per group),
rank 4 on all four linears, alpha 8, every B filled from a seed (a fresh adapter has B = 0 and
would change nothing), built from the same weights on tp2 and on pp2; each layout's logits
through Megatron's schedule and its checkpoint. Then, in this process, tools/convert_mcore_to_hf
exports each checkpoint as a PEFT adapter and ``--merged``:

- ``PeftModel.from_pretrained(base, OUT)``'s logits equal the Megatron model's (1e-4), and
  differ from the base's by far more, so the adapters are really applied; every adapter tensor
  PEFT holds is the file's, bit-exact; tp2's and pp2's adapter files are equal bit-exact;
- the merged HF model's logits equal them too (1e-4);
- adapter_config.json: r, lora_alpha, the seven HF module names, and base_model_name_or_path
  from the run's resolved.json (run.init) or ``--base-model``, which AutoPeftModelForCausalLM
  follows to the base.
"""

import json
import zlib

import pytest
import torch

from earl_megatron.testing.multiproc import run_distributed

TOL = 1e-4
LAYOUTS = ("tp2", "pp2")
MODULES = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def _cfg():
    from earl_megatron.config.lora import LoraSpec
    from earl_megatron.testing.tiny_models import tiny_model

    return tiny_model("llama", lora=LoraSpec(rank=4, alpha=8))


def _tokens():
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))


def _save(root):
    import torch.distributed as dist

    from earl_megatron.models.lora import lora_layers
    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.checkpoint import save_checkpoint
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.testing.logits import megatron_logits

    cfg = _cfg()
    weights = reference_weights(cfg.base, seed=7)
    out = {}
    with cpu_backend():
        for name in LAYOUTS:
            lay = ParallelLayout.parse(name, world_size=dist.get_world_size(), model=cfg)
            mol = build_on_layout(cfg, lay, weights=weights, ddp=False, seed=11)
            for lname, m in lora_layers(mol.model).items():
                gen = torch.Generator().manual_seed(zlib.crc32(lname.encode()))
                m.load_full(b=torch.randn(m.out_features, cfg.lora.rank, generator=gen) * 0.05)
            got = megatron_logits(mol, _tokens())
            path = save_checkpoint(mol, f"{root}/{name}/checkpoints", 0, {"iteration": 0})
            out[name] = (str(path), None if got is None else got[1])
    return out


def _export(*argv: str) -> None:
    import importlib.util
    from pathlib import Path

    tool = Path(__file__).resolve().parents[2] / "tools" / "convert_mcore_to_hf.py"
    spec = importlib.util.spec_from_file_location("convert_mcore_to_hf", tool)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([*argv, "--no-progress"]) == 0


@pytest.mark.timeout(600)
def test_peft_loads_the_exported_adapter_with_megatrons_logits(tmp_path):
    from peft import AutoPeftModelForCausalLM, PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.weights.hf_io import write_hf_dir
    from earl_megatron.weights.hf_mapping import to_hf, to_hf_config

    cfg = _cfg()
    results = run_distributed(_save, 2, str(tmp_path), timeout=400)
    hf_dir = tmp_path / "base"
    write_hf_dir(hf_dir, to_hf(cfg.base, reference_weights(cfg.base, seed=7)),
                 to_hf_config(cfg.base))
    # the run record a trainer writes beside its checkpoints: run.init names the HF base
    (tmp_path / "tp2" / "resolved.json").write_text(json.dumps({"run": {"init": str(hf_dir)}}))

    def load_base():
        return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    with torch.no_grad():
        base_logits = load_base()(_tokens()).logits
    files = {}
    for name in LAYOUTS:
        ckpt = next(r[name][0] for r in results)
        megatron = next(r[name][1] for r in results if r[name][1] is not None)
        out, merged = tmp_path / f"peft_{name}", tmp_path / f"merged_{name}"
        _export(ckpt, str(out), *(["--base-model", str(hf_dir)] if name == "pp2" else []))
        _export(ckpt, str(merged), "--merged")

        conf = json.loads((out / "adapter_config.json").read_text())
        assert (conf["peft_type"], conf["task_type"], conf["r"], conf["lora_alpha"]) == \
            ("LORA", "CAUSAL_LM", 4, 8), conf
        assert conf["target_modules"] == MODULES and conf["base_model_name_or_path"] == \
            str(hf_dir), conf
        files[name] = load_file(out / "adapter_model.safetensors")
        assert len(files[name]) == 4 * len(MODULES) * 2      # layers x modules x (A, B)
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in files[name]

        peft_model = PeftModel.from_pretrained(load_base(), out).eval()
        held = get_peft_model_state_dict(peft_model)
        assert held.keys() == files[name].keys(), sorted(set(held) ^ set(files[name]))[:4]
        assert all(torch.equal(held[k], v) for k, v in files[name].items())
        with torch.no_grad():
            got = {"peft": peft_model(_tokens()).logits,
                   "merged": AutoModelForCausalLM.from_pretrained(
                       merged, dtype=torch.float32).eval()(_tokens()).logits}
            if name == "tp2":   # base_model_name_or_path leads to the base
                got["auto"] = AutoPeftModelForCausalLM.from_pretrained(
                    out, dtype=torch.float32).eval()(_tokens()).logits
        gaps = {k: (v - megatron).abs().max().item() for k, v in got.items()}
        adapter_effect = (megatron - base_logits).abs().max().item()
        print(f"{name}: |logits - Megatron's| {gaps}; adapters move the logits by "
              f"{adapter_effect:.3g}")
        assert all(g < TOL for g in gaps.values()), (name, gaps)
        assert adapter_effect > 100 * TOL, adapter_effect
    assert files["tp2"].keys() == files["pp2"].keys()
    assert all(torch.equal(v, files["pp2"][k]) for k, v in files["tp2"].items())
