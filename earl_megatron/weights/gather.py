"""Gather a sharded GPTModel's parameters (or gradients) into full tensors on every rank.

``gather_full`` is the tests' reference (equal logits, weights and gradients across layouts) and
a debugging aid for small models: one ``all_gather_object`` of every rank's shards, so every
rank receives the whole model, pickled. Nothing in a run uses it: the weight sync to SGLang
servers and a model in another layout move weights by a weight plan (plan/weight_plan.py,
runtime/weight_transfer.py), which the tests check bit-exact against this.

Collective over the world (under split placement, over this rank's pool: runtime/groups.py):
every rank calls it; every rank gets the same
``{global Megatron name: full tensor}``. Only ranks with dp == cp == 0 contribute (the others
hold replicas); of an MoE expert's tensors, the ranks with edp == 0 (its ep rank's expert-data-
parallel replica 0, which need not have dp == 0: EP regroups the tp x cp x dp ranks), each its
expert-TP shard (``TensorRow.tp_rank_of``). Gradients are read from Megatron DDP's
``main_grad`` when present. With tied embeddings and pp > 1 the last pp_stage's output_layer
copy is skipped (its gradient equals the embedding's after finalize_model_grads' embedding
all-reduce).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from earl_megatron.config.model import ModelConfig
from earl_megatron.models.sharding import unshard, unwrap
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.tensor_table import tensor_table
from earl_megatron.runtime import groups


def owned_shards(model, cfg: ModelConfig, layout: ParallelLayout
           ) -> dict[str, tuple[int, torch.Tensor]]:
    """{full row name: (shard index, parameter)} of the parameters this rank contributes
    (module docstring; a tied output layer left out)."""
    rank = groups.pool_rank()
    c = layout.coords(rank)
    dense = not (c.dp or c.cp)
    expert = layout.expert_coords(rank).edp == 0
    table = tensor_table(cfg)
    out = {}
    for lname, p in unwrap(model).named_parameters():
        row = table.row(table.global_name_on(lname, layout, rank))
        if not row.tied_to and (expert if row.expert is not None else dense):
            out[row.name] = (row.tp_rank_of(layout, rank), p)
    return out


def gather_full(model, cfg: ModelConfig, layout: ParallelLayout, *,
                what: str = "param") -> dict[str, torch.Tensor]:
    if what not in ("param", "grad"):
        raise ValueError(f"what must be 'param' or 'grad', got {what!r}")
    table = tensor_table(cfg)
    mine: dict[str, tuple[int, torch.Tensor]] = {}
    for name, (tp_rank, p) in owned_shards(model, cfg, layout).items():
        t = p
        if what == "grad":
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            t = torch.zeros_like(p) if g is None else g
        mine[name] = (tp_rank, t.detach().float().cpu().clone())
    everything: list = [None] * layout.world_size
    dist.all_gather_object(everything, mine, group=groups.pool_group())
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for part in everything:
        for name, (tp_rank, t) in part.items():
            shards.setdefault(name, {})[tp_rank] = t
    return {name: unshard(table.row(name), [by_rank[r] for r in sorted(by_rank)])
            for name, by_rank in sorted(shards.items())}
