"""Old logprobs: the rollout engine's, or the policy's recomputed ones, and how far apart they are.

An engine's logprobs are not the trainer's: SGLang runs its own kernels (and on GPU, its own
precision), and even the embedded engine's KV-cached decode rounds differently from a full
forward. When the trainer re-scores the episodes on the old policy (the policy as it played,
before TRAIN), it records the mismatch over sampled tokens (loss mask 1):

    rollout_logprob_diff      mean |logp_train - logp_rollout|
    rollout_logprob_diff_max  max  |logp_train - logp_rollout|

over the tokens the current weights sampled (asynchronous RL's older tokens differ by the train
steps since, which the off-policy weights correct, docs/async.md).

In fp32 with weights synced every iteration both stay below 1e-4 (tested with SGLang on CPU):
a larger value means the engine served other weights than the trainer's.

``algorithm.old_logprobs``: "rollout" keeps the engine's logprobs as the old logprobs (PPO ratio
and clipping against what was sampled); "recompute" replaces them by the trainer's. The
re-scoring runs whenever either is needed: always for SGLang (the diff is the proof of weight
sync), and for the embedded engine only with "recompute".

``algorithm.off_policy`` (rl/advantages.py): with "recompute", each sampled token is also
weighted by w = pi_old / pi_rollout, capped ("tis") or dropped past the cap ("decoupled"),
returned per sample for the trainer to apply to the advantages; recorded as
``off_policy_weight_mean`` (over sampled tokens) and ``off_policy_capped_fraction`` (the
fraction the cap touched). Under asynchronous RL pi_rollout is the behaviour policy, weights up
to ``max_staleness`` train steps old, and pi_old the proximal one (decoupled PPO's names).

Token alignment: Episode.logprobs[j] is the logprob of token j (0.0 where loss_mask is 0); the
LOGPROB stage returns one value per prediction, entry j - 1 scoring token j.

One re-scoring path: ``rescore`` (the trainer's) and ``recompute_logprobs`` (token lists, for
the engine consistency tests) both call the LOGPROB stage, ``trainer.stages.reference_logprobs``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.rl.advantages import off_policy_weights
from earl_megatron.rollout.agent_loop import Episode
from earl_megatron.rollout.engine import check_prompts
from earl_megatron.runtime import groups
from earl_megatron.runtime.build import ModelOnLayout
from earl_megatron.trainer.stages import BatchShape, reference_logprobs


def recompute_logprobs(policy: ModelOnLayout, sequences: Sequence[Sequence[int]], *,
                       temperature: float = 1.0, micro_batch_size: int = 1,
                       pad_token_id: int = 0) -> list[list[float]]:
    """Per-token logprobs of every sequence under ``policy`` (any layout, DDP-wrapped or not),
    through ``reference_logprobs``: all sequences form one replica that every rank holds.
    Entry j is log p(seq[j] | seq[:j]) at ``temperature`` (entry 0, without context, is 0.0:
    aligned with ``Episode.logprobs``); greedy (temperature <= 0) scores at 1. Collective."""
    check_prompts(sequences)
    ids = list(range(len(sequences)))
    token_ids = {s: list(seq) for s, seq in zip(ids, sequences)}
    everyone = ParallelLayout(tp=groups.pool_span()[1])  # one replica: every rank holds all
    got, _ = reference_logprobs(policy, everyone, ids, token_ids,
                                {s: len(t) for s, t in token_ids.items()}, pad_token_id,
                                BatchShape(micro_batch_size),
                                temperature=temperature if temperature > 0 else 1.0)
    return [[0.0] + got[s].tolist() for s in ids]


def rescore(policy: ModelOnLayout, ids: list[int], episodes: list[Episode],
            tokens: dict[int, int], pad_id: int, batch: BatchShape, *, temperature: float,
            replace: bool, weights: Optional[tuple[str, float]] = None,
            routes: Optional[dict] = None, version: Optional[int] = None
            ) -> tuple[list[Episode], dict, dict[int, torch.Tensor]]:
    """(episodes, metrics, tis): the policy's logprobs of this replica's episodes (in the layout
    it played in), their distance to the engine's, the episodes with the trainer's logprobs when
    ``replace``, and with ``weights`` = (mode, cap) each sample's off-policy weights
    (rl/advantages.py ``off_policy_weights``: one per prediction, 1 off the sampled tokens;
    empty without). ``version``: the policy's; the diff covers only tokens it sampled (an
    asynchronous run's older tokens differ by the train steps since, not by the engine). ``routes``: routing replay's experts per sample (MoE).
    Collective over the world."""
    if temperature <= 0:
        raise ValueError("re-scoring needs the sampling temperature > 0 (greedy rollouts have "
                         "no sampling distribution to compare)")
    recomputed, _ = reference_logprobs(policy, policy.layout, ids,
                                       {s: e.token_ids for s, e in zip(ids, episodes)}, tokens,
                                       pad_id, batch, temperature=temperature, routes=routes)
    # [sum |diff|, fresh sampled tokens, sum of weights, capped tokens, sampled tokens]
    total = torch.zeros(5, dtype=torch.float64)
    worst = torch.zeros(1, dtype=torch.float64)
    out, tis = [], {}
    for s, e in zip(ids, episodes):
        mask = torch.tensor(e.loss_mask[1:], dtype=torch.bool)
        mine = recomputed[s].double()
        theirs = torch.tensor(e.logprobs[1:], dtype=torch.float64)
        fresh = mask
        if version is not None and e.versions:
            fresh = mask & (torch.tensor(e.versions[1:]) == version)
        diff = (mine - theirs).abs()[fresh]
        if diff.numel():
            total[:2] += torch.tensor([float(diff.sum()), diff.numel()], dtype=torch.float64)
            worst = torch.maximum(worst, diff.max().reshape(1))
        if weights is not None:
            tis[s], cut = off_policy_weights(mine, theirs, mask, weights[1], weights[0])
            total[2:] += torch.tensor([float(tis[s][mask].sum()), cut, int(mask.sum())],
                                      dtype=torch.float64)
        if replace:
            lp = [0.0] + [float(v) if m else 0.0 for v, m in zip(mine.tolist(), mask.tolist())]
            out.append(dataclasses.replace(e, logprobs=tuple(lp)))
        else:
            out.append(e)
    # every rank of a replica holds the same episodes: sums and counts repeat by the same
    # factor, so their ratio is the mean over all episodes; the max is unaffected
    dist.all_reduce(total, group=groups.pool_group())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=groups.pool_group())
    n = max(float(total[1]), 1.0)
    found = {"rollout_logprob_diff": float(total[0]) / n,
             "rollout_logprob_diff_max": float(worst[0])}
    if weights is not None:
        sampled = max(float(total[4]), 1.0)
        found.update(off_policy_weight_mean=float(total[2]) / sampled,
                     off_policy_capped_fraction=float(total[3]) / sampled)
    return out, found, tis
