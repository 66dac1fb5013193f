"""Baselines to measure against (tests, benchmarks; never the trainer): ``switch_via_checkpoint``
(a layout switch through dist_checkpointing on disk, vs runtime/switcher.py),
``dispatch_centralized`` (gather on one root, then scatter, vs runtime/dispatcher.py) and
``allgather_buckets`` (the weight sync before the weight plan: every bucket of every rank's
shards to every rank, pickled, vs runtime/weight_transfer.py)."""

from __future__ import annotations

import os
import time
from typing import Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.placement import Placement
from earl_megatron.plan.shard_map import build_centralized_map
from earl_megatron.runtime.build import ModelOnLayout, build_on_layout
from earl_megatron.runtime.dispatcher import DispatchResult, execute_shard_map
from earl_megatron.runtime.switcher import SwitchStats, release_model

def dispatch_centralized(producer: Placement, consumer: Placement,
                         local: Mapping[str, Mapping[int, torch.Tensor]], *, root: int = 0,
                         device: Optional[torch.device] = None) -> DispatchResult:
    """Gather everything on ``root``, then scatter (the single-controller way)."""
    return execute_shard_map(build_centralized_map(producer, consumer, root), producer, consumer,
                             local, device=device)


def switch_via_checkpoint(on_layout: ModelOnLayout, new_layout: ParallelLayout, ckpt_dir: str, *,
                          stats: Optional[SwitchStats] = None) -> ModelOnLayout:
    """Baseline: dist_checkpointing save under the old layout, load under the new (weights)."""
    from megatron.core import dist_checkpointing

    from earl_megatron.runtime.checkpoint import save_sharded

    stats = stats if stats is not None else SwitchStats()
    cfg, ddp = on_layout.cfg, hasattr(on_layout.model, "module")
    t0 = time.perf_counter()
    os.makedirs(ckpt_dir, exist_ok=True)  # a shared filesystem: every rank sees one directory
    dist.barrier()
    save_sharded(on_layout.module().sharded_state_dict(), ckpt_dir)
    t1 = time.perf_counter()
    # the same rebuild as switch_layout's (free, regroup, build without random init)
    release_model(on_layout.model)
    on_layout.model = on_layout.optimizer = on_layout.tcfg = None
    new = build_on_layout(cfg, new_layout, weights=None, ddp=ddp, init=False)
    t2 = time.perf_counter()
    state = dist_checkpointing.load(new.module().sharded_state_dict(), ckpt_dir)
    missing = [k for k in new.module().load_state_dict(state, strict=False).missing_keys
               if not k.endswith("_extra_state")]
    if missing:
        raise RuntimeError(f"the checkpoint left parameters {missing[:4]} unloaded")
    t3 = time.perf_counter()
    stats.collect_s += t1 - t0
    stats.rebuild_s += t2 - t1
    stats.transfer_s += t3 - t2
    return new


def allgather_buckets(policy: ModelOnLayout, bucket_bytes: int, received: list
                      ) -> Iterator[dict[str, torch.Tensor]]:
    """The weight sync as it was: per bucket of whole tensors (model order, at most
    ``bucket_bytes`` of full tensors), one ``all_gather_object`` of the owners' shards over the
    world, then every rank unshards the whole bucket. Appends to ``received`` the tensor bytes
    this rank got from other ranks per bucket (pickling and padding not counted)."""
    from earl_megatron.models.sharding import unshard
    from earl_megatron.plan.tensor_table import tensor_table
    from earl_megatron.weights.gather import owned_shards

    table = tensor_table(policy.cfg)
    local = owned_shards(policy.model, policy.cfg, policy.layout)
    size = next(policy.module().parameters()).element_size()
    buckets, cur, used = [], [], 0
    for row in table.full_rows:
        if cur and used + row.numel * size > bucket_bytes:
            buckets.append(cur)
            cur, used = [], 0
        cur.append(row)
        used += row.numel * size
    buckets.append(cur)
    me = dist.get_rank()
    for bucket in buckets:
        mine = {r.name: (local[r.name][0], local[r.name][1].detach().cpu().clone())
                for r in bucket if r.name in local}
        everything: list = [None] * dist.get_world_size()
        dist.all_gather_object(everything, mine)
        received.append(sum(t.numel() * t.element_size() for k, part in enumerate(everything)
                            if k != me for _, t in part.values()))
        shards: dict[str, dict[int, torch.Tensor]] = {}
        for part in everything:
            for name, (tp_rank, t) in part.items():
                shards.setdefault(name, {})[tp_rank] = t
        yield {r.name: unshard(r, [shards[r.name][k] for k in sorted(shards[r.name])])
               for r in bucket}
