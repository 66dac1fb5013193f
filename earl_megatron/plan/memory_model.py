"""Per-rank memory of one RL stage under one layout: exact parameter counts, modelled activations.

Terms (bytes per rank; the estimate is for the pp_stage that needs the most):

- weights: ``param_count_per_rank`` x param bytes, summed over the tensor table's rows
  (plan/tensor_table.py). EXACT for Megatron-Core 0.16 ``GPTModel`` with the local layer spec
  (checked against live models in tests/unit/test_memory_model.py); the TE spec has the same
  counts (the same rows: its norm weights live in linear_qkv / linear_fc1 as layer_norm_weight).
  Mixture of experts: an expert's rows are on its ep rank only, split ``etp`` ways
  (``tensor_table.elements_on(pp_rank, tp, pp, ep, etp)``): expert bytes per rank are the
  model's expert bytes / (ep x etp) exactly; the router and every dense row as for a dense model.
- LoRA (``model.lora.rank`` >= 1, plan/lora_memory.py): weights count the frozen base and the
  adapters; grads and optimizer the adapters only; TRAIN activations add the adapters' own;
  every stage's layers are Megatron's local ones (unfused attention), on GPUs too.
- grads (TRAIN): the DDP ``main_grad`` buffer, one element per local parameter in ``grad_dtype``
  (experts' in Megatron's expert-parallel buffers, the same count).
  Megatron pads each bucket to a multiple of lcm(dp*cp, 128) elements; that padding is ignored.
- optimizer (TRAIN): Adam moments (8 B/param) plus an fp32 master copy (4 B) for bf16 params,
  divided under the distributed optimizer by dp*cp for dense params (Megatron shards over the
  dp-with-cp group) and by ``edp`` for expert params (the expert data-parallel group, over which
  their grads are reduced): ``train_state_split``.
- activations: one layer's saved tensors (plan/activations.py: the TransformerEngine path and
  Megatron's local spec on CPU, whose saved tensors match it exactly; MoE layers modelled under
  an even routing) times the layers of the pp_stage. Context parallel splits the tokens by cp;
  the all-gather CP attention used without TransformerEngine keeps the gathered K and V (x cp).
  TRAIN: 1F1B keeps pp - pp_rank micro-batches in flight on pp_rank (Narayanan et al. 2021),
  each holding every local layer's ``stored`` part under the recompute mode, plus one layer's
  ``transient`` (what it rebuilds in its backward): ``train_layer_bytes``.
- logits (last pp_stage): vocab/tp per token in activation dtype plus two fp32 working copies
  (upcast and the saved softmax for the backward), plus the logits' gradient in TRAIN.
- kv_cache (ROLLOUT): 2 x (g/t) x head_dim x b per token per local layer, for the responses one
  replica is asked to run (``StageWorkload.responses_per_replica``), see ``rollout_kv``: a
  static cache (``DecodeEngine.paged_kv=False``, the embedded engine; also the model when no
  cluster is given) reserves the longest context for every one of them; a paged pool (SGLang,
  vLLM) takes what is left of ``memory_fraction`` of the device after everything else, never
  less than one whole sequence, and never more than all of them need: the running batch is
  what the pool holds (time_model.py), so long contexts and many responses cost throughput,
  not memory, until ONE sequence does not fit. Prefill runs in chunks of ``micro_batch_tokens``.
  Inference servers (``DecodeEngine.servers``, SGLang as the trainer starts it) allocate their
  pool statically: ``memory_fraction`` x device memory minus what the device already holds
  (the trainer's weights and resident bytes, the server's own weights, reserved), whatever the
  responses need; a pool smaller than one sequence does not fit (``server_pool_fits``).
  Servers alone on their devices (``DecodeEngine.beside_trainer`` False: split placement's
  rollout pool) hold no trainer weights: the weights term is 0.
- server_weights (ROLLOUT on servers): the server's own copy, weights / tp (pp = cp = 1).
- comm_buffers: pipeline p2p send/recv tensors (two each way in TRAIN) and the transient gathered
  K/V of one layer for CP outside TRAIN; with ep > 1 one MoE layer's all-to-all send and
  receive buffers (``moe_dispatch_buffer_bytes``). TP all-reduces run in place; DDP and the
  distributed optimizer communicate inside their own buffers.
- reserved: ``ClusterSpec.reserved_bytes`` (CUDA context, NCCL, allocator slack).
- resident: bytes other stages leave on the device (e.g. optimizer state kept during rollout),
  passed in by the caller.

Invariants: every term is a non-negative int; for a fixed layout the total is non-decreasing in
the context lengths, the micro-batch budget and the responses in flight, and so is every term
except a paged pool's kv_cache, which is what the other terms leave (it shrinks as they grow,
keeping the total at the engine's memory fraction).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import Optional

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.activations import (  # noqa: F401 - re-exported for callers
    layer_activation_bytes, moe_dispatch_buffer_bytes, moe_layer_activation_bytes,
    moe_routed_tokens, train_layer_bytes)
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.lora_memory import trained_elements_on, with_adapters
from earl_megatron.plan.rollout_rules import rollout_layout_problem
from earl_megatron.plan.specs import (ClusterSpec, DecodeEngine, Stage, StageWorkload,
                                     TrainOptions, human_bytes)
from earl_megatron.plan.tensor_table import tensor_table


def param_count_per_rank(model: ModelConfig, layout: ParallelLayout, pp_rank: int) -> int:
    """Exact parameter elements of one rank of ``pp_rank`` (the tensor table's rows there; every
    tp/cp/dp/ep rank of a pp_stage holds the same count: an ep rank E/ep experts, etp-split)."""
    layout.check(layout.world_size, model)
    if not 0 <= pp_rank < layout.pp:
        raise ValueError(f"pp_rank {pp_rank} out of range for pp={layout.pp}")
    return tensor_table(model).elements_on(pp_rank, layout.tp, layout.pp, layout.ep,
                                           layout.expert_tp)


def expert_param_count_per_rank(model: ModelConfig, layout: ParallelLayout, pp_rank: int) -> int:
    """The expert part of ``param_count_per_rank`` (0 for a dense model): the pp_stage's expert
    elements / (ep x etp), exactly (E divides by ep and moe_ffn, hence every expert row, by etp:
    checked by the layout)."""
    if not model.is_moe:
        return 0
    layout.check(layout.world_size, model)
    return _pp_stage_expert_elements(model, pp_rank, layout.pp) \
        // (layout.expert_tp * layout.ep)


@functools.lru_cache(maxsize=1024)
def _pp_stage_expert_elements(model: ModelConfig, pp_rank: int, pp: int) -> int:
    return sum(r.numel for r in tensor_table(model).on_pp_stage(pp_rank, pp)
               if r.expert is not None)


def train_state_split(model: ModelConfig, layout: ParallelLayout, pp_rank: int,
                      opts: TrainOptions) -> tuple[int, int]:
    """(grad bytes, optimizer bytes) of one rank of ``pp_rank``: the distributed optimizer
    shards dense params over dp x cp and expert params over the expert-dp group (edp). With
    LoRA only the adapters have either (plan/lora_memory.py)."""
    if model.lora.enabled:   # the base is frozen: the adapters alone (dense, never experts)
        params, experts = trained_elements_on(model, layout, pp_rank), 0
    else:
        params = param_count_per_rank(model, layout, pp_rank)
        experts = expert_param_count_per_rank(model, layout, pp_rank)
    obpp = opts.optimizer_bytes_per_param(model)
    dense_shard = layout.dp * layout.cp if opts.distributed_optimizer else 1
    expert_shard = layout.edp if opts.distributed_optimizer else 1
    optimizer = math.ceil((params - experts) * obpp / dense_shard)
    if experts:
        optimizer += math.ceil(experts * obpp / expert_shard)
    return params * opts.grad_bytes, optimizer


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by term, for the pp_stage (``pp_rank``) with the largest total."""

    stage: Stage
    layout: ParallelLayout
    pp_rank: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    kv_cache: int
    comm_buffers: int
    reserved: int
    resident: int
    server_weights: int = 0

    @property
    def total(self) -> int:
        return sum(self.terms().values())

    def terms(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("stage", "layout", "pp_rank")}

    def describe(self) -> str:
        parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in self.terms().items() if v)
        return (f"{self.stage.value} {self.layout} pp_rank {self.pp_rank}: "
                f"{human_bytes(self.total)} ({parts})")


