"""The LOGPROB and TRAIN stages: dispatch point to point, then Megatron's schedules.

Both take the episodes where the rollout left them (every rank of rollout replica d holds its
block, see trainer/rollout.py) and the micro-batch plan of their own layout:

    rollout layout R (replica d holds its block)    logprob layout L (the reference model)
      every rank of replica d: input_ids, labels ──► dp rank of L: micro-batches, cp chunks
      every rank of replica d: ref_logprobs      ◄── last pp_stage of L: logp of each label

    rollout layout R                                 train layout T
      every rank of replica d: TRAIN_TENSORS     ──► dp rank of T: micro-batches, cp chunks

Lengths: each sample is padded to its micro-batch's length, a multiple of 2 * cp of the
consuming layout (so a cp zigzag split is even; 1 when cp = 1), plan/batching.py.
Invariant: every policy token of every episode is in exactly one micro-batch of exactly one dp
rank of the consuming layout (the dispatcher's exactly-once guarantee).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.batching import MicroBatchPlan, plan_micro_batches
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.rollout_rules import rollout_layout_problem
from earl_megatron.rl.losses import (PolicyLossConfig, masked_sums, policy_loss, ratio_sums,
                                     sequence_sums, sequence_terms)
from earl_megatron.runtime import groups
from earl_megatron.runtime.build import ModelOnLayout
from earl_megatron.runtime.dispatcher import SampleMeta, dispatch
from earl_megatron.runtime.reduce import global_sum
from earl_megatron.runtime.step_inputs import (LOGPROB_TENSORS, REF_LOGPROBS, microbatches,
                                               shifted_ids, train_tensors)


@dataclass(frozen=True)
class BatchShape:
    micro_batch_size: int
    """Samples per micro-batch at most."""
    micro_batch_tokens: Optional[int] = None
    """Padded tokens per micro-batch at most (None: no limit)."""


def micro_batch_plan(layout: ParallelLayout, tokens: dict[int, int], shape: BatchShape,
                     model: Optional[ModelConfig] = None) -> MicroBatchPlan:
    """Length-grouped micro-batches of ``layout`` for episodes of ``tokens`` tokens each (one
    prediction fewer than tokens), padded to ``layout.length_multiple(model)`` (2 * cp with CP,
    times tp under sequence parallelism)."""
    multiple = layout.length_multiple(model)
    return plan_micro_batches({s: n - 1 for s, n in tokens.items()}, layout.dp,
                              shape.micro_batch_size, multiple, shape.micro_batch_tokens)


def dispatched_microbatches(model: ModelOnLayout, producer: ParallelLayout, ids: list[int],
                            local: dict, plan: MicroBatchPlan, tensors, *, fill: bool = True
                            ) -> tuple[list[dict], list[list[int]], int]:
    """Dispatch this rank's ``local`` samples (held on every pp_stage of their ``producer``
    replica) to ``model``'s layout in ``plan``'s micro-batches and stack this rank's. With
    ``fill`` every dp rank runs as many micro-batches (all-masked rows of the shortest length
    fill in: they add nothing to the loss or the token count). Returns (micro-batches, their
    sample ids, bytes received here)."""
    return _dispatched(model, producer, ids, local, plan, tensors, fill)[:3]


def _dispatched(model: ModelOnLayout, producer: ParallelLayout, ids: list[int], local: dict,
                plan: MicroBatchPlan, tensors, fill: bool):
    """``dispatched_microbatches`` and the producer's blocks: ``[dp][0] -> sample ids`` of each
    rollout replica (from the dispatch's gathered metadata: sample ids need not be contiguous)."""
    lay, me = model.layout, model.coords
    result, _, meta = dispatch(producer, lay, [SampleMeta(s, plan.length_of[s]) for s in ids],
                               local, tensors,
                               producer_pp_stages={spec.name: "all" for spec in tensors},
                               assignment=plan.assignment)
    by_dp: list[set] = [set() for _ in range(producer.dp)]
    for rank, reported in enumerate(meta):
        by_dp[producer.coords(rank).dp].update(m.sample_id for m in reported)
    groups_of_ids = [list(mb) for mb in plan.assignment[me.dp]]
    batches = microbatches(result.tensors, groups_of_ids, seq_lens=plan.micro_batch_lengths(me.dp),
                           cp=lay.cp, cp_rank=me.cp, tensors=tensors, device=groups.device())
    count = max(len(mbs) for mbs in plan.assignment) if fill else 0
    while len(batches) < count:
        batches += microbatches({}, [[]], seq_lens=[min(plan.length_of.values())], cp=lay.cp,
                                cp_rank=me.cp, rows=1, tensors=tensors, device=groups.device())
    return (batches, groups_of_ids, int(result.stats.bytes_received),
            [[tuple(sorted(b))] for b in by_dp])


def with_routes(model: ModelOnLayout, tensors: tuple, local: dict, ids: list[int],
                routes: Optional[dict], plan: MicroBatchPlan) -> tuple:
    """Routing replay (MoE): each sample's rollout routes join ``local`` as per-token tensors
    (models/routing_replay.py), dispatched with the rest. Without routes: ``tensors``."""
    if routes is None:
        return tensors
    from earl_megatron.models.routing_replay import encode, route_specs

    for s in ids:
        for name, t in encode(routes[s], model.cfg.num_experts, plan.length_of[s]).items():
            local.setdefault(name, {})[s] = t
    return tuple(tensors) + route_specs(model.cfg.num_layers)


def replayed(model: ModelOnLayout, batches: list[dict], routes: Optional[dict]):
    """A block whose forwards replay each micro-batch's routes (none: a no-op)."""
    if routes is None:
        return contextlib.nullcontext()
    from earl_megatron.models.routing_replay import micro_batch_targets, replaying_micro_batches

    module = model.module()
    targets = micro_batch_targets(module, batches, model.cfg.num_experts,
                                  model.cfg.moe_router_topk, model.layout.tp, model.coords.tp,
                                  bool(model.tcfg.sequence_parallel))
    return replaying_micro_batches(module, targets)


def reference_logprobs(ref: ModelOnLayout, producer: ParallelLayout, ids: list[int],
                       token_ids: dict[int, list[int]], tokens: dict[int, int], pad_id: int,
                       shape: BatchShape, temperature: float = 1.0,
                       routes: Optional[dict[int, torch.Tensor]] = None
                       ) -> tuple[dict[int, torch.Tensor], int]:
    """The LOGPROB stage: the reference model's logprob of every prediction of this replica's
    episodes, on every rank of the replica. Returns ({sample id: [tokens - 1]}, bytes received).

    ``producer`` is the rollout layout; ``ids`` / ``token_ids`` this replica's block; ``tokens``
    every episode's length (identical on all ranks). ``routes`` (routing replay): each sample's
    rollout experts [tokens - 1, layers, topk], replayed in the forward.
    """
    from earl_megatron.runtime.step import forward_logprobs

    return scored_on(ref, producer, ids, token_ids, tokens, pad_id, shape, routes=routes,
                     forward=lambda model, batches, **kw: forward_logprobs(
                         model, batches, temperature=temperature, **kw))


def scored_on(model: ModelOnLayout, producer: ParallelLayout, ids: list[int],
              token_ids: dict[int, list[int]], tokens: dict[int, int], pad_id: int,
              shape: BatchShape, forward, routes: Optional[dict[int, torch.Tensor]] = None
              ) -> tuple[dict[int, torch.Tensor], int]:
    """A per-token forward of ``model`` over this replica's episodes, on every rank of the
    replica: the LOGPROB stage (``forward`` = runtime/step.forward_logprobs) and the critic's
    VALUES stage (forward_values). ``forward(model, batches, seq_len=, micro_batch_size=)``
    returns a [b, s_local] tensor per micro-batch on the last pp_stage; the result is
    ({sample id: [tokens - 1]}, bytes received), as ``reference_logprobs``'."""
    ref = model
    problem = rollout_layout_problem(producer, "embedded")
    if problem:   # replicas must hold whole episodes
        raise ValueError(f"episodes produced in another layout than a rollout's: {problem}")
    lay = ref.layout
    plan = micro_batch_plan(lay, tokens, shape, ref.cfg)
    length_of = plan.length_of
    local: dict[str, dict] = {spec.name: {} for spec in LOGPROB_TENSORS}
    for s in ids:
        local["input_ids"][s], local["labels"][s] = shifted_ids(token_ids[s], length_of[s],
                                                                pad_id)
    tensors = with_routes(ref, LOGPROB_TENSORS, local, ids, routes, plan)
    batches, groups_of_ids, received, blocks = _dispatched(ref, producer, ids, local, plan,
                                                           tensors, fill=False)
    with replayed(ref, batches, routes):
        out = forward(ref, batches, seq_len=plan.longest, micro_batch_size=plan.max_rows)
    back = {REF_LOGPROBS.name: {s: lp[i] for mb, lp in zip(groups_of_ids, out)
                                for i, s in enumerate(mb)}}
    # the way back: producer = L's last pp_stage (cp chunks), consumer = every rank of replica d
    to_replica = dataclasses.replace(REF_LOGPROBS, pp_stages="all")
    mine = [s for mb in groups_of_ids for s in mb]
    returned, _, _ = dispatch(lay, producer, [SampleMeta(s, length_of[s]) for s in mine], back,
                              (to_replica,), producer_pp_stages={REF_LOGPROBS.name: "last"},
                              assignment=blocks)
    got = returned.tensors[REF_LOGPROBS.name]   # empty where no sample came back here
    moved = received + int(returned.stats.bytes_received)
    return {s: got[s][:len(token_ids[s]) - 1].cpu() for s in ids}, moved


@dataclass(frozen=True)
class TrainStageResult:
    loss: float
    grad_norm: float
    bytes_received: int
    entropy: Optional[float]
    """Mean entropy per policy token of the sampling policy (entropy bonus on), else None."""
    ratio_mean: float
    """Mean pi/pi_old over policy tokens in the last epoch's step (~1 on-policy, epoch 1)."""
    clip_fraction: float
    """Policy tokens whose ratio left [1 - clip_eps_low, 1 + clip_eps_high] (last epoch;
    ``rl.losses.ratio_sums``)."""


def _ref_logp(mb: dict, logp: torch.Tensor) -> Optional[torch.Tensor]:
    if "ref_logprobs" not in mb:
        return None
    # off the policy tokens (padding, filler rows) the reference is 0: use logp there, so k3 is 0
    # instead of exp(-logp), which could overflow to inf and make inf * 0 = nan in the masked sum
    return torch.where(mb["loss_mask"] > 0, mb["ref_logprobs"], logp.detach())


def train_on(policy: ModelOnLayout, producer: ParallelLayout, ids: list[int], samples: dict,
             advantages: dict, plan: MicroBatchPlan, loss: PolicyLossConfig, epochs: int,
             routes: Optional[dict[int, torch.Tensor]] = None,
             weights: Optional[dict[int, float]] = None) -> TrainStageResult:
    """The TRAIN stage: dispatch this rank's samples to the train layout and run ``epochs``
    optimizer steps on them. ``plan`` (``micro_batch_plan`` of the train layout) fixes which
    samples train together; ``samples`` were built with its lengths. The reference logprobs
    travel only when the loss reads them (kl_coef > 0), each sample's aggregation weight only
    when given (``weights``: algorithm.loss_agg other than token_mean); the entropy bonus takes
    the logits path (one V/tp-wide fp32 buffer more per micro-batch), so only when
    entropy_coef > 0."""
    from earl_megatron.runtime.step import train_step, train_step_logprobs

    tensors = train_tensors(with_ref=loss.kl_coef > 0, with_weights=weights is not None)
    local = {spec.name: {} for spec in tensors}
    for s in ids:
        t = samples[s]
        for spec in tensors:
            if spec.name == "advantages":
                local[spec.name][s] = advantages[s]
            elif spec.name == "loss_weights":
                local[spec.name][s] = torch.full_like(t.loss_mask, weights[s])
            else:
                local[spec.name][s] = getattr(t, spec.name)
    tensors = with_routes(policy, tensors, local, ids, routes, plan)
    batches, _, received = dispatched_microbatches(policy, producer, ids, local, plan, tensors)
    kwargs = dict(seq_len=plan.longest, micro_batch_size=plan.max_rows)
    r, entropy, ratio = None, None, torch.full((3,), math.nan, dtype=torch.float64)
    for epoch in range(epochs):
        ratios: list = []
        if loss.entropy_coef:
            sums: list = []
            with replayed(policy, batches, routes):
                r = train_step_logprobs(policy, batches,
                                        loss_fn=_entropy_loss_fn(loss, sums, ratios), **kwargs)
            if epoch == 0:
                # the sampling policy's entropy (before this batch's first update)
                acc = over_world(policy, sums, 2)
                entropy = acc[0].item() / max(acc[1].item(), 1.0)
        else:
            with replayed(policy, batches, routes):
                r = train_step(policy, batches, loss_fn=_loss_fn(loss, ratios), **kwargs)
        ratio = over_world(policy, ratios, 3)
    tokens = max(ratio[2].item(), 1.0)
    return TrainStageResult(loss=r.loss if r is not None else math.nan,
                            grad_norm=r.grad_norm if r is not None else math.nan,
                            bytes_received=received, entropy=entropy,
                            ratio_mean=ratio[0].item() / tokens,
                            clip_fraction=ratio[1].item() / tokens)


def over_world(policy: ModelOnLayout, sums: list, width: int) -> torch.Tensor:
    """Per-micro-batch sums added over the world: the last pp_stage's tp rank 0 counts (tp
    ranks hold the same values), cp chunks and dp ranks add up. Collective."""
    acc = torch.zeros(width, dtype=torch.float64)
    if policy.post_process and policy.coords.tp == 0:
        acc += sum(sums, torch.zeros(width, dtype=torch.float64))
    return global_sum(acc)


def _sequence(cfg: PolicyLossConfig, logp: torch.Tensor, mb: dict):
    """GSPO's per-row terms of this micro-batch over whole episodes: each row's sums added over
    its cp chunks (every cp rank of the last pp_stage runs this micro-batch's loss together,
    so the all-reduce pairs up); None for the token-level losses."""
    if not cfg.sequence_level:
        return None
    import torch.distributed as dist

    sums = sequence_sums(logp, mb["old_logprobs"], mb["advantages"], mb["loss_mask"])
    cp = groups.cp_group()
    if dist.get_world_size(cp) > 1:
        dist.all_reduce(sums, group=cp)
    return sequence_terms(sums)


def _loss_fn(cfg: PolicyLossConfig, ratios: list):
    """Per-token loss on Megatron's cross-entropy output (the labels path: no entropy).
    Appends each micro-batch's ``rl.losses.ratio_sums`` to ``ratios``."""
    def loss_fn(output: torch.Tensor, mb: dict) -> torch.Tensor:
        logp = -output.float()  # Megatron returns the vocab-parallel cross entropy per token
        seq = _sequence(cfg, logp, mb)
        ratios.append(ratio_sums(logp, mb["old_logprobs"], mb["loss_mask"], cfg, seq))
        return policy_loss(logp, mb["old_logprobs"], mb["advantages"], cfg,
                           ref_logp=_ref_logp(mb, logp), seq=seq,
                           weights=mb.get("loss_weights"))
    return loss_fn


def _entropy_loss_fn(cfg: PolicyLossConfig, entropies: list, ratios: list):
    """Per-token loss on the logits path: TokenLogprobs -> loss with the entropy bonus. Appends
    each micro-batch's (masked entropy sum, policy tokens) to ``entropies`` and its
    ``rl.losses.ratio_sums`` to ``ratios``."""
    def loss_fn(tl, mb: dict) -> torch.Tensor:
        seq = _sequence(cfg, tl.logp, mb)
        entropies.append(masked_sums(tl.entropy, mb["loss_mask"]))
        ratios.append(ratio_sums(tl.logp, mb["old_logprobs"], mb["loss_mask"], cfg, seq))
        return policy_loss(tl.logp, mb["old_logprobs"], mb["advantages"], cfg,
                           ref_logp=_ref_logp(mb, tl.logp), entropy=tl.entropy, seq=seq,
                           weights=mb.get("loss_weights"))
    return loss_fn
