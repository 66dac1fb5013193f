"""A LoRA checkpoint as a PEFT adapter (or merged into the base), in Hugging Face names.

A LoRA run's checkpoint (models/lora.py ``LoraLinear.sharded_state_dict``) holds, per adapted
linear, the base weight under its un-adapted key and A [r, in] / B [out, r] under
``<linear>.lora_a`` / ``.lora_b``, stacked over layers like the base. PEFT's LoRA on a
``*ForCausalLM`` names one (A, B) per HF linear: ``base_model.model.<module>.lora_A.weight`` and
``.lora_B.weight``. Megatron fuses some HF linears into one, and one adapter serves them all:

    Megatron     HF modules                 PEFT lora_A            PEFT lora_B
    linear_qkv   q_proj, k_proj, v_proj     A (the same for each)  B's rows per KV group
                                                                   [q heads | k | v], split as
                                                                   the base weight (hf_mapping)
    linear_fc1   gate_proj, up_proj         A (the same for each)  B = [B_gate; B_up]
    linear_proj  o_proj                     A                      B
    linear_fc2   down_proj                  A                      B

so ``B_q A x`` is exactly the q rows of ``B A x``: the adapter loaded by ``peft`` onto the base
computes what the Megatron model computes. ``adapter_config.json`` carries r, lora_alpha
(PEFT scales by lora_alpha / r, as ``LoraSpec.scaling``), lora_dropout and the HF module names.
Merging (``merged``) is ``W + (alpha / r) B A`` on the full (fused) weight, computed in fp32 and
cast back to the weight's dtype, before the base mapping splits it into HF tensors.

Pure except ``write_adapter`` and ``write_peft`` (files). Exporting needs safetensors and
json only: ``peft`` is never imported here (the tests load the result with it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.tensor_table import TensorRow, tensor_table
from earl_megatron.progress import ByteProgress
from earl_megatron.weights import dcp_parts as dcp
from earl_megatron.weights import hf_mapping as hfm

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
"""PEFT's prefix on a causal LM's module names (PeftModelForCausalLM -> LoraModel -> model)."""


@dataclass(frozen=True)
class AdaptedLinear:
    """One adapted Megatron linear: its weight row (HF names, how they combine) and A, B."""

    base: TensorRow
    a: TensorRow
    b: TensorRow


def adapted_linears(cfg: ModelConfig) -> tuple[AdaptedLinear, ...]:
    """Every adapted linear of ``cfg`` in model order (none when ``cfg.lora`` is off)."""
    rows = {r.name: r for r in tensor_table(cfg).full_rows}
    return tuple(AdaptedLinear(rows[n[:-len(".lora_a")] + ".weight"], r,
                               rows[n[:-len(".lora_a")] + ".lora_b"])
                 for n, r in rows.items() if r.adapter and n.endswith(".lora_a"))


def adapter_region(base_key: str, row: TensorRow) -> dcp.Region:
    """The checkpoint key and shape of an adapter row, beside its base weight's stacked key
    (``LoraLinear.sharded_state_dict`` uses the base's prefix: ``...linear_qkv.weight`` ->
    ``...linear_qkv.lora_a``)."""
    return base_key.rsplit(".", 1)[0] + "." + row.name.rsplit(".", 1)[1], row.shape


def _module(hf_name: str) -> str:
    return hf_name[:-len(".weight")]


def peft_tensors(lin: AdaptedLinear, cfg: ModelConfig, a: Optional[torch.Tensor],
                 b: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's tensors for one adapted linear from its full A and B, either may be None (module
    docstring). The modules that share a fused linear's A get the same tensor, not copies:
    ``write_peft`` copies each before safetensors, which refuses shared memory."""
    out = {}
    if a is not None:
        for hf_name in lin.base.hf:
            out[PEFT_PREFIX + _module(hf_name) + ".lora_A.weight"] = a
    if b is not None:
        for hf_name, b_rows in hfm.split(lin.base, cfg, b).items():
            out[PEFT_PREFIX + _module(hf_name) + ".lora_B.weight"] = b_rows.contiguous()
    return out


