"""Predicted seconds of one RL stage under one layout: compute, communication, pipeline bubble.

An analytic roofline, meant to rank layouts, not to promise wall-clock time; the profile table
(profile_table.py) scales it to measurements. Terms (seconds, for the busiest rank):

- compute: FLOPs / (peak x achievable fraction). Forward FLOPs are 2 per matmul parameter per
  token plus attention 4*a*d*s per query token over s keys (halved by a causal fused kernel;
  Megatron's unfused attention computes the masked half too). TRAIN = 3x forward (Kaplan et al.
  2020; Narayanan et al. 2021) plus one more forward under full recompute, or the attention core
  under selective recompute. dp imbalance counts: a replica holds ceil(sequences/dp) sequences.
- ROLLOUT is priced per replica as a decode engine runs it (SGLang, vLLM, the embedded engine;
  ``ClusterSpec.decode_engine``): the replica is asked for ``responses_per_replica(dp)``
  responses; its running batch is what its KV cache holds (``rollout_running_batch``: all of
  them with a static cache, what the paged pool holds otherwise) and the rest wait, in waves.
  Prefill of the non-generated part of each context is compute bound (in ``compute``). A decode
  step advances every running response by one token and costs max(FLOPs / rate, (weights/tp/pp
  + KV of the running batch) / HBM bandwidth) + the tp all-reduces of the running batch's
  hidden states (2 per layer + 1, each with its ring latency: NVLink inside a node, the NIC
  across) + the engine's fixed ``step_overhead_s`` (in ``compute``).
- decode_memory (ROLLOUT): the memory-bound excess of the decode steps over their FLOPs
  (Pope et al. 2022). Why TP4 can beat TP8 per GPU: both halve weights and KV per GPU when tp
  doubles, but the fixed step overhead and the all-reduce latency do not shrink; why TP8 wins
  at long contexts and many responses: its pool holds twice the tokens, so its running batch
  stays whole where TP4's waits.
- tp_comm: ring all-reduce (2(n-1)/n x bytes / bw + 2(n-1) x latency) of the tp-local
  activations, 2 per layer forward (after linear_proj and linear_fc2) and 2 more backward
  (Shoeybi et al. 2019), plus the vocab-parallel embedding's one.
- cp_comm: all-gather of K and V per layer forward, the matching reduce-scatter backward.
- pp_comm: p2p of one micro-batch's hidden states per pp boundary (and its grad in TRAIN).
- pp_bubble: compute x (pp-1)/m for m micro-batches per replica (1F1B; bubble fraction
  (pp-1)/(m+pp-1) of the pipelined time).
- dp_comm (TRAIN): grad all-reduce over dp x cp, or reduce-scatter of grads + all-gather of
  params under the distributed optimizer; not assumed overlapped.
- optimizer_step (TRAIN): the Adam update is memory bound: ~28 B per local shard element.

Links: a group is intra-node when all its ranks share a node (rank // devices_per_node); else it
runs at inter-node latency and gets the node's inter-node bandwidth divided by the number of such
groups with a member on that node (they communicate at the same time).

Invariants: every term is finite and >= 0; nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import lru_cache

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.memory_model import (RolloutKV, memory_breakdown, param_count_per_rank,
                                             pool_held_bytes, rollout_kv)
from earl_megatron.plan.specs import ClusterSpec, Recompute, Stage, StageWorkload, TrainOptions


@dataclass(frozen=True)
class Link:
    bandwidth: float
    """Bytes/s one group member can send."""
    latency_s: float
    crosses_nodes: bool


@lru_cache(maxsize=4096)
def group_link(cluster: ClusterSpec, layout: ParallelLayout, axis: str) -> Link:
    """The link the groups along ``axis`` (e.g. "tp", "dp-cp") run over in this placement."""
    dpn = cluster.devices_per_node
    crossing_per_node: dict[int, int] = {}
    for group in layout.group_ranks(axis):
        nodes = {r // dpn for r in group}
        if len(nodes) > 1:
            for n in nodes:
                crossing_per_node[n] = crossing_per_node.get(n, 0) + 1
    if not crossing_per_node:
        return Link(cluster.intra_node_bandwidth, cluster.intra_node_latency_s, False)
    share = cluster.inter_node_bandwidth / max(crossing_per_node.values())
    return Link(min(cluster.intra_node_bandwidth, share), cluster.inter_node_latency_s, True)


def allreduce_seconds(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of an ``nbytes`` buffer over ``n`` ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency_s


def allgather_seconds(gathered_bytes: float, n: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) whose full result is ``gathered_bytes``."""
    if n <= 1 or gathered_bytes <= 0:
        return 0.0
    return (n - 1) / n * gathered_bytes / link.bandwidth + (n - 1) * link.latency_s


