"""Seconds to switch the live layout of a stage to another, for the selector's cost.

The bytes each rank receives in the reshard plan the switcher runs (plan/reshard_plan.py,
``receive_bytes``) for the weights and, for TRAIN, the optimizer state (which lives in the TRAIN
layout), over the slowest link a reshard may use, plus the fixed regroup time. A change of the
TRAIN stage's recompute mode alone costs nothing: Megatron-Core reads it at forward time
(runtime/recompute.py).
"""

from __future__ import annotations

import math
from typing import Optional

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.memory_model import train_state_split
from earl_megatron.plan.reshard_plan import receive_bytes
from earl_megatron.plan.specs import ClusterSpec, TrainOptions


def switch_seconds(model: ModelConfig, cluster: ClusterSpec, src: Optional[ParallelLayout],
                   dst: ParallelLayout, train_opts: TrainOptions = TrainOptions(), *,
                   optimizer_src: Optional[ParallelLayout] = None) -> float:
    """Seconds to switch the live layout ``src`` to ``dst`` (0 if equal or nothing is live).

    ``optimizer_src``: the layout the optimizer state lives in, when ``dst`` is a TRAIN layout
    (its state must follow when the TRAIN layout changes)."""
    pb = train_opts.param_bytes(model)
    recv = [0] * dst.world_size
    moved = False
    if src is not None and src != dst:
        recv = list(receive_bytes(model, src, dst, element_bytes=pb))
        moved = True
    if optimizer_src is not None and optimizer_src != dst:
        obpp = train_opts.optimizer_bytes_per_param(model)
        shard_src = optimizer_src.dp * optimizer_src.cp if train_opts.distributed_optimizer else 1
        shard_dst = dst.dp * dst.cp if train_opts.distributed_optimizer else 1
        weights = receive_bytes(model, optimizer_src, dst, element_bytes=obpp)
        for r in range(dst.world_size):
            if shard_src == shard_dst and (not model.is_moe or optimizer_src.edp == dst.edp):
                recv[r] += math.ceil(weights[r] / shard_dst)
            else:                       # shard boundaries move: assume the whole shard does
                recv[r] += train_state_split(model, dst, dst.coords(r).pp, train_opts)[1]
        moved = True
    if not moved:
        return 0.0
    bw = (cluster.inter_node_bandwidth / cluster.devices_per_node if cluster.nodes > 1
          else cluster.intra_node_bandwidth)
    return cluster.regroup_seconds + max(recv) / bw
