"""Full (unsharded) Megatron-Core tensors <-> one rank's shards, for any layout.

Names are Megatron-Core GPTModel names under the local spec with *global* layer indices
(``decoder.layers.{global}.…``); ``local_name``/``global_name`` translate to the names a
pp_stage's state dict uses (layer indices restart at 0 on every pp_stage).

TP split rules (see ../shared/DESIGN.md):

    dim 0 : embedding.word_embeddings, linear_qkv (weight, bias), linear_fc1, output_layer
    dim 1 : linear_proj, linear_fc2
    none  : every norm (replicated)

- linear_qkv rows are grouped per KV group, ``[q heads of group g | k_g | v_g]`` for
  g = 0..ng-1, so a contiguous dim-0 split hands each tp rank whole groups.
- SwiGLU linear_fc1 is stored in full as ``[gate (f rows); up (f rows)]`` and has
  partition stride 2: tp rank r holds ``[gate_r; up_r]``.

Invariant: ``unshard(name, [shard(name, full, r, tp) for r in range(tp)]) == full`` bit-exact.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

_DIM0 = ("embedding.word_embeddings.weight", "self_attention.linear_qkv.weight",
         "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight", "output_layer.weight")
_DIM1 = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_STRIDE2 = ("mlp.linear_fc1.weight",)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def tp_split_dim(name: str) -> Optional[int]:
    """The dim a tensor is split along under TP, or None when replicated."""
    if name.endswith(_DIM0):
        return 0
    if name.endswith(_DIM1):
        return 1
    if "layernorm" in name or name.endswith(("final_layernorm.weight", "norm.weight")):
        return None
    if name.endswith("_extra_state"):
        return None
    raise KeyError(f"no TP split rule for parameter {name!r}; add it to weights/sharding.py")


def shard(name: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    dim = tp_split_dim(name)
    if dim is None or tp == 1:
        return full.clone()
    if full.shape[dim] % tp:
        raise ValueError(f"{name}: dim {dim} of size {full.shape[dim]} does not divide by tp={tp}")
    if name.endswith(_STRIDE2):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]]).clone()
    return full.chunk(tp, dim=dim)[tp_rank].clone()


def unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    dim = tp_split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0].clone()
    if name.endswith(_STRIDE2):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def global_name(local: str, pp_rank: int, layers_per_stage: int) -> str:
    m = _LAYER.match(local)
    if not m:
        return local
    return f"decoder.layers.{int(m.group(1)) + pp_rank * layers_per_stage}.{m.group(2)}"


def local_name(name: str, layers_per_stage: int) -> tuple[Optional[int], str]:
    """(pp_rank that owns the layer or None for non-layer tensors, name local to that stage)."""
    m = _LAYER.match(name)
    if not m:
        return None, name
    g = int(m.group(1))
    return g // layers_per_stage, f"decoder.layers.{g % layers_per_stage}.{m.group(2)}"


def reference_weights(cfg, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Deterministic full weights (fp32) for a ModelConfig: the same on every rank and layout."""
    g = torch.Generator().manual_seed(seed)
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    qkv_rows = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * d

    def normal(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    out = {"embedding.word_embeddings.weight": normal(cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = 1.0 + normal(h, std=0.1)
        out[p + "self_attention.linear_qkv.weight"] = normal(qkv_rows, h)
        if cfg.add_qkv_bias:
            out[p + "self_attention.linear_qkv.bias"] = normal(qkv_rows)
        out[p + "self_attention.linear_proj.weight"] = normal(h, cfg.num_attention_heads * d)
        out[p + "pre_mlp_layernorm.weight"] = 1.0 + normal(h, std=0.1)
        out[p + "mlp.linear_fc1.weight"] = normal(2 * f, h)
        out[p + "mlp.linear_fc2.weight"] = normal(h, f)
    out["decoder.final_layernorm.weight"] = 1.0 + normal(h, std=0.1)
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = normal(cfg.vocab_size, h)
    return out


def load_full_weights(model: torch.nn.Module, full: dict[str, torch.Tensor], *, tp_rank: int,
                      tp: int, pp_rank: int, layers_per_stage: int, tied: bool) -> None:
    """Copy this rank's shard of ``full`` into a (possibly DDP-wrapped) GPTModel pp_stage."""
    params = dict(_unwrap(model).named_parameters())
    missing = []
    for lname, p in params.items():
        gname = global_name(lname, pp_rank, layers_per_stage)
        if gname == "output_layer.weight" and tied:
            gname = "embedding.word_embeddings.weight"
        if gname not in full:
            missing.append(gname)
            continue
        src = shard(gname, full[gname], tp_rank, tp)
        if src.shape != p.shape:
            raise ValueError(f"{lname}: checkpoint shard {tuple(src.shape)} != parameter "
                             f"{tuple(p.shape)} (tp={tp}); the model config does not match")
        with torch.no_grad():
            p.copy_(src.to(p.dtype))
    if missing:
        raise KeyError(f"weights missing for parameters: {missing[:5]} ...")


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model
