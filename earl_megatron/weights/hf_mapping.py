"""Hugging Face <-> Megatron-Core tensors and configs (Llama, Qwen2, Qwen3, Qwen3-MoE): pure,
over the tensor table.

Which HF tensors make each Megatron-Core tensor, and how, is a column of the tensor table
(plan/tensor_table.py: ``TensorRow.hf`` and ``TensorRow.combine``); this module turns that
into row/column ranges to read and tensor transforms:

- "copy": one HF tensor, the same shape (embedding, norms, Qwen3's per-head q_norm / k_norm,
  o_proj, down_proj, lm_head);
- "qkv": rows grouped per KV group g = 0..ng-1 as ``[q heads of g | k_g | v_g]`` (weight and,
  for Qwen2, bias), so a contiguous dim-0 TP split hands each rank whole groups;
- "fc1": ``[gate; up]`` (SwiGLU, partition stride 2 under TP: rank r holds ``[gate_r; up_r]``).
- Qwen3-MoE: the router is a "copy" of ``mlp.gate.weight``; each expert e is an fc1 row of
  ``experts.e.gate_proj`` / ``up_proj`` and a copy of ``experts.e.down_proj`` (the per-expert
  tensors the hub stores and transformers' ``save_pretrained`` writes; transformers fuses them
  into ``experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] only in memory). An expert
  row's shard comes from its expert-TP rank (``TensorRow.tp_rank_of``): ``sources`` takes that
  rank and size like any other.
- Tied embeddings: neither ``lm_head.weight`` nor a separate output tensor exists.

``sources(row, cfg, tp_rank, tp)`` lists the HF row/column ranges that tp rank ``tp_rank`` needs,
and ``combine`` assembles them; with ``tp=1`` that is the full tensor. Invariant:
``combine(row, cfg, [read(s) for s in sources(row, cfg, r, tp)]) ==
models.sharding.shard(row, full, r, tp)`` bit-exact, and ``split(row, cfg, full)`` returns the HF
tensors ``full`` was combined from, bit-exact. Nothing here touches files or torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from earl_megatron.config.model import FAMILY_FEATURES, MOE_FAMILIES, ModelConfig
from earl_megatron.plan.tensor_table import TensorRow, tensor_table

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
_FAMILY_ARCH = {v: k for k, v in ARCHITECTURES.items()}
_DTYPES = ("float32", "bfloat16", "float16")


class UnsupportedModelError(ValueError):
    """An HF model this converter cannot map to the Megatron-Core Llama/Qwen2/Qwen3(-MoE)
    GPTModel."""


@dataclass(frozen=True)
class SourceSlice:
    hf_name: str
    dim: Optional[int]
    """Dim the range applies to; None reads the whole tensor."""
    start: int = 0
    stop: int = 0


# ----------------------------------------------------------------------------- names
def rules(cfg: ModelConfig) -> tuple[TensorRow, ...]:
    """Every Megatron tensor of ``cfg`` that has HF sources, in model order."""
    return tuple(r for r in tensor_table(cfg).full_rows if not r.adapter)


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor a checkpoint of ``cfg`` holds (lm_head only when untied)."""
    d, ng = cfg.head_dim, cfg.num_query_groups
    out = {}
    for row in rules(cfg):
        tail = row.shape[1:]
        if row.combine == "qkv":
            rows = (cfg.num_attention_heads * d, ng * d, ng * d)
        elif row.combine == "fc1":
            rows = (row.shape[0] // 2,) * 2
        else:
            rows = (row.shape[0],)
        out.update({n: (r, *tail) for n, r in zip(row.hf, rows)})
    return out


# ----------------------------------------------------------------------------- transforms
def sources(rule: TensorRow, cfg: ModelConfig, tp_rank: int = 0,
            tp: int = 1) -> list[SourceSlice]:
    """The HF ranges tp rank ``tp_rank`` of ``tp`` needs for its shard of ``rule``."""
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank={tp_rank} out of range for tp={tp}")
    d = cfg.head_dim
    if rule.combine == "qkv":
        ng, hpg = cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups
        if ng % tp:
            raise ValueError(f"tp={tp} does not divide num_query_groups={ng}")
        g0, g1 = tp_rank * ng // tp, (tp_rank + 1) * ng // tp
        q, k, v = rule.hf
        return [SourceSlice(q, 0, g0 * hpg * d, g1 * hpg * d), SourceSlice(k, 0, g0 * d, g1 * d),
                SourceSlice(v, 0, g0 * d, g1 * d)]
    if rule.split_dim is None or tp == 1:
        return [SourceSlice(n, None) for n in rule.hf]
    if rule.shape[rule.split_dim] % (tp * rule.stride):
        raise ValueError(f"{rule.name}: dim {rule.split_dim} of size "
                         f"{rule.shape[rule.split_dim]} does not divide by tp={tp}")
    # fc1 ([gate; up], stride 2): part k of the rank's rows comes from HF tensor k, shifted by
    # k * f; a "copy" row has its HF tensor's shape
    part = rule.shape[rule.split_dim] // rule.stride
    return [SourceSlice(rule.hf[k], rule.split_dim, a - k * part, b - k * part)
            for k, (a, b) in enumerate(rule.tp_rows(tp_rank, tp))]


def combine(rule: TensorRow, cfg: ModelConfig, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Assemble the tensors read for ``sources(rule, ...)`` into the Megatron tensor (shard)."""
    if rule.combine == "copy":
        return parts[0]
    if rule.combine == "fc1":
        return torch.cat(list(parts), dim=0)
    q, k, v = parts
    d = cfg.head_dim
    groups = k.shape[0] // d  # KV groups in this slice
    tail = tuple(q.shape[1:])
    return torch.cat([q.reshape(groups, -1, *tail), k.reshape(groups, d, *tail),
                      v.reshape(groups, d, *tail)], dim=1).reshape(-1, *tail)


def split(rule: TensorRow, cfg: ModelConfig, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inverse of ``combine`` on a full tensor: {HF name: tensor}."""
    if rule.combine == "copy":
        return {rule.hf[0]: full}
    if rule.combine == "fc1":
        gate, up = full.chunk(2, dim=0)
        return {rule.hf[0]: gate.contiguous(), rule.hf[1]: up.contiguous()}
    d, ng = cfg.head_dim, cfg.num_query_groups
    hpg = cfg.num_attention_heads // ng
    tail = tuple(full.shape[1:])
    grouped = full.reshape(ng, (hpg + 2) * d, *tail)
    q, k, v = grouped.split([hpg * d, d, d], dim=1)
    return {n: t.reshape(-1, *tail).contiguous() for n, t in zip(rule.hf, (q, k, v))}


def to_megatron(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A whole in-memory HF state dict -> full Megatron tensors (small models, tests)."""
    return {r.name: combine(r, cfg, [hf[n] for n in r.hf]) for r in rules(cfg)}


def to_hf(cfg: ModelConfig, full: dict[str, torch.Tensor], *,
          partial: bool = False) -> dict[str, torch.Tensor]:
    """Full Megatron tensors -> HF state dict (small models, tests). ``partial``: only the
    tensors ``full`` holds (a bucket of a weight sync); otherwise every one must be there."""
    out: dict[str, torch.Tensor] = {}
    for r in rules(cfg):
        if partial and r.name not in full:
            continue
        out.update(split(r, cfg, full[r.name]))
    return out


# ----------------------------------------------------------------------------- configs
def _rope_theta(hf: dict[str, Any]) -> float:
    rp = hf.get("rope_parameters")
    if isinstance(rp, dict):
        rope_type = rp.get("rope_type", rp.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedModelError(
                f"rope_parameters.rope_type={rope_type!r} (rope scaling) is not supported; only "
                "'default' rotary embeddings convert (e.g. Llama 3 8B, Qwen2.5), not Llama 3.1+")
        if "rope_theta" in rp:
            return float(rp["rope_theta"])
    scaling = hf.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise UnsupportedModelError(f"rope_scaling={scaling!r} is not supported; only default "
                                    "rotary embeddings convert")
    return float(hf.get("rope_theta", 10000.0))


def _architecture(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    if archs:
        arch = archs[0]
    else:  # configs built without a model (tests) carry only model_type
        arch = _FAMILY_ARCH.get(hf.get("model_type", ""),
                                f"model_type={hf.get('model_type')!r}")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch} is not supported; supported: {sorted(ARCHITECTURES)} "
            "(decoder-only, RMSNorm, SwiGLU, default rope, no sliding window; mixture of experts "
            "as Qwen3-MoE only: docs/conversion.md)")
    return arch


def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
    """An HF config.json (dict) -> ModelConfig; raises UnsupportedModelError naming the problem."""
    arch = _architecture(hf)
    family = ARCHITECTURES[arch]
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (only silu/SwiGLU)")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias=true")
    if family in ("llama", "qwen3", "qwen3_moe") and hf.get("attention_bias"):
        problems.append("attention_bias=true (biases on q/k/v/o)")
    if family != "llama" and hf.get("use_sliding_window"):
        problems.append("use_sliding_window=true")
    if family not in MOE_FAMILIES and (hf.get("num_local_experts") or hf.get("num_experts")):
        problems.append("mixture of experts (only Qwen3MoeForCausalLM converts)")
    if family in MOE_FAMILIES:
        problems.extend(_moe_problems(hf))
    if problems:
        raise UnsupportedModelError(f"{arch} with {', '.join(problems)} is not supported")
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim")
    dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").replace("torch.", "")
    if dtype not in _DTYPES:
        raise UnsupportedModelError(f"{arch} with dtype {dtype!r}; supported: {_DTYPES}")
    return ModelConfig(
        family=family, num_layers=int(hf["num_hidden_layers"]), hidden_size=hidden,
        ffn_hidden_size=int(hf["intermediate_size"]), num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        vocab_size=int(hf["vocab_size"]),
        kv_channels=(int(head_dim) if head_dim and int(head_dim) * heads != hidden else None),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        rotary_base=_rope_theta(hf), norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        **FAMILY_FEATURES[family],
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), params_dtype=dtype,
        **(_moe_fields(hf) if family in MOE_FAMILIES else {}))


def _num_experts(hf: dict[str, Any]) -> Any:
    # the hub's config.json says num_experts; transformers 5 saves num_local_experts (its
    # attribute_map aliases the two)
    return hf.get("num_experts", hf.get("num_local_experts"))


def _moe_problems(hf: dict[str, Any]) -> list[str]:
    """What a Qwen3-MoE config has that the Megatron-Core MoE GPTModel here cannot express."""
    out = []
    for key in ("num_experts", "moe_intermediate_size"):
        if not (_num_experts(hf) if key == "num_experts" else hf.get(key)):
            out.append(f"no {key} (a Qwen3-MoE config.json must set it)")
    if hf.get("mlp_only_layers"):
        out.append(f"mlp_only_layers={hf['mlp_only_layers']} (dense MLP layers among MoE layers; "
                   "every layer must be MoE: mlp_only_layers=[])")
    if int(hf.get("decoder_sparse_step", 1)) != 1:
        out.append(f"decoder_sparse_step={hf['decoder_sparse_step']} (MoE only every "
                   f"{hf['decoder_sparse_step']}th layer; every layer must be MoE: 1)")
    if int(hf.get("shared_expert_intermediate_size") or 0) > 0:
        out.append(f"shared_expert_intermediate_size={hf['shared_expert_intermediate_size']} "
                   "(shared experts; Qwen3-MoE has none)")
    return out


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    # output_router_logits only makes transformers return router logits: nothing to convert
    return dict(num_experts=int(_num_experts(hf)),
                moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
                moe_router_topk=int(hf.get("num_experts_per_tok", 8)),
                moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)))


def to_hf_config(cfg: ModelConfig, base: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """ModelConfig -> HF config.json dict; ``base`` (the original config) keeps its other keys."""
    for key, value in FAMILY_FEATURES[cfg.family].items():
        if getattr(cfg, key) != value:
            raise UnsupportedModelError(
                f"a {cfg.family} ModelConfig with {key}={getattr(cfg, key)} has no HF "
                f"equivalent ({_FAMILY_ARCH[cfg.family]} always has {key}={value}); leave "
                f"model.{key} unset (null) or pick the family that has it")
    out = dict(base or {})
    theta = float(cfg.rotary_base)
    out.update(
        architectures=[_FAMILY_ARCH[cfg.family]], model_type=cfg.family,
        num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups, head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_epsilon, tie_word_embeddings=cfg.tie_word_embeddings,
        hidden_act="silu", dtype=cfg.params_dtype,
        # transformers >= 5 reads rope_parameters, older versions rope_theta
        rope_parameters={"rope_type": "default", "rope_theta": theta}, rope_theta=theta)
    out.pop("torch_dtype", None)
    if cfg.is_moe:
        out.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_ffn_hidden_size,
                   num_experts_per_tok=cfg.moe_router_topk, norm_topk_prob=cfg.moe_norm_topk_prob,
                   router_aux_loss_coef=cfg.moe_aux_loss_coeff, decoder_sparse_step=1,
                   mlp_only_layers=[])
        if "num_local_experts" in out:   # a base saved by transformers 5: keep the alias equal
            out["num_local_experts"] = cfg.num_experts
    if cfg.family in ("llama", "qwen3", "qwen3_moe"):
        out.update(attention_bias=False)
    if cfg.family == "llama":
        out.update(mlp_bias=False)
    else:
        out.setdefault("use_sliding_window", False)
    return out
