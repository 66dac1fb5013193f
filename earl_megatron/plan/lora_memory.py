"""What a LoRA run (``model.lora.rank`` r >= 1) trains and keeps, for the memory model. Pure.

A LoRA model's parameters are the frozen base plus the adapters (the tensor table lists both:
``TensorRow.adapter`` rows, split as models/lora.py splits them: a column-parallel target's A
whole and B's rows split by tp, a row-parallel target's A's columns split by tp and B whole; the
experts are never adapted). The memory model (plan/memory_model.py) counts:

- weights: every parameter, base and adapters, in the model's dtype (``param_count_per_rank``:
  the adapters take the base weight's dtype, as ``LoraLinear`` builds them);
- grads and optimizer (TRAIN): the adapters only (``trained_elements_on``): Megatron's DDP
  allocates its grad buffer, and the (distributed) optimizer its fp32 master copy and Adam
  moments, for parameters that require grad, and ``apply_lora`` freezes every base parameter
  before DDP wraps the model. The adapters are dense parameters: the distributed optimizer
  shards them over dp x cp;
- activations (TRAIN): a layer's set on Megatron's LOCAL layers (a LoRA model never builds
  TransformerEngine's: models/provider.py ``te_layers``; so on GPUs too its attention is unfused
  and keeps the scores: the memory model passes ``fused_attention=False``) plus
  ``adapter_activation_bytes``.

Why the adapters' activations are that small: a frozen base linear runs Megatron's
``LinearWithFrozenWeight``, which saves only its weight, not its input; the adapter's
``F.linear(x, A)`` saves that same input tensor instead, so the input the full-fine-tune count
gives the base linear is still counted once. What the adapter adds is ``B``'s input ``h = A x``:
r elements per token per target (per local token after a sequence-parallel reduce-scatter for a
row-parallel target), and with ``dropout`` > 0 the dropped copy of the input and its 1-byte mask
(counted in full: an upper bound, since the copy stands in for the input that is then no longer
saved; torch's CPU dropout keeps a 4-byte mask). Left out, so the estimate is an upper bound:
what freezing saves elsewhere (a frozen norm weight's multiply no longer keeps the normalised
input for the weight's gradient: h per token per norm). Measured with saved-tensor hooks (an
ad-hoc probe after tests/distributed/test_recompute.py: one layer of the tiny llama, rank 4 on
all four targets, 32 tokens, fp32, dp2 and tp2): Megatron saves 187,648 B (dp2) and 113,920 B
(tp2) per layer where this model says 204,032 and 130,304, the difference being exactly the two
norms' 2 x 64 x 32 x 4 B; with dropout 0.1, 228,608 and 142,592 against 255,232 and 166,144.
A linear that is not a target saves no input either (frozen, no adapter): with targets qkv and
proj only, 162,048 B measured on dp2 against 203,008 (the norms plus fc1's and fc2's inputs,
(2 x 64 + 64 + 128) x 32 x 4 B). The memory model keeps them all: it never under-counts.

Invariants: with ``rank`` 0 nothing here is read (the memory model's results are those of a
full fine-tune, byte for byte); every function returns a non-negative int, non-decreasing in
``tokens``.
"""

from __future__ import annotations

import functools
import math

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.activations import LayerActivations
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.specs import Recompute
from earl_megatron.plan.tensor_table import tensor_table

COLUMN_TARGETS = ("linear_qkv", "linear_fc1")
"""Column-parallel targets (A whole, B split); ``linear_proj`` and ``linear_fc2`` are row-parallel
(A split, B whole)."""


def trained_elements_on(model: ModelConfig, layout: ParallelLayout, pp_rank: int) -> int:
    """Adapter elements one rank of ``pp_rank`` holds (every tp/cp/dp/ep rank alike): the
    parameters a LoRA run trains there, 0 on a pp_stage without layers."""
    return _adapter_elements(model, pp_rank, layout.tp, layout.pp)


@functools.lru_cache(maxsize=1024)
def _adapter_elements(model: ModelConfig, pp_rank: int, tp: int, pp: int) -> int:
    return sum(r.local_numel(tp) for r in tensor_table(model).on_pp_stage(pp_rank, pp)
               if r.adapter)


def adapter_activation_bytes(model: ModelConfig, layout: ParallelLayout, tokens: int,
                             act_bytes: int) -> int:
    """What one layer's adapters keep for the backward on top of the base layer's set, for a
    micro-batch of ``tokens`` (before the cp split): per target, ``h = A x`` (r per token: the
    sequence all-gathered for a column target under sequence parallelism, reduce-scattered to
    tokens/tp for a row target), plus with dropout the dropped input and its bool mask (module
    docstring)."""
    lora = model.lora
    if not lora.enabled:
        return 0
    t = layout.tp
    local = math.ceil(tokens / layout.cp)
    sp = layout.sequence_parallel(model)
    shard = math.ceil(local / t) if sp else local           # tokens of a sequence-split tensor
    in_width = {"linear_qkv": model.hidden_size, "linear_fc1": model.hidden_size,
                "linear_proj": model.num_attention_heads * model.head_dim // t,
                "linear_fc2": model.ffn_hidden_size // t}
    total = 0
    for target in lora.targets:
        column = target in COLUMN_TARGETS
        total += (local if column else shard) * lora.rank * act_bytes          # h = A x
        if lora.dropout > 0:                  # the column input is this rank's sequence shard
            total += (shard if column else local) * in_width[target] * (act_bytes + 1)
    return total


def with_adapters(layer: LayerActivations, model: ModelConfig, layout: ParallelLayout,
                  tokens: int, act_bytes: int, recompute: Recompute) -> LayerActivations:
    """``layer`` (plan/activations.py ``train_layer_bytes``) with the adapters' activations:
    stored with the layer's set (none, selective: the adapters are outside the core attention),
    rebuilt with it under full recompute (only the layer's input stays stored)."""
    extra = adapter_activation_bytes(model, layout, tokens, act_bytes)
    if recompute is Recompute.FULL:
        return LayerActivations(layer.stored, layer.transient + extra)
    return LayerActivations(layer.stored + extra, layer.transient)