@dataclass(frozen=True)
class StageTime:
    """Predicted seconds of one stage by term (busiest rank)."""

    stage: Stage
    layout: ParallelLayout
    compute: float
    decode_memory: float
    tp_comm: float
    cp_comm: float
    pp_comm: float
    pp_bubble: float
    dp_comm: float
    optimizer_step: float

    @property
    def total(self) -> float:
        return sum(self.terms().values())

    def terms(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("stage", "layout")}

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v:.3g}" for k, v in self.terms().items() if v)
        return f"{self.stage.value} {self.layout}: {self.total:.3g} s ({parts})"


def matmul_params(model: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: all layers' linears and the output
    layer (the embedding is a lookup; norms and biases are negligible)."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.head_dim
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    return model.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * f) + model.vocab_size * h


def forward_flops(model: ModelConfig, workload: StageWorkload, *, fused_attention: bool) -> float:
    """Forward FLOPs over every sequence of the workload, as full (prefilled) sequences."""
    attn = 2 * model.num_attention_heads * model.head_dim * model.num_layers
    causal = 1 if fused_attention else 2      # an unfused kernel also computes the masked half
    return 2 * matmul_params(model) * workload.total_tokens + attn * causal * workload.sum_sq_tokens


def stage_time(model: ModelConfig, layout: ParallelLayout, workload: StageWorkload,
               cluster: ClusterSpec, train_opts: TrainOptions = TrainOptions()) -> StageTime:
    """Predicted seconds for ``workload`` under ``layout`` on ``cluster``."""
    layout.check(cluster.world_size, model)
    if workload.stage is Stage.ROLLOUT:
        return _rollout_time(model, layout, workload, cluster, train_opts)
    t, c, pp, dp = layout.tp, layout.cp, layout.pp, layout.dp
    b = train_opts.param_bytes(model)
    h = model.hidden_size
    rate = cluster.achievable_flops
    imbalance = math.ceil(workload.num_sequences / dp) * dp / workload.num_sequences
    fused = cluster.fused_attention
    fwd = forward_flops(model, workload, fused_attention=fused)
    attn_fwd = fwd - 2 * matmul_params(model) * workload.total_tokens
    train = workload.stage is Stage.TRAIN
    if train:
        flops = 3 * fwd + {Recompute.NONE: 0.0, Recompute.SELECTIVE: attn_fwd,
                           Recompute.FULL: fwd}[train_opts.recompute]
    else:
        flops = fwd
    compute = flops * imbalance / layout.world_size / rate

    tokens_replica = math.ceil(workload.total_tokens / dp * imbalance)
    mb_tokens = workload.effective_micro_batch_tokens
    m = max(1, math.ceil(tokens_replica / mb_tokens))
    layers = model.num_layers // pp
    local_tokens = tokens_replica / c          # tokens this rank's layers see, over all mbs

    passes = (3 if train_opts.recompute is Recompute.FULL else 2) if train else 1
    n_tp = passes * (2 * layers + 1)           # + the vocab-parallel embedding's all-reduce
    tp_msg = local_tokens / m * h * b
    tp_comm = m * n_tp * allreduce_seconds(tp_msg, t, group_link(cluster, layout, "tp"))

    kv_bytes_tok = 2 * model.num_query_groups * model.head_dim // t * b
    cp_link = group_link(cluster, layout, "cp")
    n_cp = passes * layers
    cp_comm = m * n_cp * allgather_seconds(tokens_replica / m * kv_bytes_tok, c, cp_link)

    pp_comm = 0.0
    if pp > 1:
        link = group_link(cluster, layout, "pp")
        msg = local_tokens / m * h * b
        sends = 2 if train else 1
        pp_comm = m * sends * (msg / link.bandwidth + link.latency_s)
    pp_bubble = compute * (pp - 1) / m

    dp_comm = optimizer_step = 0.0
    if train:
        n = dp * c
        params = max(param_count_per_rank(model, layout, r) for r in range(pp))
        link = group_link(cluster, layout, "dp-cp")
        if train_opts.distributed_optimizer:
            dp_comm = (allgather_seconds(params * train_opts.grad_bytes, n, link)
                       + allgather_seconds(params * b, n, link))
        else:
            dp_comm = allreduce_seconds(params * train_opts.grad_bytes, n, link)
        shard = n if train_opts.distributed_optimizer else 1
        optimizer_step = params / shard * 28 / cluster.hbm_bandwidth
    return StageTime(stage=workload.stage, layout=layout, compute=compute, decode_memory=0.0,
                     tp_comm=tp_comm, cp_comm=cp_comm, pp_comm=pp_comm, pp_bubble=pp_bubble,
                     dp_comm=dp_comm, optimizer_step=optimizer_step)


def rollout_running_batch(model: ModelConfig, layout: ParallelLayout, workload: StageWorkload,
                          cluster: ClusterSpec, opts: TrainOptions = TrainOptions()) -> RolloutKV:
    """The KV cache and running batch of one rollout replica (memory_model.rollout_kv) on the
    most loaded pp_stage, as the memory model sizes them."""
    est = memory_breakdown(model, layout, workload, opts, cluster=cluster)
    others = pool_held_bytes(est, cluster.decode_engine)
    return rollout_kv(model, layout, workload, others, cluster.decode_engine,
                      cluster.device_memory_bytes, opts.param_bytes(model))