def _micro_batches_per_replica(workload: StageWorkload, layout: ParallelLayout) -> int:
    """Micro-batches of the busiest replica: its share of the tokens, and at least what its
    share of whole sequences needs (a sequence is never split: 5 sequences of 268 tokens on
    dp4 put 2 on one replica, which a 512-token budget still takes in 2 micro-batches; counting
    tokens alone said 1, so a larger budget lowered the estimate)."""
    eff = workload.effective_micro_batch_tokens
    tokens = math.ceil(workload.total_tokens / layout.dp)
    sequences = math.ceil(workload.num_sequences / layout.dp)
    per_micro_batch = max(1, eff // workload.max_context)
    return max(1, math.ceil(tokens / eff), math.ceil(sequences / per_micro_batch))


@dataclass(frozen=True)
class RolloutKV:
    """One rollout replica's KV cache on its busiest rank (``rollout_kv``)."""

    requested: int
    """Responses the replica is asked to run at once."""
    running: int
    """Responses it decodes concurrently: all requested (static cache) or what the pool holds."""
    bytes_per_sequence: int
    """KV of one sequence at the longest context, on one rank."""
    cache_bytes: int
    """The kv_cache memory term."""


def rollout_kv(model: ModelConfig, layout: ParallelLayout, workload: StageWorkload,
               other_bytes: int, engine: DecodeEngine, device_memory_bytes: int,
               param_bytes: int) -> RolloutKV:
    """KV cache and running batch of one replica; ``other_bytes`` is every other memory term of
    the rank (weights, activations, logits, buffers, reserved, resident): a paged pool gets
    ``memory_fraction`` x device memory minus those."""
    t, c = layout.tp, layout.cp
    layers = model.num_layers // layout.pp
    per_token = 2 * (model.num_query_groups // t) * model.head_dim * param_bytes * layers
    per_seq = math.ceil(workload.max_context / c) * per_token
    requested = workload.responses_per_replica(layout.dp)
    if not engine.paged_kv:
        return RolloutKV(requested, requested, per_seq, requested * per_seq)
    pool = int(device_memory_bytes * engine.memory_fraction) - other_bytes
    # servers take their whole pool at start; a trainer-side pool only what the responses need
    cache = max(per_seq, pool if engine.servers else min(requested * per_seq, pool))
    # Pages are taken as tokens arrive: over its decode a sequence holds its prefilled part and,
    # on average, half of what it generates; the pool admits that many sequences at once.
    occupancy = math.ceil(math.ceil(workload.mean_context * (1 - workload.decode_fraction / 2))
                          / c) * per_token
    running = max(1, min(requested, pool // occupancy)) if pool >= per_seq else 1
    return RolloutKV(requested, running, per_seq, cache)


def _memory_for_pp_rank(model: ModelConfig, layout: ParallelLayout, pp_rank: int,
                        workload: StageWorkload, opts: TrainOptions, fused: bool,
                        reserved: int, resident: int,
                        cluster: Optional[ClusterSpec] = None) -> MemoryEstimate:
    stage = workload.stage
    b = opts.param_bytes(model)
    t, c, pp = layout.tp, layout.cp, layout.pp
    h = model.hidden_size
    params = param_count_per_rank(model, layout, pp_rank)
    layers = model.num_layers // pp
    last = pp_rank == pp - 1
    # Training and scoring keep a sequence in one micro-batch; rollout prefills in chunks of the
    # budget (the KV cache holds the earlier chunks), so a long context needs no long chunk.
    if stage is Stage.ROLLOUT:
        # a prefill chunk holds at most the replica's prompts: its responses, padded to the
        # longest (a 49,152-token vocabulary makes the chunk's logits the largest term)
        mb = min(workload.micro_batch_tokens,
                 workload.responses_per_replica(layout.dp) * workload.max_context)
    else:
        mb = workload.effective_micro_batch_tokens
    longest = workload.max_context
    local_mb = math.ceil(mb / c)
    vocab_local = model.vocab_size // t

    grads = optimizer = kv_cache = server_weights = 0
    layer_full = layer_activation_bytes(model, layout, mb, longest, b, fused_attention=fused)
    dispatch = moe_dispatch_buffer_bytes(model, layout, mb, b)
    if stage is Stage.TRAIN:
        grads, optimizer = train_state_split(model, layout, pp_rank, opts)
        in_flight = min(pp - pp_rank, _micro_batches_per_replica(workload, layout))
        layer = train_layer_bytes(model, layout, mb, longest, b, fused_attention=fused,
                                  recompute=opts.recompute)
        if model.lora.enabled:
            layer = with_adapters(layer, model, layout, mb, b, opts.recompute)
        activations = in_flight * layers * layer.stored + layer.transient
        logits = local_mb * vocab_local * (2 * b + 8) if last else 0
        comm = (4 * local_mb * h * b if pp > 1 else 0) + dispatch
    elif stage is Stage.LOGPROB:
        activations = layer_full                # forward only: one layer alive at a time
        logits = local_mb * vocab_local * (b + 8) if last else 0
        comm = (2 * local_mb * h * b if pp > 1 else 0) + dispatch
        if c > 1:
            comm += mb * 2 * model.num_query_groups * model.head_dim // t * b
    else:
        # ROLLOUT: the running batch shares the replica's KV cache (rollout_kv); prefill runs
        # in chunks of the micro-batch budget, decoding one token per running response per step
        seqs = workload.responses_per_replica(layout.dp)
        decode = layer_activation_bytes(model, layout, seqs * c, 1, b, fused_attention=True)
        if not fused:
            decode += seqs * (model.num_attention_heads // t) * math.ceil(longest / c) * b
        activations = max(layer_full, decode)
        logits = max(local_mb * vocab_local * (b + 4), seqs * vocab_local * 4) if last else 0
        comm = (2 * local_mb * h * b if pp > 1 else 0) + dispatch
        if c > 1:
            comm += mb * 2 * model.num_query_groups * model.head_dim // t * b
        engine = cluster.decode_engine if cluster is not None else DecodeEngine.embedded()
        memory = cluster.device_memory_bytes if cluster is not None else 0
        held = params * b + activations + logits + comm + reserved + resident
        if engine.servers:
            problem = rollout_layout_problem(layout, "sglang")
            if problem:
                raise ValueError(f"{engine.name} servers: {problem}")
            server_weights = params * b
            trainer = params * b if engine.beside_trainer else 0
            held = trainer + server_weights + reserved + resident   # at the server's start
        kv_cache = rollout_kv(model, layout, workload, held, engine, memory, b).cache_bytes
    weights = 0 if server_weights and not engine.beside_trainer else params * b
    return MemoryEstimate(stage=stage, layout=layout, pp_rank=pp_rank, weights=weights,
                          grads=grads, optimizer=optimizer, activations=activations,
                          logits=logits, kv_cache=kv_cache, comm_buffers=comm,
                          reserved=reserved, resident=resident, server_weights=server_weights)


def pool_held_bytes(estimate: MemoryEstimate, engine: DecodeEngine) -> int:
    """The ``other_bytes`` a ROLLOUT estimate's pool was sized against (``rollout_kv``)."""
    if engine.servers:
        return estimate.weights + estimate.server_weights + estimate.reserved + estimate.resident
    return estimate.total - estimate.kv_cache


def server_pool_fits(estimate: MemoryEstimate, cluster: ClusterSpec) -> bool:
    """False when servers' static pool (``memory_fraction`` x device memory minus what the
    device holds at their start) cannot hold one sequence: the server would refuse it."""
    engine = cluster.decode_engine
    if estimate.stage is not Stage.ROLLOUT or not engine.servers:
        return True
    return pool_held_bytes(estimate, engine) + estimate.kv_cache <= \
        int(cluster.device_memory_bytes * engine.memory_fraction)


def memory_by_pp_rank(model: ModelConfig, layout: ParallelLayout, workload: StageWorkload,
                      train_opts: TrainOptions = TrainOptions(), *,
                      cluster: Optional[ClusterSpec] = None,
                      resident_bytes: int = 0) -> tuple[MemoryEstimate, ...]:
    """One estimate per pp_stage (all ranks of a pp_stage need the same memory)."""
    if resident_bytes < 0:
        raise ValueError(f"resident_bytes must be >= 0, got {resident_bytes}")
    # a LoRA model builds Megatron's local layers on GPUs too (models/provider.py te_layers:
    # its adapters do not wrap TE's linears), whose unfused attention keeps the scores
    fused = (True if cluster is None else cluster.fused_attention) and not model.lora.enabled
    reserved = 0 if cluster is None else cluster.reserved_bytes
    return tuple(_memory_for_pp_rank(model, layout, r, workload, train_opts, fused, reserved,
                                     resident_bytes, cluster) for r in range(layout.pp))


def memory_breakdown(model: ModelConfig, layout: ParallelLayout, workload: StageWorkload,
                     train_opts: TrainOptions = TrainOptions(), *,
                     cluster: Optional[ClusterSpec] = None,
                     resident_bytes: int = 0) -> MemoryEstimate:
    """The estimate of the pp_stage that needs the most memory (the lowest pp_rank on ties)."""
    per_rank = memory_by_pp_rank(model, layout, workload, train_opts, cluster=cluster,
                                 resident_bytes=resident_bytes)
    return max(per_rank, key=lambda e: (e.total, -e.pp_rank))


def train_state_bytes(model: ModelConfig, layout: ParallelLayout,
                      train_opts: TrainOptions = TrainOptions()) -> int:
    """Grads + optimizer state per rank of the most loaded pp_stage: what stays resident outside
    TRAIN when the training state is not offloaded (pass it as ``resident_bytes``)."""
    return max(sum(train_state_split(model, layout, r, train_opts)) for r in range(layout.pp))
