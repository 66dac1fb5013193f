"""A LoRA checkpoint exported with `earl convert mcore-to-hf` loads with ``peft`` onto the
original HF model and computes the Megatron model's logits (issue #46 item 5).

One 2-rank launch: tiny Llama (8 heads in 4 KV groups, so the qkv rows interleave per group),
rank 4 on all four linears, alpha 8, every B filled from a seed (a fresh adapter has B = 0 and
would change nothing), built from the same weights on tp2 and on pp2, and the tiny Qwen3-MoE
with adapters on its attention (experts carry none) on tp2 (sequence parallel); each model's
logits through Megatron's schedule and its checkpoint. Then, in this process,
tools/convert_mcore_to_hf exports each checkpoint as a PEFT adapter and ``--merged``
(earl_megatron/testing/peft_check.py):

- ``PeftModel.from_pretrained(base, OUT)``'s logits equal the Megatron model's (1e-4), and
  differ from the base's by far more, so the adapters are really applied; every adapter tensor
  PEFT holds is the file's, bit-exact; Llama's tp2 and pp2 adapter files are equal bit-exact;
- the merged HF model's logits equal them too (1e-4);
- adapter_config.json: r, lora_alpha, the seven HF module names, and base_model_name_or_path
  from the run's resolved.json (run.init) or ``--base-model``, which AutoPeftModelForCausalLM
  follows to the base.
"""

import json

import pytest
import torch

from earl_megatron.testing.multiproc import run_distributed

TOL = 1e-4
RUNS = (("llama", "tp2"), ("llama", "pp2"), ("qwen3_moe", "tp2"))
MODULES = {"llama": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
           "qwen3_moe": ["k_proj", "o_proj", "q_proj", "v_proj"]}


def _cfg(family):
    from earl_megatron.config.lora import LoraSpec
    from earl_megatron.testing.tiny_models import tiny_model

    targets = ("linear_qkv", "linear_proj") if family == "qwen3_moe" else None
    return tiny_model(family, lora=LoraSpec(rank=4, alpha=8, **({"targets": targets}
                                                                 if targets else {})))


def _tokens():
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))


def _save(root):
    import torch.distributed as dist

    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.checkpoint import save_checkpoint
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.testing.logits import megatron_logits
    from earl_megatron.testing.peft_check import fill_adapters

    out = {}
    with cpu_backend():
        for family, name in RUNS:
            cfg = _cfg(family)
            lay = ParallelLayout.parse(name, world_size=dist.get_world_size(), model=cfg)
            mol = build_on_layout(cfg, lay, weights=reference_weights(cfg.base, seed=7),
                                  ddp=False, seed=11)
            fill_adapters(mol.model)
            got = megatron_logits(mol, _tokens())
            path = save_checkpoint(mol, f"{root}/{family}_{name}/checkpoints", 0,
                                   {"iteration": 0})
            out[family, name] = (str(path), None if got is None else got[1])
    return out


@pytest.mark.timeout(600)
def test_peft_loads_the_exported_adapter_with_megatrons_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.testing.peft_check import exported_logits
    from earl_megatron.weights.hf_io import write_hf_dir
    from earl_megatron.weights.hf_mapping import to_hf, to_hf_config

    results = run_distributed(_save, 2, str(tmp_path), timeout=400)
    files = {}
    for family, name in RUNS:
        cfg = _cfg(family)
        hf_dir = tmp_path / f"base_{family}"
        if not hf_dir.exists():
            write_hf_dir(hf_dir, to_hf(cfg.base, reference_weights(cfg.base, seed=7)),
                         to_hf_config(cfg.base))
        run = tmp_path / f"{family}_{name}"
        if name == "tp2":   # the run record a trainer writes: run.init names the HF base
            (run / "resolved.json").write_text(json.dumps({"run": {"init": str(hf_dir)}}))
        ckpt = next(r[family, name][0] for r in results)
        megatron = next(r[family, name][1] for r in results if r[family, name][1] is not None)
        got, files[family, name], conf = exported_logits(
            ckpt, run, hf_dir, _tokens(), base_model=str(hf_dir) if name == "pp2" else None,
            auto=name == "tp2")

        assert (conf["peft_type"], conf["task_type"], conf["r"], conf["lora_alpha"]) == \
            ("LORA", "CAUSAL_LM", 4, 8), conf
        assert conf["target_modules"] == MODULES[family] and \
            conf["base_model_name_or_path"] == str(hf_dir), conf
        assert len(files[family, name]) == 4 * len(MODULES[family]) * 2  # layers x modules x 2
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in \
            files[family, name]
        with torch.no_grad():
            base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
            adapter_effect = (megatron - base(_tokens()).logits).abs().max().item()
        gaps = {k: f"{(v - megatron).abs().max().item():.2g}" for k, v in got.items()}
        print(f"{family} {name}: |logits - Megatron's| {gaps}; adapters move the logits by "
              f"{adapter_effect:.3g}")
        assert all(float(g) < TOL for g in gaps.values()), (family, name, gaps)
        assert adapter_effect > 100 * TOL, adapter_effect
    tp2, pp2 = files["llama", "tp2"], files["llama", "pp2"]
    assert tp2.keys() == pp2.keys() and all(torch.equal(v, pp2[k]) for k, v in tp2.items())