def _rollout_time(model: ModelConfig, layout: ParallelLayout, workload: StageWorkload,
                  cluster: ClusterSpec, opts: TrainOptions) -> StageTime:
    """A decode engine's stage time, per replica (module docstring, ROLLOUT)."""
    t, c, pp, dp = layout.tp, layout.cp, layout.pp, layout.dp
    b = opts.param_bytes(model)
    h, d = model.hidden_size, model.head_dim
    rate = cluster.achievable_flops
    engine = cluster.decode_engine
    model_ranks = layout.model_parallel_size
    seqs_replica = math.ceil(workload.num_sequences / dp)
    kv = rollout_running_batch(model, layout, workload, cluster, opts)
    running = kv.running
    waves = math.ceil(seqs_replica / running)
    share = seqs_replica / workload.num_sequences       # this replica's part of the work
    df = workload.decode_fraction
    mean_ctx = workload.mean_context
    layers = model.num_layers // pp

    # Prefill: the non-generated part of every sequence of the replica, compute bound.
    prefill_wl = workload.scaled_to(max(1, math.ceil(workload.contexts[-1][0] * (1 - df))))
    prefill = forward_flops(model, prefill_wl, fused_attention=cluster.fused_attention) \
        if df < 1 else 0.0
    prefill_s = prefill * share / model_ranks / rate

    # Decode: waves x steps; each step advances every running response by one token, reading
    # the rank's weights once and the running batch's KV cache, plus the engine's fixed cost.
    steps = waves * math.ceil(df * mean_ctx)
    avg_pos = mean_ctx * (1 - df / 2)                    # mean position attended during decode
    step_flops = running * (2 * matmul_params(model)
                            + 4 * model.num_attention_heads * d * model.num_layers * avg_pos)
    step_compute = step_flops / model_ranks / rate
    weight_bytes = max(param_count_per_rank(model, layout, r) for r in range(pp)) * b
    kv_read = running * avg_pos / c * layers * 2 * (model.num_query_groups // t) * d * b
    step_memory = (weight_bytes + kv_read) / cluster.hbm_bandwidth
    compute = prefill_s + steps * (step_compute + engine.step_overhead_s)
    decode_memory = steps * max(0.0, step_memory - step_compute)

    tp_link = group_link(cluster, layout, "tp")
    prefill_tokens = math.ceil(prefill_wl.total_tokens * share / c)
    m_prefill = max(1, math.ceil(prefill_tokens * c / workload.micro_batch_tokens))
    n_tp = 2 * layers + 1
    tp_comm = (m_prefill * n_tp * allreduce_seconds(prefill_tokens / m_prefill * h * b, t, tp_link)
               + steps * n_tp * allreduce_seconds(running * h * b, t, tp_link))
    cp_link = group_link(cluster, layout, "cp")
    kv_tok = 2 * model.num_query_groups * d // t * b
    # Prefill gathers K/V per layer; a decode step combines partial attention outputs per layer.
    cp_comm = (m_prefill * layers * allgather_seconds(prefill_tokens * c / m_prefill * kv_tok,
                                                      c, cp_link)
               + steps * layers * allgather_seconds(
                   running * model.num_attention_heads // t * d * b * c, c, cp_link))
    pp_comm = pp_bubble = 0.0
    if pp > 1:
        link = group_link(cluster, layout, "pp")
        pp_comm = ((m_prefill + steps) * (pp - 1) / pp * link.latency_s
                   + prefill_tokens * h * b / link.bandwidth
                   + steps * running * h * b / link.bandwidth)
        # A decode step pipelines g groups of responses through the pp_stages: (g + pp - 1)
        # group-steps, each reading the stage's weights again. The engine picks the best g.
        one_pass = max(step_memory, step_compute)
        best = min((g + pp - 1) * max((weight_bytes + kv_read / g) / cluster.hbm_bandwidth,
                                      step_compute / g)
                   for g in range(1, min(running, pp) + 1))
        pp_bubble = prefill_s * (pp - 1) / m_prefill + steps * (best - one_pass)
    return StageTime(stage=Stage.ROLLOUT, layout=layout, compute=compute,
                     decode_memory=decode_memory, tp_comm=tp_comm, cp_comm=cp_comm,
                     pp_comm=pp_comm, pp_bubble=pp_bubble, dp_comm=0.0, optimizer_step=0.0)


def decode_tokens(workload: StageWorkload) -> int:
    """Tokens a ROLLOUT workload generates (the rest of each context is prefilled)."""
    return sum(math.ceil(workload.decode_fraction * n) * k for n, k in workload.contexts)
