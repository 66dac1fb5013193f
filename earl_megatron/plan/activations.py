"""Activation memory of one transformer layer, and what each recompute mode keeps of it.

Pure accounting (no torch), read by the memory model (plan/memory_model.py) for every stage:

- ``layer_activation_bytes``: what one layer keeps for its backward (Korthikanti et al. 2022,
  Sec. 4, redone for RMSNorm, GQA, SwiGLU, no dropout), in two variants: the TransformerEngine
  path (fused attention) and Megatron's local spec in eager torch (the CPU path), whose saved
  tensors are counted with autograd saved-tensor hooks in the tests.
- MoE layers (``moe_layer_activation_bytes``, ``moe_dispatch_buffer_bytes``): router, permuted
  token copies and experts' SwiGLU under an even routing (modelled, not measured).
- ``train_layer_bytes``: one layer's TRAIN activations under a Megatron-Core recompute mode, as
  (stored, transient): ``stored`` stays alive per layer and micro-batch in flight until that
  layer's backward; ``transient`` is what ONE layer rebuilds during its backward (the
  recomputed part, freed before the next layer's backward):

      none       stored = the layer's whole set                  transient = 0
      selective  stored = the set minus the core attention's     transient = the core
                 internals (scores, mask, K/V repeated per head,             attention's
                 Q), plus what Megatron's checkpoint keeps: roped            internals
                 q and k, the fused qkv output (value is a view of it;
                 q/k norms keep it anyway) and the mask type as a
                 4-byte int tensor
      full       stored = the layer's input (tokens/tp under      transient = the layer's
                 sequence parallelism)                                        whole set

  Over flash attention (TE) selective keeps the same as none (flash stores no scores).

Invariants: every function returns a non-negative int, non-decreasing in ``tokens`` and
``longest``; stored is none >= selective >= full for a layer whose core attention holds more
than its inputs (the local path at any context; checked by tests/distributed/test_recompute.py
against the bytes Megatron saves, on TP2, CP2, PP2 and a sequence-parallel MoE layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.specs import Recompute

MASK_TYPE_BYTES = 4
"""Megatron's selective checkpoint passes the attention mask type as an int32 tensor per layer."""


