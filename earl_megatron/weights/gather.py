"""Gather a sharded GPTModel's parameters or gradients into full tensors (small models, tests).

Collective over the world: every rank calls it; every rank gets the same dict
``{global Megatron name: full tensor}``. Only ranks with dp == cp == 0 contribute (the others
hold replicas). Gradients are read from Megatron DDP's ``main_grad`` when present. With tied
embeddings and pp > 1 the last pp_stage's output_layer copy is skipped (its gradient equals the
embedding's after finalize_model_grads' embedding all-reduce).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from earl_megatron.config.model import ModelConfig
from earl_megatron.models.sharding import unshard
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.tensor_table import tensor_table


def gather_full(model, cfg: ModelConfig, layout: ParallelLayout, *,
                what: str = "param") -> dict[str, torch.Tensor]:
    if what not in ("param", "grad"):
        raise ValueError(f"what must be 'param' or 'grad', got {what!r}")
    rank = dist.get_rank()
    c = layout.coords(rank)
    table = tensor_table(cfg)
    mine: dict[str, tuple[int, torch.Tensor]] = {}
    if c.dp == 0 and c.cp == 0:
        inner = model
        while hasattr(inner, "module"):
            inner = inner.module
        for lname, p in inner.named_parameters():
            row = table.row(table.global_name(lname, c.pp, layout.pp))
            if row.tied_to:
                continue
            if what == "grad":
                g = getattr(p, "main_grad", None)
                if g is None:
                    g = p.grad
                t = torch.zeros_like(p) if g is None else g
            else:
                t = p
            mine[row.name] = (c.tp, t.detach().float().cpu().clone())
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, mine)
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for part in everything:
        for name, (tp_rank, t) in part.items():
            shards.setdefault(name, {})[tp_rank] = t
    return {name: unshard(table.row(name), [by_rank[r] for r in sorted(by_rank)])
            for name, by_rank in sorted(shards.items())}
