"""Global statistics of per-sample values by all-reduce over their owners (never gathered).

Every element must be passed by exactly one rank (its owner: for the trainer, the rank of each
rollout replica with tp, pp and cp coordinate 0; for dispatched tensors,
``dispatcher.owned_slices``). Other ranks pass nothing and still take part in the collectives,
so every rank gets the same global result. ``group`` None: this rank's pool (the world unless
split placement made pools: runtime/groups.py). The arithmetic is rl/advantages.py's:
``moment_sums`` -> all_reduce -> global means -> ``squared_deviations`` -> all_reduce ->
``moments_from``: two all_reduces of 2G and G float64 numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from earl_megatron.rl.advantages import (Moments, group_means, moment_sums, moments_from,
                                         squared_deviations)
from earl_megatron.runtime import groups


def global_moments(values: torch.Tensor, group_ids: torch.Tensor, num_groups: int, *,
                   unbiased: bool, group=None) -> Moments:
    """Count, mean and std per group of the values every rank owns (see the module docstring).
    ``values`` and ``group_ids`` are 1-D and may be empty on ranks that own nothing."""
    group = groups.pool_group() if group is None else group
    sums = moment_sums(values, group_ids, num_groups)
    dist.all_reduce(sums, group=group)
    sq = squared_deviations(values, group_ids, group_means(sums))
    dist.all_reduce(sq, group=group)
    return moments_from(sums, sq, unbiased=unbiased)


def global_sum(values: torch.Tensor, group=None) -> torch.Tensor:
    """Element-wise sum over ranks of a small float64 tensor of owned partial sums."""
    out = values.double().clone()
    dist.all_reduce(out, group=groups.pool_group() if group is None else group)
    return out


def global_max(values: torch.Tensor, group=None) -> torch.Tensor:
    """Element-wise max over ranks of a small float64 tensor."""
    out = values.double().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX,
                    group=groups.pool_group() if group is None else group)
    return out