def layer_activation_bytes(model: ModelConfig, layout: ParallelLayout, tokens: int,
                           longest: int, act_bytes: int, *, fused_attention: bool,
                           recompute: Recompute = Recompute.NONE) -> int:
    """Activations one transformer layer keeps for the backward of a micro-batch of ``tokens``
    tokens (before the cp split) whose longest sequence has ``longest`` tokens.

    ``fused_attention=False`` is Megatron's local spec in eager torch (the CPU path), counted
    from the tensors autograd saves (measured with saved-tensor hooks, see the tests): each
    RMSNorm keeps its input, the normalised input, its output and 1/rms (3h + 1); Q, the context
    and K, V repeated to every query head (the unfused GQA path) a*d/t each; SwiGLU 5f/t (fc1
    output 2f, silu output, gate x up, the chunk copy); rotary cos/sin for q and k (4d); the
    softmax output (a/t x s_kv per query token) and the causal mask (1 B per score, per layer);
    Qwen3's q/k norms (``qk_layernorm``) keep the same three tensors and 1/rms per head:
    (3(q + kv) + a + g)/t.
    ``fused_attention=True`` is the TransformerEngine path (Korthikanti et al. 2022 accounting
    without dropout): norms 4h, Q/K/V (q + 2kv)/t, context q/t, SwiGLU 4f/t, fp32 log-sum-exp;
    q/k norms their input (q + kv)/t and an fp32 1/rms per head (not measured: no TE here).
    ``recompute=SELECTIVE`` on the local path: what stays stored when Megatron checkpoints the
    core attention (module docstring); FULL is not a per-layer set (``train_layer_bytes``).
    """
    t, c, h, f = layout.tp, layout.cp, model.hidden_size, model.ffn_hidden_size
    a, d = model.num_attention_heads, model.head_dim
    q, kv = a * d, model.num_query_groups * d
    local = math.ceil(tokens / c)
    # q/k norms (Qwen3): their elements and their rows (one 1/rms per head) on this tp rank
    qk, qk_rows = ((q + kv) // t, (a + model.num_query_groups) // t) if model.qk_layernorm \
        else (0, 0)
    # MoE: the MLP is the router and experts (moe_layer_activation_bytes); with tp > 1 it runs
    # under sequence parallelism, where the norms keep tokens/tp (dense models: never here)
    sp = layout.sequence_parallel(model)
    mlp = 0 if model.is_moe else (4 if fused_attention else 5) * f // t
    norms = 4 * h if fused_attention else 2 * (3 * h + 1)
    extra = 0
    if model.is_moe:
        moe_tokens = math.ceil(local / t) if sp else local
        extra = moe_layer_activation_bytes(model, layout, moe_tokens, act_bytes,
                                           fused_attention=fused_attention)
        if sp:
            extra += moe_tokens * norms * act_bytes
    if fused_attention:
        per_token = act_bytes * ((0 if sp else norms) + (q + 2 * kv) // t + q // t + mlp + qk)
        return local * (per_token + (a // t + qk_rows) * 4) + extra  # + fp32 lse, 1/rms
    if recompute is Recompute.SELECTIVE:
        # roped q and k, the context, and the fused qkv output (value's view keeps it; q/k
        # norms already keep it, their inputs being views of it)
        fused_qkv = 0 if model.qk_layernorm else (q + 2 * kv) // t
        attention = (q + kv) // t + fused_qkv + q // t
    else:
        attention = _core_attention_elements(model, layout) + q // t     # + the context
    per_token = act_bytes * ((0 if sp else norms) + attention + mlp + 4 * d + 3 * qk + qk_rows)
    total = local * per_token + extra
    if recompute is Recompute.SELECTIVE:
        return total + MASK_TYPE_BYTES
    return total + _scores_bytes(model, layout, tokens, longest, act_bytes)


def _core_attention_elements(model: ModelConfig, layout: ParallelLayout) -> int:
    """Elements per local token the unfused core attention saves besides the scores: K and V
    repeated to every query head (x cp: the all-gather CP attention keeps the gathered K and
    V) and Q."""
    q_local = model.num_attention_heads * model.head_dim // layout.tp
    return 2 * q_local * layout.cp + q_local


def _scores_bytes(model: ModelConfig, layout: ParallelLayout, tokens: int, longest: int,
                  act_bytes: int) -> int:
    """The unfused softmax output (a/t per score) and the 1-byte causal mask of one layer.
    Packed sequences: sum of s_i^2 over the micro-batch is at most tokens * longest."""
    scores = math.ceil(tokens * min(longest, tokens) / layout.cp)
    return scores * ((model.num_attention_heads // layout.tp) * act_bytes + 1)


@dataclass(frozen=True)
class LayerActivations:
    """One layer's TRAIN activations under a recompute mode (module docstring)."""

    stored: int
    """Kept per layer and micro-batch in flight until the layer's backward."""
    transient: int
    """Rebuilt by one layer during its backward (the recomputed part)."""


def train_layer_bytes(model: ModelConfig, layout: ParallelLayout, tokens: int, longest: int,
                      act_bytes: int, *, fused_attention: bool,
                      recompute: Recompute) -> LayerActivations:
    """(stored, transient) of one layer for a micro-batch of ``tokens`` (before the cp split)."""
    whole = layer_activation_bytes(model, layout, tokens, longest, act_bytes,
                                   fused_attention=fused_attention)
    if recompute is Recompute.FULL:
        local = math.ceil(tokens / layout.cp)
        if layout.sequence_parallel(model):
            local = math.ceil(local / layout.tp)
        return LayerActivations(local * model.hidden_size * act_bytes, whole)
    if recompute is Recompute.SELECTIVE and not fused_attention:
        stored = layer_activation_bytes(model, layout, tokens, longest, act_bytes,
                                        fused_attention=False, recompute=recompute)
        core = math.ceil(tokens / layout.cp) * act_bytes * _core_attention_elements(model, layout)
        return LayerActivations(stored, core + _scores_bytes(model, layout, tokens, longest,
                                                             act_bytes))
    return LayerActivations(whole, 0)     # none, or selective over flash attention


def moe_routed_tokens(model: ModelConfig, layout: ParallelLayout, moe_tokens: int) -> int:
    """Token copies one rank's experts process when ``moe_tokens`` tokens enter its MoE layer:
    top-k copies of each, all-gathered over the expert-TP group (an even routing)."""
    return moe_tokens * layout.expert_tp * model.moe_router_topk


def moe_layer_activation_bytes(model: ModelConfig, layout: ParallelLayout, moe_tokens: int,
                               act_bytes: int, *, fused_attention: bool) -> int:
    """What one MoE layer's router and experts keep for the backward when ``moe_tokens`` tokens
    enter it on this rank (module docstring): fp32 router logits and softmax (2E) and top-k
    probs per token; per routed copy the permuted input and the expert output (2h, for the
    weighted combine) and SwiGLU at width moe_ffn/etp."""
    routed = moe_routed_tokens(model, layout, moe_tokens)
    mf = model.moe_ffn_hidden_size // layout.expert_tp
    router = moe_tokens * 4 * (2 * model.num_experts + model.moe_router_topk)
    swiglu = (4 if fused_attention else 5) * mf
    return router + routed * act_bytes * (2 * model.hidden_size + swiglu)


def moe_dispatch_buffer_bytes(model: ModelConfig, layout: ParallelLayout, tokens: int,
                              act_bytes: int) -> int:
    """The all-to-all send and receive buffers of one MoE layer (comm_buffers) for a micro-batch
    of ``tokens`` (before the cp split); 0 for a dense model or ep = 1."""
    if not model.is_moe or layout.ep == 1:
        return 0
    local = math.ceil(tokens / layout.cp)
    moe_tokens = math.ceil(local / layout.tp) if layout.sequence_parallel(model) else local
    return 2 * moe_tokens * model.moe_router_topk * model.hidden_size * act_bytes
