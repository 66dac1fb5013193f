"""Gather a sharded GPTModel's parameters into full tensors: all at once, or bucket by bucket.

``gather_full`` (small models, tests): every rank gets every full tensor at once.
``gather_buckets`` (weight sync to rollout servers): the same tensors in buckets of at most
``bucket_bytes`` (a tensor larger than that travels alone), one bucket at a time, so no rank
holds more than one bucket of other ranks' shards at once, whatever the model size or pp; each
pp_stage's owners contribute their own layers.

Both are collective over the world: every rank calls them; every rank gets the same
``{global Megatron name: full tensor}``. Only ranks with dp == cp == 0 contribute (the others
hold replicas); of an MoE expert's tensors, the ranks with edp == 0 (its ep rank's expert-data-
parallel replica 0, which need not have dp == 0: EP regroups the tp x cp x dp ranks), each its
expert-TP shard (``TensorRow.tp_rank_of``). Gradients are read from Megatron DDP's
``main_grad`` when present. With tied embeddings and pp > 1 the last pp_stage's output_layer
copy is skipped (its gradient equals the embedding's after finalize_model_grads' embedding
all-reduce).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from earl_megatron.config.model import ModelConfig
from earl_megatron.models.sharding import unshard
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.tensor_table import TensorRow, tensor_table


def _owned(model, cfg: ModelConfig, layout: ParallelLayout
           ) -> dict[str, tuple[int, torch.Tensor]]:
    """{full row name: (shard index, parameter)} of the parameters this rank contributes
    (module docstring; a tied output layer left out)."""
    rank = dist.get_rank()
    c = layout.coords(rank)
    dense = not (c.dp or c.cp)
    expert = layout.expert_coords(rank).edp == 0
    table = tensor_table(cfg)
    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    out = {}
    for lname, p in inner.named_parameters():
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
    for name, (tp_rank, p) in _owned(model, cfg, layout).items():
        t = p
        if what == "grad":
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            t = torch.zeros_like(p) if g is None else g
        mine[name] = (tp_rank, t.detach().float().cpu().clone())
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, mine)
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for part in everything:
        for name, (tp_rank, t) in part.items():
            shards.setdefault(name, {})[tp_rank] = t
    return {name: unshard(table.row(name), [by_rank[r] for r in sorted(by_rank)])
            for name, by_rank in sorted(shards.items())}


def weight_buckets(rows: tuple[TensorRow, ...], element_size: int,
                   bucket_bytes: int) -> list[tuple[TensorRow, ...]]:
    """Consecutive rows (model order) grouped into buckets of at most ``bucket_bytes`` full
    bytes; a row larger than that is a bucket of its own. Pure."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    out: list[tuple[TensorRow, ...]] = []
    cur: list[TensorRow] = []
    size = 0
    for row in rows:
        b = row.numel * element_size
        if cur and size + b > bucket_bytes:
            out.append(tuple(cur))
            cur, size = [], 0
        cur.append(row)
        size += b
    if cur:
        out.append(tuple(cur))
    return out


def gather_buckets(model, cfg: ModelConfig, layout: ParallelLayout, bucket_bytes: int
                   ) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
    """(index, count, bucket) for each bucket of the model's full parameters (their own dtype,
    on CPU), one at a time (module docstring). Every rank must consume every bucket: each is
    one collective."""
    table = tensor_table(cfg)
    local = _owned(model, cfg, layout)
    dtypes: list = [None] * dist.get_world_size()
    dist.all_gather_object(dtypes, next((p.dtype for _, p in local.values()), None))
    dtype = next(d for d in dtypes if d is not None)
    size = torch.empty((), dtype=dtype).element_size()
    buckets = weight_buckets(table.full_rows, size, bucket_bytes)
    for i, bucket in enumerate(buckets):
        mine = {r.name: (local[r.name][0], local[r.name][1].detach().cpu().clone())
                for r in bucket if r.name in local}
        everything: list = [None] * dist.get_world_size()
        dist.all_gather_object(everything, mine)
        del mine
        shards: dict[str, dict[int, torch.Tensor]] = {}
        for part in everything:
            for name, (tp_rank, t) in part.items():
                shards.setdefault(name, {})[tp_rank] = t
        del everything
        yield i, len(buckets), {r.name: unshard(r, [shards[r.name][k]
                                                  for k in sorted(shards[r.name])])
                                for r in bucket}
