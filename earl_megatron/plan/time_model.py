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
  params under the distributed optimizer; not assumed overlapped. Expert params: the same over
  the expert-dp group (edp), on its own link.
- optimizer_step (TRAIN): the Adam update is memory bound: ~28 B per local shard element.
- ep_comm (MoE, ep > 1): the token all-to-all of every MoE layer, dispatch and combine, forward
  (LOGPROB, ROLLOUT: prefill chunks and every decode step) and backward too in TRAIN (and the
  recomputed forward under full recompute). One all-to-all sends tokens x topk x hidden x b x
  (ep-1)/ep bytes per rank (``tokens``: what enters the rank's MoE layer, tokens/tp under
  sequence parallelism): ``alltoall_seconds`` (the part to ranks in the same node over the
  intra-node link, the rest through the node's share of the inter-node bandwidth, which every
  rank of the node uses at once). The expert-TP all-gather of the dispatched tokens is not
  priced separately (it takes the place of the dense MLP's tp all-reduce, kept in tp_comm).
- MoE compute: FLOPs from the active parameters (``matmul_params``: attention, router and
  top-k of the E experts per token; ``tensor_table.active_elements``), not the total. Decode
  reads the dense weights and the experts a step's routed tokens touch: E x (1 - (1 - k/E)^B)
  of E for a running batch of B (uniform routing), each rank its E/ep.

Links: a group is intra-node when all its ranks share a node (rank // devices_per_node); else it
runs at inter-node latency and gets the node's inter-node bandwidth divided by the number of such
groups with a member on that node (they communicate at the same time). Expert-grid axes ("ep",
"edp", "etp") are placed by ``ParallelLayout.expert_group_ranks``, the dense ones by
``group_ranks``.

Invariants: every term is finite and >= 0; nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import lru_cache

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import EXPERT_AXES, ParallelLayout
from earl_megatron.plan.memory_model import (RolloutKV, expert_param_count_per_rank,
                                             memory_breakdown, param_count_per_rank,
                                             pool_held_bytes, rollout_kv)
from earl_megatron.plan.specs import ClusterSpec, Recompute, Stage, StageWorkload, TrainOptions


@dataclass(frozen=True)
class Link:
    bandwidth: float
    """Bytes/s one group member can send."""
    latency_s: float
    crosses_nodes: bool


def _groups(layout: ParallelLayout, axis: str) -> list[list[int]]:
    """The rank groups along ``axis``: the expert grid's for "ep", "edp", "etp" (or a '-'-join
    of them), the dense grid's otherwise."""
    if set(axis.split("-")) <= set(EXPERT_AXES):
        return layout.expert_group_ranks(axis)
    return layout.group_ranks(axis)


@lru_cache(maxsize=4096)
def group_link(cluster: ClusterSpec, layout: ParallelLayout, axis: str) -> Link:
    """The link the groups along ``axis`` (e.g. "tp", "dp-cp", "ep") run over in this
    placement."""
    dpn = cluster.devices_per_node
    crossing_per_node: dict[int, int] = {}
    for group in _groups(layout, axis):
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


@lru_cache(maxsize=4096)
def alltoall_seconds(cluster: ClusterSpec, layout: ParallelLayout, nbytes: float) -> float:
    """One all-to-all over every ep group at once, each rank holding ``nbytes`` (1/ep of it
    stays): the slowest of the intra-node part (to ep peers in the rank's node, over the
    intra-node link) and each node's outgoing inter-node bytes (every rank of the node sends at
    once, so they share the node's inter-node bandwidth), plus (ep - 1) latencies."""
    n = layout.ep
    if n <= 1 or nbytes <= 0:
        return 0.0
    dpn = cluster.devices_per_node
    per_peer = nbytes / n
    intra = 0.0
    inter_by_node: dict[int, float] = {}
    crosses = False
    for group in layout.expert_group_ranks("ep"):
        on_node: dict[int, int] = {}
        for r in group:
            on_node[r // dpn] = on_node.get(r // dpn, 0) + 1
        crosses |= len(on_node) > 1
        for node, m in on_node.items():
            intra = max(intra, (m - 1) * per_peer / cluster.intra_node_bandwidth)
            inter_by_node[node] = inter_by_node.get(node, 0.0) + m * (n - m) * per_peer
    inter = max(inter_by_node.values()) / cluster.inter_node_bandwidth
    latency = cluster.inter_node_latency_s if crosses else cluster.intra_node_latency_s
    return max(intra, inter) + (n - 1) * latency


def moe_tokens_per_rank(model: ModelConfig, layout: ParallelLayout, tokens: float) -> float:
    """Tokens entering one rank's MoE layer when ``tokens`` reach its pp_stage's cp rank (the
    tp ranks split them under sequence parallelism)."""
    return tokens / layout.tp if layout.sequence_parallel(model) else tokens


def ep_alltoall_seconds(model: ModelConfig, layout: ParallelLayout, cluster: ClusterSpec,
                        tokens: float, b: int) -> float:
    """One dispatch (or combine) all-to-all of one MoE layer for ``tokens`` on this cp rank:
    top-k copies of hidden x b bytes each; 0 for a dense model or ep = 1."""
    if not model.is_moe or layout.ep == 1:
        return 0.0
    nbytes = moe_tokens_per_rank(model, layout, tokens) * model.moe_router_topk \
        * model.hidden_size * b
    return alltoall_seconds(cluster, layout, nbytes)


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
    ep_comm: float = 0.0
    """MoE token all-to-all (dispatch + combine); 0 for dense models and ep = 1."""

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
    layer (the embedding is a lookup; norms and biases are negligible). MoE: the ACTIVE ones,
    the router (E x h) and top-k experts' SwiGLU (k x 3 h mf) in place of the dense MLP."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.head_dim
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    if model.is_moe:
        mlp = model.num_experts * h + model.moe_router_topk * 3 * h * model.moe_ffn_hidden_size
        return model.num_layers * (h * (q + 2 * kv) + q * h + mlp) + model.vocab_size * h
    return model.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * f) + model.vocab_size * h


def experts_touched_fraction(model: ModelConfig, tokens: int) -> float:
    """Expected fraction of a layer's experts that ``tokens`` tokens route to (uniform top-k
    routing: 1 - (1 - k/E)^tokens); 1.0 for a dense model."""
    if not model.is_moe:
        return 1.0
    return 1.0 - (1.0 - model.moe_router_topk / model.num_experts) ** tokens


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
        busiest = max(range(pp), key=lambda r: param_count_per_rank(model, layout, r))
        experts = expert_param_count_per_rank(model, layout, busiest)
        params = param_count_per_rank(model, layout, busiest) - experts
        link = group_link(cluster, layout, "dp-cp")
        dp_comm = _grad_sync_seconds(params, n, link, train_opts, b)
        shard = n if train_opts.distributed_optimizer else 1
        if experts:     # expert grads are reduced, and their state sharded, over edp
            e, elink = layout.edp, group_link(cluster, layout, "edp")
            dp_comm += _grad_sync_seconds(experts, e, elink, train_opts, b)
            eshard = e if train_opts.distributed_optimizer else 1
            optimizer_step = (params / shard + experts / eshard) * 28 / cluster.hbm_bandwidth
        else:
            optimizer_step = params / shard * 28 / cluster.hbm_bandwidth
    # MoE: dispatch + combine per layer and pass (forward; + backward, + recompute in TRAIN)
    ep_comm = m * 2 * passes * layers * ep_alltoall_seconds(model, layout, cluster,
                                                            local_tokens / m, b)
    return StageTime(stage=workload.stage, layout=layout, compute=compute, decode_memory=0.0,
                     tp_comm=tp_comm, cp_comm=cp_comm, pp_comm=pp_comm, pp_bubble=pp_bubble,
                     dp_comm=dp_comm, optimizer_step=optimizer_step, ep_comm=ep_comm)


def _grad_sync_seconds(params: int, n: int, link: Link, opts: TrainOptions, b: int) -> float:
    """Grad all-reduce of ``params`` over ``n`` ranks, or reduce-scatter of the grads and
    all-gather of the params under the distributed optimizer."""
    if opts.distributed_optimizer:
        return (allgather_seconds(params * opts.grad_bytes, n, link)
                + allgather_seconds(params * b, n, link))
    return allreduce_seconds(params * opts.grad_bytes, n, link)


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
    # the rank's weights a decode step reads: the dense ones, and the experts its running
    # batch's routed tokens touch (all of them for a dense model)
    busiest = max(range(pp), key=lambda r: param_count_per_rank(model, layout, r))
    experts = expert_param_count_per_rank(model, layout, busiest)
    weight_bytes = (param_count_per_rank(model, layout, busiest) - experts) * b \
        + experts * b * experts_touched_fraction(model, running) if experts \
        else param_count_per_rank(model, layout, busiest) * b
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
    # MoE: dispatch + combine per layer, for each prefill chunk and each decode step
    ep_comm = 2 * layers * (m_prefill * ep_alltoall_seconds(model, layout, cluster,
                                                            prefill_tokens / m_prefill, b)
                            + steps * ep_alltoall_seconds(model, layout, cluster, running, b))
    return StageTime(stage=Stage.ROLLOUT, layout=layout, compute=compute,
                     decode_memory=decode_memory, tp_comm=tp_comm, cp_comm=cp_comm,
                     pp_comm=pp_comm, pp_bubble=pp_bubble, dp_comm=0.0, optimizer_step=0.0,
                     ep_comm=ep_comm)


def decode_tokens(workload: StageWorkload) -> int:
    """Tokens a ROLLOUT workload generates (the rest of each context is prefilled)."""
    return sum(math.ceil(workload.decode_fraction * n) * k for n, k in workload.contexts)
