"""Build a Megatron-Core model (optionally with DDP and optimizer) on a layout, in one call.

``build_on_layout`` regroups the world for the layout (runtime.groups), builds this rank's
pp_stage of the GPTModel, loads this rank's shard of the given full weights (or keeps
Megatron's seeded init; with weights, or ``init=False``, Megatron's random init is skipped since
every parameter is overwritten), puts a critic's value head in (``cfg.value_head``), adds LoRA
adapters when ``cfg.lora`` has a rank (models/lora.py: the base frozen, the adapters drawn from
``seed`` so every layout holds the same), wraps it in Megatron DDP, and optionally creates
Megatron's optimizer (plain or distributed). The returned ``ModelOnLayout`` is everything a
step needs; callers never touch parallel_state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from earl_megatron.config.model import ModelConfig
from earl_megatron.models.sharding import unwrap
from earl_megatron.plan.layout import Coords, ParallelLayout
from earl_megatron.runtime import groups


@dataclass
class ModelOnLayout:
    cfg: ModelConfig
    layout: ParallelLayout
    coords: Coords
    tcfg: Any
    model: Any
    """Megatron DDP-wrapped GPTModel (or the bare GPTModel when built with ddp=False)."""
    optimizer: Any = None

    @property
    def post_process(self) -> bool:
        return self.coords.pp == self.layout.pp - 1

    def module(self):
        return unwrap(self.model)


@dataclass(frozen=True)
class PoolSeat:
    """A rank's place in a pool that holds no model (split placement's rollout pool on SGLang
    servers, which hold the weights): the pool's layout and this rank's coordinates in it,
    what the episode pool and the rollout need of a ``ModelOnLayout`` there."""

    cfg: ModelConfig
    layout: ParallelLayout
    coords: Coords


def seat_on_layout(cfg: ModelConfig, layout: ParallelLayout, *, seed: int = 1234,
                   pools: Optional[tuple[ParallelLayout, ...]] = None,
                   local: bool = False) -> PoolSeat:
    """Make this rank's pool's groups current (``build_on_layout``'s regrouping, every rank
    passing the same ``pools``; ``local``: this pool's ranks only, groups.build_pool_groups)
    and return its seat in ``layout``, building no model."""
    pool = groups.build_pool_groups(pools or (layout,), cfg, seed=seed, local=local)
    if pool.layout != layout:
        raise ValueError(f"rank {dist.get_rank()} is in pool {pool.index} ({pool.layout}), "
                         f"not in a {layout} pool; pass its pool's layout")
    return PoolSeat(cfg, layout, layout.coords(groups.pool_rank()))


@dataclass(frozen=True)
class OptimizerSpec:
    lr: float = 1e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False


def build_on_layout(cfg: ModelConfig, layout: ParallelLayout, *,
                    weights: Optional[dict[str, torch.Tensor]] = None,
                    load: Optional[Callable[[Any, Coords], None]] = None, ddp: bool = True,
                    optimizer: Optional[OptimizerSpec] = None, seed: int = 1234,
                    recompute: Optional[str] = None, init: Optional[bool] = None,
                    pools: Optional[tuple[ParallelLayout, ...]] = None,
                    local: bool = False,
                    adapters: Optional[dict[str, tuple[torch.Tensor, torch.Tensor]]] = None
                    ) -> ModelOnLayout:
    """Regroup for ``layout`` and build this rank's pp_stage (with DDP and optimizer if asked).

    ``pools``: split placement's pools (runtime/groups.py ``build_pool_groups``), every rank
    passing the same; ``layout`` is then this rank's pool's and the model lives on that pool.
    ``local``: only this pool's ranks call (its new groups made by them alone).

    ``load(model, coords)``: fills every parameter of the bare GPTModel pp_stage before DDP
    wraps it (weights/convert.py's ``load_policy`` reads checkpoints this way); exclusive with
    ``weights``, the full tensors to shard.
    ``adapters``: with ``cfg.lora``, the FULL (A, B) of every adapted linear by name, set in
    place of fresh ones (a PEFT adapter as run.init: weights/peft_import.py).
    ``init``: run Megatron's seeded random init. Default: only when neither ``weights`` nor
    ``load`` is given.
    ``init=False`` leaves every parameter as ``torch.empty``: the caller must overwrite all of
    them (``weights`` does; so does the switcher's transfer, which checks it). TransformerEngine
    specs always initialise (their TP attributes are set their own way, not checked here)."""
    from earl_megatron.models.provider import (
        build_gpt_model, te_layers, transformer_config, wrap_ddp)
    from earl_megatron.models.sharding import load_full_weights

    if weights is not None and load is not None:
        raise ValueError("pass either weights= (full tensors) or load= (a loader), not both")
    coords = seat_on_layout(cfg, layout, seed=seed, pools=pools, local=local).coords
    # the pool's groups, handed to Megatron explicitly (the same ones runtime/megatron_globals.py
    # installs for the code of the pinned Megatron-Core that reads parallel_state's globals)
    pgc = groups.current_pg_collection()
    init = (weights is None and load is None if init is None else init) or te_layers(cfg)
    # Without init, Megatron 0.16 would not set the TP attributes (tensor_model_parallel,
    # partition_dim, partition_stride: set only inside its init functions) and grad clipping
    # would count TP shards as duplicates; build_gpt_model sets them itself then
    # (provider.set_tensor_parallel_attributes). Random init is most of a rebuild's cost: CPU init
    # draws each full matrix on every rank and keeps its shard.
    tcfg = transformer_config(cfg, layout, recompute=recompute, perform_initialization=init)
    # Megatron initialises weights from torch's default generator (use_cpu_initialization draws
    # each full matrix there, then splits it): seed it, in a fork, so the same seed gives the same
    # model in every run and layout without disturbing the caller's random stream
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_gpt_model(cfg, layout, pre_process=coords.pp == 0,
                                post_process=coords.pp == layout.pp - 1, config=tcfg,
                                pg_collection=pgc)
    # the flag is read only during construction; a model built later from on_layout.tcfg (e.g. a
    # second live copy) gets Megatron's init as usual
    tcfg.perform_initialization = True
    if cfg.value_head:   # PPO's critic: its head where the output layer was (models/value_model)
        from earl_megatron.models.value_model import install_head
        install_head(model, seed)
    if weights is not None:
        load_full_weights(model, weights, cfg, layout, coords)
    elif load is not None:
        load(model, coords)
    if cfg.lora.enabled:
        # adapters go in before DDP: Megatron's DDP allocates grad buffers (and the distributed
        # optimizer its shards) for the parameters that still require grad, the adapters only
        from earl_megatron.models.lora import apply_lora
        apply_lora(model, cfg.lora, seed=seed, full=adapters)
    if ddp or optimizer is not None:
        model = wrap_ddp(model, tcfg, use_distributed_optimizer=bool(
            optimizer and optimizer.use_distributed_optimizer), pg_collection=pgc)
    opt = build_optimizer(model, optimizer, params_dtype=tcfg.params_dtype) \
        if optimizer is not None else None
    return ModelOnLayout(cfg=cfg, layout=layout, coords=coords, tcfg=tcfg, model=model,
                         optimizer=opt)


def build_optimizer(model, spec: OptimizerSpec, params_dtype: torch.dtype = torch.float32):
    """Megatron-Core's Adam (plain or distributed) over a DDP-wrapped model.

    ``params_dtype``: the model's. float32: Adam steps the parameters themselves; bfloat16 /
    float16: Megatron's mixed-precision optimizer keeps fp32 master copies and copies them back
    to the model after each step."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ocfg = OptimizerConfig(optimizer="adam", lr=spec.lr, weight_decay=spec.weight_decay,
                           adam_beta1=spec.adam_beta1, adam_beta2=spec.adam_beta2,
                           adam_eps=spec.adam_eps, clip_grad=spec.clip_grad,
                           bf16=params_dtype == torch.bfloat16,
                           fp16=params_dtype == torch.float16, params_dtype=params_dtype,
                           use_distributed_optimizer=spec.use_distributed_optimizer)
    # 0.16.1 gathers parameter-group keys over the world whatever groups it is given
    # (megatron/core/optimizer/__init__.py:180): on this thread, the pool's. Its groups are the
    # installed globals: its pg_collection path refuses the gloo side groups used beside NCCL.
    with groups.pool_world():
        return get_megatron_optimizer(ocfg, [model],
                                      use_gloo_process_groups=groups.has_gloo_side_groups())
