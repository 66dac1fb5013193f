"""Read and install Megatron optimizer state as flat ranges of local parameters (for switches).

Megatron-Core's Adam keeps, per parameter it steps, a fp32 *main* tensor and its state:
- plain optimizer: the main is the whole local (TP-sharded) parameter: the parameter itself
  for fp32 weights (``FP32Optimizer``), its fp32 master copy for bf16/fp16 weights
  (``Float16OptimizerWithFloat16Params``);
- distributed optimizer: the main is this dp x cp rank's flat range ``[start, stop)`` of the
  parameter's row-major flattening (possibly empty), a view into the parameter for fp32
  weights, a separate fp32 master shard for bf16/fp16 weights.

Mixture of experts: Megatron builds a separate optimizer for the expert parameters (their own
DDP buffers, reduced over the expert-data-parallel group; the distributed optimizer shards them
over edp rather than dp x cp) and chains it with the dense one. Every chained optimizer is read
here and each parameter's range comes from the optimizer that steps it, so expert state needs
no rule of its own.

Both are described alike here: per local parameter name, ``(local shape, start, stop)`` and, per
state kind, a contiguous 1-D fp32 tensor holding flat elements ``[start, stop)``
(plan/state_plan.py plans the moves in those terms). Kinds: ``master`` (only for bf16/fp16
weights: fp32 weights are their own masters and move as weights) and, once the optimizer has
stepped, ``exp_avg`` / ``exp_avg_sq``. No collective moves state here; ``optimizer_state``
only agrees with the other ranks on whether a state exists at all.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from earl_megatron.plan.state_plan import StateRanges
from earl_megatron.runtime import groups

MOMENTS = ("exp_avg", "exp_avg_sq")
MASTER = "master"
"""The fp32 master copy Megatron's mixed-precision optimizers step (bf16/fp16 weights)."""

FlatState = dict[str, dict[str, torch.Tensor]]
"""{local parameter name: {kind: 1-D fp32 tensor of the rank's flat range}}."""


def megatron_optimizers(optimizer) -> list:
    """The per-group Megatron optimizers inside a (possibly chained) Megatron optimizer."""
    if optimizer is None:
        return []
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def is_distributed(opt) -> bool:
    return hasattr(opt, "model_param_group_index_map")


def state_kinds(masters: bool, stepped: bool) -> tuple[str, ...]:
    """The state kinds a switch moves, in the order both ends use them."""
    return ((MASTER,) if masters else ()) + (MOMENTS if stepped else ())


def has_masters(on_layout) -> bool:
    """Megatron's optimizer keeps fp32 master copies (bf16/fp16 weights) that must move too."""
    return on_layout.optimizer is not None and on_layout.cfg.params_dtype != "float32"


def _plain_mains(opt) -> dict:
    """{model param: the param Adam steps} of a plain Megatron optimizer: its fp32 master copy
    (float16_groups[i] <-> fp32_from_float16_groups[i]), or the param itself (fp32 params)."""
    if not hasattr(opt, "float16_groups"):
        return {p: p for group in opt.optimizer.param_groups for p in group["params"]}
    mains = {p: m for model_g, main_g in zip(opt.float16_groups, opt.fp32_from_float16_groups)
             for p, m in zip(model_g, main_g)}
    mains.update({p: p for g in opt.fp32_from_fp32_groups for p in g})
    return mains


def _distributed_mains(opt) -> dict:
    """{model param: this rank's flat shard that Adam steps} of a distributed optimizer (only
    params with a non-empty range here). Not ``model_param_group_index_map``: its order is that
    of the grad buffers, while the optimizer's param groups list fp32 shards first, so with
    mixed dtypes in one group (fp32 norms of a bf16 model on CPU)
    ``_get_main_param_and_optimizer_states`` returns another param's shard (Megatron-Core 0.16)."""
    pairs = (list(zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups))
             + list(zip(opt.model_fp32_groups, opt.shard_fp32_groups)))
    return {p: m for model_g, main_g in pairs for p, m in zip(model_g, main_g)}


def _mains(on_layout) -> dict:
    """{local name: (Megatron optimizer, main tensor, flat start, flat stop)} of this rank."""
    names = {p: n for n, p in on_layout.module().named_parameters()}
    out = {}
    for opt in megatron_optimizers(on_layout.optimizer):
        if not is_distributed(opt):
            for p, main in _plain_mains(opt).items():
                out[names[p]] = (opt, main, 0, p.numel())
            continue
        for p, main in _distributed_mains(opt).items():
            rng = opt._get_model_param_range_map(p)["param"]
            out[names[p]] = (opt, main, rng.start, rng.end)
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().view(-1)
    assert flat.is_contiguous(), "optimizer state must be contiguous"
    return flat


def optimizer_state(on_layout) -> tuple[FlatState, StateRanges, Optional[torch.Tensor]]:
    """This rank's optimizer state as flat ranges, their geometry, and one step tensor
    (None: never stepped; every rank must agree, checked with one all-reduce)."""
    params = dict(on_layout.module().named_parameters())
    masters = has_masters(on_layout)
    state: FlatState = {}
    ranges: StateRanges = {}
    step = None
    for name, (opt, main, start, stop) in _mains(on_layout).items():
        st = opt.optimizer.state.get(main) or {}
        if "step" in st:
            step = st["step"]
        entry = {MASTER: _flat(main)} if masters else {}
        entry.update({k: _flat(st[k]) for k in MOMENTS if k in st})
        state[name] = entry
        ranges[name] = (tuple(params[name].shape), start, stop)
    have = torch.tensor([0 if step is None else 1], dtype=torch.int64)
    # over this rank's pool (the world, or split's train pool switching alone)
    dist.all_reduce(have, op=dist.ReduceOp.MAX, group=groups.pool_group())
    if have.item() and step is None and state:
        raise RuntimeError("this rank has no Adam state but others do; every rank must have "
                           "stepped the optimizer the same number of times before a switch")
    if have.item() and step is None:   # a rank stepping no parameter at all (empty ranges)
        step = torch.zeros(())
    return state, ranges, step if have.item() else None


def install_optimizer_state(on_layout, step: Optional[torch.Tensor]
                            ) -> tuple[FlatState, StateRanges]:
    """Give the new optimizer zeroed moments (with ``step``) and return its state as flat
    ranges to receive into: the masters are the optimizer's own main tensors."""
    params = dict(on_layout.module().named_parameters())
    masters = has_masters(on_layout)
    state: FlatState = {}
    ranges: StateRanges = {}
    for name, (opt, main, start, stop) in _mains(on_layout).items():
        entry = {MASTER: _flat(main)} if masters else {}
        if step is not None:
            st = {"step": step.clone(), **{k: torch.zeros_like(main) for k in MOMENTS}}
            opt.optimizer.state[main] = st
            entry.update({k: _flat(st[k]) for k in MOMENTS})
        state[name] = entry
        ranges[name] = (tuple(params[name].shape), start, stop)
    return state, ranges