def peft_bucket(cfg: ModelConfig, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's tensors for the adapter rows among ``full`` (full Megatron tensors: a bucket of a
    weight sync may hold any of them, an A without its B); other tensors are left out."""
    out: dict[str, torch.Tensor] = {}
    for lin in adapted_linears(cfg):
        out.update(peft_tensors(lin, cfg, full.get(lin.a.name), full.get(lin.b.name)))
    return out


def write_peft(out: Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor],
               base_model: Optional[str]) -> None:
    """``adapter_model.safetensors`` (a copy of each tensor: safetensors refuses shared memory)
    and ``adapter_config.json`` into directory ``out``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: t.detach().cpu().clone().contiguous() for k, t in tensors.items()},
              str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(cfg, base_model), indent=2) + "\n")


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
           scaling: float) -> torch.Tensor:
    """``weight + scaling * B A`` in fp32, in the weight's dtype."""
    return (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)


def merged_weights(full: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A LoRA model's full Megatron tensors (``weights/gather.gather_full``) -> its base's, each
    adapted linear's weight merged with its adapter (``merged``) and the adapters dropped: the
    un-adapted model that computes what the adapted one does (PPO's critic starts from it)."""
    out = dict(full)
    for lin in adapted_linears(cfg):
        out[lin.base.name] = merged(full[lin.base.name], out.pop(lin.a.name),
                                    out.pop(lin.b.name), cfg.lora.scaling)
    return out


def target_modules(cfg: ModelConfig) -> list[str]:
    """The HF module names PEFT targets (``q_proj``, ..., ``down_proj``), sorted."""
    return sorted({_module(n).rsplit(".", 1)[1] for lin in adapted_linears(cfg)
                   for n in lin.base.hf})


def adapter_config(cfg: ModelConfig, base_model: Optional[str]) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for ``cfg.lora`` (a LoraConfig's fields; the ones left
    out take PEFT's defaults). lora_alpha is written as an int when it is one, as PEFT types
    it; the scale alpha / r is the same either way."""
    spec = cfg.lora
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else float(spec.alpha)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": spec.rank, "lora_alpha": alpha, "lora_dropout": spec.dropout,
            "target_modules": target_modules(cfg), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "init_lora_weights": True, "inference_mode": True}


def write_adapter(src: Path, out: Path, cfg: ModelConfig,
                  adapters: dict[str, dict[str, dcp.Region]], stored: dict,
                  base_model: Optional[str], part_bytes: int,
                  progress: bool) -> tuple[int, int, int]:
    """Read every adapter of checkpoint ``src`` (``adapter_groups``: whole, gathered over the
    ranks that saved it) and write ``adapter_model.safetensors`` and ``adapter_config.json`` to
    ``out``. Returns (tensors, bytes written, parts read)."""
    groups = list(adapters.values())
    total = sum(dcp.region_bytes(r, stored) for g in groups for r in g.values())
    tensors: dict[str, torch.Tensor] = {}
    lins, done, n_parts = iter(adapted_linears(cfg)), 0, 0
    with ByteProgress("Megatron-Core -> PEFT adapter", total, enabled=progress) as prog:
        for part in dcp.read_groups(src, stored, groups, part_bytes):
            n_parts += 1
            for g in part:
                lin = next(lins)
                a, b = g[lin.a.name], g[lin.b.name]
                tensors.update(peft_tensors(lin, cfg, a, b))
                done += a.numel() * a.element_size() + b.numel() * b.element_size()
                prog.update(done)
    write_peft(out, cfg, tensors, base_model)
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors.values()), n_parts


def adapter_groups(cfg: ModelConfig, template: dict) -> dict[str, dict[str, dcp.Region]]:
    """{base weight name: {A name: region, B name: region}} of every adapted linear."""
    return {lin.base.name: {r.name: adapter_region(template[lin.base.name].key, r)
                            for r in (lin.a, lin.b)} for lin in adapted_linears(cfg)}

