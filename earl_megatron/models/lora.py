"""Low-rank adapters (LoRA) on Megatron-Core's tensor-parallel linears, the base frozen.

``apply_lora(model, spec, seed=...)`` wraps every targeted linear of a bare (not yet
DDP-wrapped) ``GPTModel`` pp_stage in a ``LoraLinear`` and freezes every base parameter; it
returns the adapter parameters by their global name. The wrapped linear computes

    y = base(x) + B A dropout(x) * alpha / rank        A: [rank, in], B: [out, rank]

A starts kaiming-uniform (``nn.Linear``'s bound 1 / sqrt(in)), B at zero, so a fresh adapter
changes nothing. ``set_adapters(model, False)`` (or the ``adapters_off`` block) turns every
adapter off: each wrapped linear is then its base alone, so the model computes the base's output
bit for bit (a LoRA run's KL reference, trainer/model_pair.py).

Each adapter is split the way its base is (tp = the base's tp group, SP = sequence parallel):

    base                  A                     B                    communication (in the graph)
    column-parallel       whole [r, in]         rows [out/tp, r]     no SP: h = A x, backward
    (qkv, fc1)                                                       all-reduces dh;  SP: h = A x
                                                                     on this rank's sequence shard,
                                                                     all-gathered along the
                                                                     sequence (r wide: cheap)
    row-parallel          cols [r, in/tp]       whole [out, r]       A x is a partial sum:
    (proj, fc2)                                                      all-reduced (no SP) or
                                                                     reduce-scattered along the
                                                                     sequence (SP), as the base is

Invariants:
- Gradients are complete after a plain backward: a whole (replicated) matrix that sees only this
  rank's sequence shard under SP (column A, row B) has its gradient all-reduced over tp in the
  graph (``copy_to_tensor_model_parallel_region`` on the weight), so Megatron's
  finalize_model_grads must NOT reduce it again (it is not marked ``sequence_parallel``). Whole
  matrices end with equal gradients on every tp rank; split ones carry Megatron's TP attributes
  (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``) so grad-norm clipping
  counts each shard once.
- The adapter is a function of (seed, global name) only: the FULL A (and any B given to
  ``LoraLinear.load_full``) is drawn and this rank keeps its slice, so tp1, tp2 and any pp split
  hold the same adapter. SwiGLU linear_fc1 is ``[gate; up]`` with partition stride 2 (tp rank k
  holds ``[gate_k; up_k]``, as models/sharding.py), so B's rows follow the same rule.
- Only Megatron's local-spec ``ColumnParallelLinear`` / ``RowParallelLinear`` are wrapped; the
  TransformerEngine spec (its qkv fuses the input norm) and the experts' linears are refused.
- Dropout masks come from torch's default generator: where the input is replicated over tp
  (column-parallel without SP) every tp rank must hold the same generator state (Megatron's
  seeding gives the default generator one seed per pp_stage). Exact tp parity is checked at
  dropout 0 only.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from typing import Mapping, Optional

import torch
import torch.nn.functional as F

from earl_megatron.config.lora import TARGETS, LoraSpec

__all__ = ["TARGETS", "LoraLinear", "LoraSpec", "adapters_off", "apply_lora", "lora_layers",
           "set_adapters"]


def _slice(full: torch.Tensor, dim: int, stride: int, rank: int, tp: int) -> torch.Tensor:
    """Tp rank ``rank``'s part of ``full`` along ``dim``: chunk ``rank + k * tp`` of
    ``tp * stride`` equal chunks, for k < stride (Megatron's partition stride)."""
    chunks = full.chunk(tp * stride, dim=dim)
    return torch.cat([chunks[rank + k * tp] for k in range(stride)], dim=dim).clone()


def _unslice(parts: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The inverse of ``_slice`` over every tp rank's part, in rank order."""
    tp = len(parts)
    chunks = [p.chunk(stride, dim=dim) for p in parts]
    return torch.cat([chunks[r][k] for k in range(stride) for r in range(tp)], dim=dim)


class LoraLinear(torch.nn.Module):
    """A Megatron-Core parallel linear (``base``, frozen) plus its adapter ``lora_a`` /
    ``lora_b``, split as the module docstring's table says. ``forward`` returns the base's
    ``(output, bias)`` pair with the adapter's update added to the output."""

    def __init__(self, base: torch.nn.Module, spec: LoraSpec, *, name: str, seed: int):
        from megatron.core.tensor_parallel.layers import (
            ColumnParallelLinear, RowParallelLinear, set_tensor_model_parallel_attributes)
        from megatron.core.utils import get_pg_rank, get_pg_size

        super().__init__()
        if isinstance(base, ColumnParallelLinear):
            self.column = True
            if base.gather_output:
                raise ValueError(f"{name}: a column-parallel linear that gathers its output is "
                                 "not a transformer layer's; LoRA adapts linear_qkv / linear_fc1")
        elif isinstance(base, RowParallelLinear):
            self.column = False
            if not base.input_is_parallel:
                raise ValueError(f"{name}: a row-parallel linear whose input is not split is not "
                                 "a transformer layer's; LoRA adapts linear_proj / linear_fc2")
        else:
            raise TypeError(
                f"{name} is a {type(base).__name__}: LoRA wraps Megatron-Core's local-spec "
                "ColumnParallelLinear / RowParallelLinear only (the TransformerEngine spec is not "
                "supported yet: build without TE)")
        if base.is_expert:
            raise ValueError(f"{name} is an expert's linear: LoRA on MoE experts is not built yet "
                             "(issue #46); target the attention's linear_qkv / linear_proj only")
        self.base = base
        self.name = name
        self.enabled = True
        """False: ``forward`` is the base's alone (the KL reference of a LoRA run is the
        policy's own base: ``set_adapters`` / ``adapters_off``)."""
        self.scaling = spec.scaling
        self.dropout = spec.dropout
        self.tp_group = base.tp_group
        self.tp = get_pg_size(base.tp_group)
        self.tp_rank = get_pg_rank(base.tp_group)
        self.sequence_parallel = bool(base.sequence_parallel) and self.tp > 1
        # SwiGLU's fc1 is [gate; up] with partition stride 2 (models/sharding.py)
        self.stride = 2 if name.endswith("linear_fc1") and base.config.gated_linear_unit else 1
        self.in_features, self.out_features = base.input_size, base.output_size
        # the split matrix and the dim it is split along: B's rows (column), A's columns (row)
        self.split = ("lora_b", 0) if self.column else ("lora_a", 1)

        w = base.weight
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        bound = 1.0 / math.sqrt(self.in_features)
        full_a = torch.empty(spec.rank, self.in_features).uniform_(-bound, bound, generator=gen)
        full_b = torch.zeros(self.out_features, spec.rank)
        self.lora_a = torch.nn.Parameter(self._local("lora_a", full_a).to(w.device, w.dtype))
        self.lora_b = torch.nn.Parameter(self._local("lora_b", full_b).to(w.device, w.dtype))
        split_name, dim = self.split
        set_tensor_model_parallel_attributes(getattr(self, split_name), is_parallel=True,
                                             dim=dim, stride=self.stride)

    def _local(self, which: str, full: torch.Tensor) -> torch.Tensor:
        split_name, dim = self.split
        if which != split_name or self.tp == 1:
            return full.clone()
        return _slice(full, dim, self.stride if which == "lora_b" else 1, self.tp_rank, self.tp)

    @torch.no_grad()
    def load_full(self, *, a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> None:
        """Set the adapter from FULL tensors (A [r, in], B [out, r]); this rank keeps its slice."""
        for which, full in (("lora_a", a), ("lora_b", b)):
            if full is None:
                continue
            param = getattr(self, which)
            local = self._local(which, full)
            if local.shape != param.shape:
                raise ValueError(f"{self.name}.{which}: full tensor {tuple(full.shape)} gives a "
                                 f"local {tuple(local.shape)}, not {tuple(param.shape)}")
            param.copy_(local)

    def gather_full(self, which: str, local: torch.Tensor) -> torch.Tensor:
        """The FULL tensor of ``which`` ("lora_a" / "lora_b") from every tp rank's ``local``
        (its value or its gradient): a collective over the base's tp group."""
        import torch.distributed as dist

        split_name, dim = self.split
        if which != split_name or self.tp == 1:
            return local.detach().clone()
        parts = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(parts, local.detach().contiguous(), group=self.tp_group)
        return _unslice(parts, dim, self.stride if which == "lora_b" else 1)

    def _update(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region as copy_to_tp,
            gather_from_sequence_parallel_region, reduce_from_tensor_model_parallel_region,
            reduce_scatter_to_sequence_parallel_region)

        g = self.tp_group
        x = F.dropout(x, self.dropout, self.training) if self.dropout > 0 else x
        a, b = self.lora_a, self.lora_b
        if self.column:
            if self.sequence_parallel:   # x: this rank's sequence shard
                h = gather_from_sequence_parallel_region(F.linear(x, copy_to_tp(a, group=g)),
                                                         group=g)
            else:                        # x: whole, on every tp rank
                h = copy_to_tp(F.linear(x, a), group=g)
        else:                            # x: this rank's input columns
            h = F.linear(x, a)
            if self.sequence_parallel:
                h = reduce_scatter_to_sequence_parallel_region(h, group=g)
                b = copy_to_tp(b, group=g)
            else:
                h = reduce_from_tensor_model_parallel_region(h, group=g)
        return F.linear(h, b) * self.scaling

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """Megatron dist_checkpointing's view: the base under its ORIGINAL checkpoint keys
        (``<prefix>weight``: the base linear's own sharded tensors, so a LoRA checkpoint's base
        reads like an un-adapted model's and loads into one), the adapters under
        ``<prefix>lora_a`` / ``<prefix>lora_b``, split as their base (column: B on dim 0,
        replicated A; row: A on dim 1, replicated B). The dict's keys are this module's
        state_dict keys (``<prefix>base.weight``), what ``load_state_dict`` takes back. SwiGLU's
        fc1 is ``[gate; up]`` per tp rank: its weight, bias and B go through Megatron's swiglu
        factory, which MLP applies only under the un-adapted key."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        base = self.base.sharded_state_dict(prefix, sharded_offsets, metadata)
        out = {f"{prefix}base.{k[len(prefix):]}": v for k, v in base.items()}
        split_name, dim = self.split
        out.update(make_sharded_tensors_for_checkpoint(
            {"lora_a": self.lora_a, "lora_b": self.lora_b}, prefix, {split_name: dim},
            sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]))
        if self.stride == 2:
            singleton = metadata.get("singleton_local_shards", False)
            for key in (f"{prefix}base.weight", f"{prefix}base.bias", f"{prefix}lora_b"):
                if key in out:
                    out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets, singleton)
        return out

    def forward(self, x: torch.Tensor, *args, **kwargs):
        out, bias = self.base(x, *args, **kwargs)
        if not self.enabled:   # exactly the un-adapted linear: no B A x, not even a zero
            return out, bias
        return out + self._update(x).to(out.dtype), bias


def lora_layers(model) -> dict[str, LoraLinear]:
    """Every ``LoraLinear`` of a pp_stage by its global name (see ``apply_lora``)."""
    return {m.name: m for m in model.modules() if isinstance(m, LoraLinear)}


def set_adapters(model, enabled: bool) -> int:
    """Turn every adapter of ``model`` (bare or DDP-wrapped) on or off; returns how many
    ``LoraLinear`` it holds. Off, the model computes its frozen base bit for bit as the
    un-adapted model does (trainer/model_pair.py: a LoRA run's KL reference)."""
    layers = lora_layers(model)
    for m in layers.values():
        m.enabled = enabled
    return len(layers)


@contextlib.contextmanager
def adapters_off(model):
    """``model``'s base alone inside the block (``set_adapters``), its adapters on after."""
    set_adapters(model, False)
    try:
        yield model
    finally:
        set_adapters(model, True)


def apply_lora(model, spec: LoraSpec, *, seed: int = 0,
               full: Optional[Mapping[str, tuple[torch.Tensor, torch.Tensor]]] = None
               ) -> dict[str, torch.nn.Parameter]:
    """Wrap every targeted linear of ``model`` (a bare GPTModel pp_stage) in a ``LoraLinear``,
    freeze every other parameter, and return the adapter parameters by global name
    (``decoder.layers.<global layer>.<path>.lora_a``: the layer index is the model's, not the
    pp_stage's, so every pp split draws the same adapter). ``full``: the FULL (A, B) of every
    wrapped linear by its name, set instead of the fresh draw (weights/peft_import.py).

    Call it before Megatron's DDP wraps the model: DDP allocates its grad buffers (and the
    distributed optimizer its shards) for the parameters that require grad at construction."""
    if hasattr(model, "module") or not hasattr(model, "decoder"):
        raise TypeError(f"apply_lora takes the bare GPTModel, not a {type(model).__name__}: "
                        "apply it before wrap_ddp / build_optimizer (build_on_layout(ddp=False))")
    if not spec.enabled:
        raise ValueError("apply_lora: model.lora.rank=0 means no adapters; build without LoRA")
    if lora_layers(model):
        raise ValueError("apply_lora: this model already has adapters")
    # every wrapper is built (and every refusal raised) before the model changes
    wraps = []
    for layer in model.decoder.layers:
        prefix = f"decoder.layers.{layer.layer_number - 1}."
        for path, module in list(layer.named_modules()):
            if path.rsplit(".", 1)[-1] in spec.targets:
                parent_path, _, attr = path.rpartition(".")
                wraps.append((layer.get_submodule(parent_path), attr,
                              LoraLinear(module, spec, name=prefix + path, seed=seed)))
    if not wraps:
        raise ValueError(f"apply_lora: this pp_stage has none of the targets {list(spec.targets)}")
    for p in model.parameters():
        p.requires_grad_(False)
    adapters: dict[str, torch.nn.Parameter] = {}
    missing = sorted(w.name for _, _, w in wraps if full is not None and w.name not in full)
    if missing:
        raise ValueError(f"apply_lora: no adapter given for {missing[:3]}")
    for parent, attr, wrapped in wraps:
        if full is not None:
            wrapped.load_full(a=full[wrapped.name][0], b=full[wrapped.name][1])
        setattr(parent, attr, wrapped)
        adapters[f"{wrapped.name}.lora_a"] = wrapped.lora_a
        adapters[f"{wrapped.name}.lora_b"] = wrapped.lora_b
    return adapters
