"""The LoRA export on the real SmolLM2-135M-Instruct (issue #46 item 5; the tiny models' version,
on tp2 and pp2, is tests/distributed/test_peft_export.py).

One 2-rank launch: SmolLM2 read from its HF directory onto PP2 (its 3 KV groups rule out tp2),
adapters of rank 8, alpha 16 on all four linears with every B filled from a seed, the logits of
two chat conversations through Megatron's schedule, and a trainer-format checkpoint. Then, in
this process, tools/convert_mcore_to_hf exports it as a PEFT adapter and ``--merged``, and
``PeftModel.from_pretrained(SmolLM2, OUT)`` must give Megatron's logits within 1e-4 (fp32;
the base alone is 4.9e-5 from transformers on PP2, docs/conversion.md), while the adapters move
the logits by far more than that. The merged model's weights must be ``W + (alpha / r) B A``
of the base and the adapter file's tensors (1e-5), and its logits within 2e-4: merging is a
float rounding of its own over 30 layers (transformers' merged and unmerged forwards of the
same weights differ by 1.2e-4 here, with logits up to 36.7).
"""

from __future__ import annotations

import pytest
import torch

from earl_megatron.testing.multiproc import run_distributed

TOL = 1e-4
TOL_MERGED = 2e-4
TIMEOUT = 420


def _save(hf_dir: str, root: str, tokens: torch.Tensor):
    import torch.distributed as dist

    from earl_megatron.config.lora import LoraSpec
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.checkpoint import save_checkpoint
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.testing.logits import megatron_logits
    from earl_megatron.testing.peft_check import fill_adapters
    from earl_megatron.weights.convert import load_hf_into, read_model_config
    from earl_megatron.weights.hf_io import HFCheckpoint

    base = read_model_config(hf_dir)
    cfg = base.with_(lora=LoraSpec(rank=8, alpha=16))
    lay = ParallelLayout.parse("pp2", world_size=dist.get_world_size(), model=cfg)
    ckpt = HFCheckpoint(hf_dir)
    with cpu_backend():   # the base is read before apply_lora wraps its linears
        mol = build_on_layout(cfg, lay, ddp=False, seed=3,
                              load=lambda model, coords: load_hf_into(model, ckpt, base, lay,
                                                                      coords))
        fill_adapters(mol.model, scale=0.01)   # B ~ N(0, 0.01): trained-adapter sized
        got = megatron_logits(mol, tokens)
        path = save_checkpoint(mol, f"{root}/run/checkpoints", 0, {"iteration": 0})
    return str(path), None if got is None else got[1]


@pytest.mark.timeout(900)
def test_smollm2_adapter_loads_with_peft_at_megatrons_logits(smollm2_dir, chat_tokens,
                                                             scratch_dir, record):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from earl_megatron.testing.peft_check import exported_logits

    results = run_distributed(_save, 2, str(smollm2_dir), str(scratch_dir), chat_tokens,
                              timeout=TIMEOUT)
    ckpt = results[0][0]
    megatron = next(r[1] for r in results if r[1] is not None)
    got, files, conf = exported_logits(ckpt, scratch_dir / "out", smollm2_dir, chat_tokens,
                                       base_model=str(smollm2_dir))
    assert conf["r"] == 8 and conf["lora_alpha"] == 16 and len(files) == 30 * 7 * 2
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
        effect = (megatron - base(chat_tokens).logits).abs().max().item()
    record("LoRA export: adapters move the logits by", effect)
    for kind, logits in got.items():
        gap = (logits - megatron).abs().max().item()
        record(f"LoRA export PP2 ({kind}) max|diff| to Megatron", gap)
        assert gap < (TOL_MERGED if kind == "merged" else TOL), (kind, gap)
    record("LoRA export: merged vs PEFT in transformers",
           (got["merged"] - got["peft"]).abs().max().item())
    assert effect > 100 * TOL, effect

    merged = load_file(scratch_dir / "out" / "merged" / "model.safetensors")
    plain = {k: v for f in smollm2_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    err = max((merged[m + ".weight"] - plain[m + ".weight"] - 2.0 * files[
        f"base_model.model.{m}.lora_B.weight"] @ files[f"base_model.model.{m}.lora_A.weight"]
               ).abs().max().item() for m in {k[len("base_model.model."):].rsplit(".", 2)[0]
                                              for k in files})
    record("LoRA export: merged weight vs W + 2 B A", err)
    assert err < 1e-5, err    # fp32 rounding (3.7e-7 here); the adapters move W by ~8e-3
