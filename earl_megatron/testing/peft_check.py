"""The LoRA export checked end to end (tests): nonzero adapters, the CLI's two exports of a
checkpoint, and what ``peft`` and transformers compute from them.

``fill_adapters(model)`` gives every adapter's B values drawn from a seed of its global name (a
fresh adapter has B = 0 and would change nothing), the same on every layout.
``peft_adapter(root, cfg, modules)`` saves ``cfg``'s model (seeded weights) as an HF directory and
an adapter ``peft`` makes on it (its own A per module, B not zero), for run.init=ADAPTER.
``exported_logits(ckpt, out, hf_dir, tokens)`` runs tools/convert_mcore_to_hf.py in this
process on ``ckpt`` twice (a PEFT adapter to ``out/peft``, ``--merged`` to ``out/merged``) and
returns the logits of ``PeftModel.from_pretrained(base, out/peft)`` ("peft"), of the merged
model ("merged") and, with ``auto``, of ``AutoPeftModelForCausalLM`` (which finds the base
through ``base_model_name_or_path``), plus the adapter file's tensors and config. It asserts
that PEFT holds exactly the file's adapter tensors, bit-exact.
"""

from __future__ import annotations

import importlib.util
import json
import zlib
from pathlib import Path
from typing import Any

import torch

TOOL = Path(__file__).resolve().parents[2] / "tools" / "convert_mcore_to_hf.py"


def fill_adapters(model, scale: float = 0.05) -> None:
    """Every adapter's B from a seed of its global name, times ``scale``."""
    from earl_megatron.models.lora import lora_layers

    for name, m in lora_layers(model).items():
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        m.load_full(b=torch.randn(m.out_features, m.lora_a.shape[0], generator=gen) * scale)


def peft_adapter(root: Path, cfg, modules: list[str], r: int = 4,
                 alpha: int = 8) -> tuple[Path, Path]:
    """(the HF base directory, the adapter directory) under ``root``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.weights.hf_io import write_hf_dir
    from earl_megatron.weights.hf_mapping import to_hf, to_hf_config

    base = root / "base"
    write_hf_dir(base, to_hf(cfg, reference_weights(cfg, seed=7)), to_hf_config(cfg))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                               LoraConfig(r=r, lora_alpha=alpha, target_modules=modules,
                                          init_lora_weights=False))
    model.save_pretrained(root / "adapter")
    return base, root / "adapter"


def export(*argv: str) -> None:
    """tools/convert_mcore_to_hf.py's main in this process; it must succeed."""
    spec = importlib.util.spec_from_file_location("convert_mcore_to_hf", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    code = mod.main([*argv, "--no-progress"])
    if code != 0:
        raise AssertionError(f"convert_mcore_to_hf {' '.join(argv)} exited {code}")


def exported_logits(ckpt: str, out: Path, hf_dir: Path, tokens: torch.Tensor, *,
                    base_model: str | None = None, auto: bool = False
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """({"peft", "merged"[, "auto"]: logits}, the adapter file's tensors, its config)."""
    from peft import AutoPeftModelForCausalLM, PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    export(ckpt, str(out / "peft"), *(["--base-model", base_model] if base_model else []))
    export(ckpt, str(out / "merged"), "--merged")
    files = load_file(out / "peft" / "adapter_model.safetensors")
    conf = json.loads((out / "peft" / "adapter_config.json").read_text())

    def load(path: Path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    peft_model = PeftModel.from_pretrained(load(hf_dir), out / "peft").eval()
    held = get_peft_model_state_dict(peft_model)
    if held.keys() != files.keys() or not all(torch.equal(held[k], v)
                                              for k, v in files.items()):
        raise AssertionError(f"PEFT holds other adapter tensors than the file: "
                             f"{sorted(set(held) ^ set(files))[:4]}")
    with torch.no_grad():
        got = {"peft": peft_model(tokens).logits.float()}
        del peft_model
        got["merged"] = load(out / "merged")(tokens).logits.float()
        if auto:
            got["auto"] = AutoPeftModelForCausalLM.from_pretrained(
                out / "peft", dtype=torch.float32).eval()(tokens).logits.float()
    return got, files, conf
