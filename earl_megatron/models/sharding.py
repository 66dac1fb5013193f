"""Full (unsharded) Megatron-Core tensors <-> one rank's shards, for any layout (torch).

Every split rule comes from the tensor table (plan/tensor_table.py): a row's TP split dim and
partition stride say how ``shard`` cuts a full tensor and ``unshard`` joins the tp shards; its
pp_stage and local name say which parameter of which pp_stage holds it. Names are full
local-spec names with global layer indices; a live model's own names (either spec, layer
indices local to its pp_stage) map onto them with ``TensorTable.source_of``.

- linear_qkv rows are grouped per KV group, so a contiguous dim-0 split hands each tp rank
  whole groups;
- SwiGLU linear_fc1 is stored in full as ``[gate; up]`` and has partition stride 2: tp rank r
  holds ``[gate_r; up_r]`` (``TensorRow.tp_rows``);
- an expert's fc1 / fc2 is on its ep rank only and split by the expert-TP rank (``etp``), not
  the attention's tp rank (``TensorRow.tp_of`` / ``tp_rank_of``).

Invariant: ``unshard(row, [shard(row, full, r, tp) for r in range(tp)]) == full`` bit-exact.
"""

from __future__ import annotations

import torch

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import Coords, ParallelLayout
from earl_megatron.plan.tensor_table import TensorRow, tensor_table


def shard(row: TensorRow, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """Tp rank ``tp_rank``'s local tensor of the full tensor ``full`` of ``row``."""
    if row.split_dim is None or tp == 1:
        return full.clone()
    dim = row.split_dim
    if full.shape[dim] % (tp * row.stride):
        raise ValueError(f"{row.name}: dim {dim} of size {full.shape[dim]} does not divide by "
                         f"tp={tp} (x partition stride {row.stride})")
    return torch.cat([full.narrow(dim, a, b - a) for a, b in row.tp_rows(tp_rank, tp)],
                     dim=dim).clone()


def unshard(row: TensorRow, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from the local tensors of tp ranks 0..tp-1 (inverse of ``shard``)."""
    if row.split_dim is None or len(shards) == 1:
        return shards[0].clone()
    parts = [s.chunk(row.stride, dim=row.split_dim) for s in shards]
    return torch.cat([p[k] for k in range(row.stride) for p in parts], dim=row.split_dim)


def reference_weights(cfg: ModelConfig, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Deterministic full weights (fp32) for a ModelConfig: the same on every rank and layout.
    Norms draw 1 + N(0, 0.1), everything else N(0, 0.02), in the table's model order."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for row in tensor_table(cfg).full_rows:
        if row.adapter:   # models/lora.py draws adapters from (seed, name)
            continue
        norm = row.split_dim is None
        out[row.name] = (1.0 if norm else 0.0) + torch.randn(*row.shape, generator=g) * (
            0.1 if norm else 0.02)
    return out


def load_full_weights(model: torch.nn.Module, full: dict[str, torch.Tensor], cfg: ModelConfig,
                      layout: ParallelLayout, coords: Coords) -> None:
    """Copy this rank's shard of ``full`` into a (possibly DDP-wrapped) GPTModel pp_stage."""
    table = tensor_table(cfg)
    rank = layout.rank(coords)
    missing = []
    for lname, p in unwrap(model).named_parameters():
        row = table.source_on(lname, layout, rank)
        if row.name not in full:
            missing.append(row.name)
            continue
        src = shard(row, full[row.name], row.tp_rank_of(layout, rank), row.tp_of(layout))
        if src.shape != p.shape:
            raise ValueError(f"{lname}: checkpoint shard {tuple(src.shape)} != parameter "
                             f"{tuple(p.shape)} ({layout}); the model config does not match")
        with torch.no_grad():
            p.copy_(src.to(p.dtype))
    if missing:
        raise KeyError(f"weights missing for parameters: {missing[:5]} ...")


def unwrap(model):
    """The bare GPTModel pp_stage inside Megatron's wrappers (DDP, Float16Module): the one
    unwrap of the package."""
    while hasattr(model, "module"):
        model = model.module
    return model
