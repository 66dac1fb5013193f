"""A PEFT adapter as run.init on 2 ranks (issue #46 item 5): ``load_policy`` of the adapter
directory builds its base with the adapter over it, and Megatron's logits on TP2 and PP2 equal
``PeftModel.from_pretrained(base, ADAPTER)``'s (1e-4), far from the base's own. The adapter is
``peft``'s (its own A per module, k_proj left out: weights/peft_import.py stacks them into rank
8). Then the TP2 model's checkpoint, exported back with ``earl convert mcore-to-hf``, loads in
``peft`` (r=8) and gives the same logits, and the merged export too. And the trainer from
``run.init=ADAPTER`` (Connect Four, KL in the loss, 1 iteration): its reference is the base, so
iteration 0's KL is the adapter's distance from it, not 0.
"""

import json

import pytest
import torch

from earl_megatron.testing.multiproc import run_distributed

TOL = 1e-4
MODULES = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tokens():
    return torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(5))


def _load(adapter, root):
    import dataclasses

    import torch.distributed as dist

    from earl_megatron.testing.configs import tiny_connect_four
    from earl_megatron.train import init_config, run

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.checkpoint import save_checkpoint
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.testing.logits import megatron_logits
    from earl_megatron.weights.convert import load_policy

    out = {}
    with cpu_backend():
        for name in ("tp2", "pp2"):
            lay = ParallelLayout.parse(name, world_size=dist.get_world_size())
            mol = load_policy(adapter, lay, ddp=False)
            got = megatron_logits(mol, _tokens())
            out[name] = (mol.cfg.lora, None if got is None else got[1])
            if name == "tp2":
                out["ckpt"] = str(save_checkpoint(mol, f"{root}/checkpoints", 0,
                                                  {"iteration": 0}))
            groups.destroy_groups()
    out["trainer"] = run(tiny_connect_four(
        f"{root}/train", model=dataclasses.asdict(init_config(adapter)),
        algorithm={"kl_mode": "loss", "kl_coef": 0.1}, run={"init": adapter, "iterations": 1}))
    return out


@pytest.mark.timeout(600)
def test_megatron_from_a_peft_adapter_computes_peft_logits(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from earl_megatron.testing.peft_check import exported_logits, peft_adapter
    from earl_megatron.testing.tiny_models import tiny_model

    base, adapter = peft_adapter(tmp_path, tiny_model("llama", vocab_size=32), MODULES)
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        plain = hf(_tokens()).logits.float()
        want = PeftModel.from_pretrained(hf, adapter).eval()(_tokens()).logits.float()
    results = run_distributed(_load, 2, str(adapter), str(tmp_path / "run"), timeout=400)
    for name in ("tp2", "pp2"):
        spec = results[0][name][0]
        assert (spec.rank, spec.alpha) == (8, 16.0), spec
        got = next(r[name][1] for r in results if r[name][1] is not None)
        gap = (got - want).abs().max().item()
        print(f"{name}: |Megatron - PEFT| {gap:.2g}, the adapter moves the logits by "
              f"{(want - plain).abs().max().item():.3g}")
        assert gap < TOL, (name, gap)
    assert (want - plain).abs().max().item() > 100 * TOL
    # back out: the run record names the adapter as run.init; the export's base is its base
    run = tmp_path / "run"
    (run / "resolved.json").write_text(json.dumps({"run": {"init": str(adapter)}}))
    back, files, conf = exported_logits(results[0]["ckpt"], run, base, _tokens())
    assert (conf["r"], conf["lora_alpha"], conf["base_model_name_or_path"]) == \
        (8, 16, str(base)), conf
    gaps = {k: (v - want).abs().max().item() for k, v in back.items()}
    assert all(g < TOL for g in gaps.values()), gaps
    it0 = results[0]["trainer"][0]
    print(f"trainer from the adapter: iteration 0 kl {it0['kl']:.3g}, loss {it0['loss']:.3g}")
    assert it0["kl"] > 1e-4 and it0["ref_log_ratio_max"] > 1e-3, it0
