"""The agentic RL loop, SPMD: every rank runs the same iteration, no driver process.

    plan layouts ─► ROLLOUT (switch, embedded engine, multi-turn episodes per dp replica)
                 ─► LOGPROB (kl on: the frozen reference model scores the episodes in its own
                             layout; dispatched there and back point to point)
                 ─► advantages (global stats by all-reduce over owners, never gathered;
                                kl_mode=reward: k1 KL subtracted from the rewards first)
                 ─► TRAIN (switch weights + optimizer state, dispatch samples point to point,
                          Megatron schedule with the policy loss [+ k3 KL] [- entropy bonus])
                 ─► metrics, checkpoint

The selector (or the static layouts of the config) gives each stage its layout; the switcher moves
the live model and optimizer between them in memory; the dispatcher moves per-sample tensors from
the rollout layout's replicas to the consumer layout's dp ranks and cp chunks.

Old logprobs: on-policy (``algorithm.epochs == 1``) the engine's rollout logprobs serve as the
old logprobs: they equal the trainer's recomputed ones within 1e-4 in fp32 (tested in the engine's
tests), so the policy is never re-scored; PPO epochs > 1 reuse the same old logprobs. The LOGPROB
stage runs only for the REFERENCE policy (``kl_mode`` loss or reward):

    rollout layout R (replica d holds its block)    logprob layout L (the reference model)
      every rank of replica d: input_ids, labels ──► dp rank of L: micro-batches, cp chunks
      every rank of replica d: ref_logprobs      ◄── last pp_stage of L: logp of each label

KL estimators (Schulman's k1/k3, as OpenRLHF uses them): in the reward, k1 = log pi_old -
log pi_ref per policy token (REINFORCE++; its sum over an episode is an unbiased estimate of the
sequence KL); in the loss, k3 = exp(ref - logp) - (ref - logp) - 1 (non-negative, low variance;
rl/losses.py). ``kl`` in the metrics is the mean over policy tokens of the estimator in use,
evaluated at the policy that sampled the batch.

Invariants: iteration ``i`` draws environment seeds and sampling seeds from (run.seed, i) only, so
a run resumed from a checkpoint replays the same iterations as one that never stopped.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from earl_megatron.config.train import TrainConfig
from earl_megatron.envs import make_env
from earl_megatron.plan.batching import MicroBatchPlan, plan_micro_batches
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.rl.advantages import turn_returns
from earl_megatron.rl.losses import PolicyLossConfig, k3_kl, policy_loss
from earl_megatron.rollout.agent_loop import AgentLoopConfig, run_episodes
from earl_megatron.rollout.engine import split_evenly
from earl_megatron.runtime.build import ModelOnLayout, OptimizerSpec
from earl_megatron.trainer.data import (LOGPROB_TENSORS, REF_LOGPROBS, microbatches,
                                        shifted_ids, train_tensors)

CP_MULTIPLE = 8
"""Prediction lengths are padded to a multiple of this (2 * the largest cp used here)."""


def optimizer_spec(cfg: TrainConfig) -> OptimizerSpec:
    a = cfg.algorithm
    return OptimizerSpec(lr=a.lr, weight_decay=a.weight_decay, clip_grad=a.clip_grad,
                         use_distributed_optimizer=a.use_distributed_optimizer)


def episode_seeds(cfg: TrainConfig, iteration: int, count: int) -> list[int]:
    """Environment seeds of one iteration (GRPO groups share a seed)."""
    g = cfg.algorithm.group_size
    base = cfg.run.seed * 1_000_003 + iteration * 10_007
    return [base + i // g for i in range(count)]


def play(mol: ModelOnLayout, cfg: TrainConfig, tokenizer, seeds: list[int], *, temperature: float,
         sample_seed: int, opponent: Optional[str] = None, should_stop=None):
    """This replica's block of episodes (all ranks of a replica return the same episodes).

    ``should_stop``: called before every turn by every rank of the replica (agent_loop);
    True raises RolloutAbandoned out of here.
    """
    from earl_megatron.rollout.embedded_engine import EmbeddedEngine

    lay = mol.layout
    block = split_evenly(len(seeds), lay.dp)[mol.coords.dp]
    kwargs = dict(cfg.env.kwargs)
    if opponent is not None:
        kwargs["opponent"] = opponent
    envs = [make_env(cfg.env.name, **kwargs) for _ in block]
    engine = EmbeddedEngine(mol, pad_token_id=tokenizer.pad_token_id, prompts="replica",
                            reuse_prefix=True)
    max_ctx = cfg.rollout.max_context_tokens or cfg.model.max_position_embeddings
    loop_cfg = AgentLoopConfig(max_turns=cfg.rollout.max_turns, max_context_tokens=max_ctx,
                               max_action_tokens=cfg.rollout.max_action_tokens,
                               temperature=temperature, top_p=cfg.rollout.top_p,
                               seed=sample_seed)
    # replicas never communicate while decoding (prompts="replica"): each runs its own loop
    try:
        episodes = run_episodes(engine, envs, [seeds[i] for i in block], tokenizer, loop_cfg,
                                should_stop=should_stop)
    finally:
        engine.close()
    return list(block), episodes


def _owner(mol: ModelOnLayout) -> bool:
    """One rank per rollout replica counts each of its samples (tp, pp, cp coordinate 0)."""
    return mol.coords.tp == 0 and mol.coords.pp == 0 and mol.coords.cp == 0


def compute_advantages(cfg: TrainConfig, mol: ModelOnLayout, ids: list[int], samples: dict,
                       num_episodes: int, kl: Optional[dict[int, torch.Tensor]] = None
                       ) -> dict[int, torch.Tensor]:
    """Per-sample advantages; normalisation statistics all-reduced over one owner per sample.

    ``kl`` (kl_mode=reward): per-token k1 on policy tokens, 0 elsewhere; ``kl_coef * kl`` comes
    off the rewards before the returns. REINFORCE++/PPO, gamma = 1: per-token returns, the reverse
    cumulative sum of (turn rewards - kl_coef * kl), so each token pays the KL of itself and
    every later token (REINFORCE++'s form). gamma < 1: credit is per turn (``turn_returns``), so
    each turn's summed KL joins that turn's reward. GRPO: the episode's summed KL comes off its
    reward before the group normalisation (a sequence-level KL penalty; GRPO usually takes the
    KL as a loss instead, kl_mode=loss).
    """
    from earl_megatron.runtime.dispatcher import group_mean_std, masked_mean_std

    owner = _owner(mol)
    masks = {s: samples[s].loss_mask for s in ids}
    coef = cfg.algorithm.kl_coef if kl is not None else 0.0
    if cfg.algorithm.name == "grpo":
        g = cfg.algorithm.group_size
        reward = {s: samples[s].reward - (coef * float(kl[s].sum()) if coef else 0.0)
                  for s in ids}
        owned = reward if owner else {}
        mean, std, _ = group_mean_std(owned, lambda s: s // g, num_episodes // g)
        out = {}
        for s in ids:
            a = (reward[s] - mean[s // g].item()) / (std[s // g].item() + 1e-6)
            out[s] = a * masks[s]
        return out
    gamma = cfg.algorithm.gamma
    returns = {s: returns_with_kl(samples[s].token_rewards, masks[s], gamma,
                                  kl[s] if coef else None, coef) for s in ids}
    vals = [returns[s] for s in ids] if owner else []
    msk = [masks[s] for s in ids] if owner else []
    mean, std, _ = masked_mean_std(vals, msk)
    return {s: (returns[s] - mean) / (std + 1e-6) * masks[s] for s in ids}


def returns_with_kl(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float,
                    kl: Optional[torch.Tensor] = None, kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token returns of one episode [T] with ``kl_coef * kl`` off the policy tokens' rewards.

    Without KL: ``turn_returns`` (per-turn credit, discount ``gamma`` per turn). With KL and
    gamma = 1: the per-token reverse cumulative sum (REINFORCE++: token t's return carries the
    KL of t and every later token; equal to ``turn_returns`` when kl = 0). With KL and gamma < 1:
    each turn's summed KL joins the turn's reward, then ``turn_returns``.
    """
    if kl is None or not kl_coef:
        return turn_returns(token_rewards[None], mask[None], gamma)[0]
    r = token_rewards - kl_coef * kl * mask
    if gamma == 1.0:
        return r.flip(0).cumsum(0).flip(0) * mask
    return turn_returns(r[None], mask[None], gamma)[0]


def kl_to_reference(cfg: TrainConfig, mol: ModelOnLayout, ids: list[int], samples: dict
                    ) -> tuple[dict[int, torch.Tensor], dict[str, float]]:
    """Per-token KL of the sampling policy to the reference (k1 for kl_mode=reward, k3 for loss)
    on policy tokens, and global metrics: ``kl`` (its mean per policy token) and
    ``ref_log_ratio_max`` (max |log pi_old - log pi_ref| over policy tokens)."""
    import torch.distributed as dist

    per, acc, top = {}, torch.zeros(2, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    for s in ids:
        t = samples[s]
        m = t.loss_mask
        k = (t.old_logprobs - t.ref_logprobs if cfg.algorithm.kl_mode == "reward"
             else k3_kl(t.old_logprobs, t.ref_logprobs)) * m
        per[s] = k
        if _owner(mol):
            acc += torch.stack([k.double().sum(), m.double().sum()])
            gap = ((t.old_logprobs - t.ref_logprobs).abs() * m).max() if m.any() else 0.0
            top = torch.maximum(top, torch.as_tensor(gap, dtype=torch.float64).reshape(1))
    dist.all_reduce(acc)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return per, {"kl": acc[0].item() / max(acc[1].item(), 1.0),
                 "ref_log_ratio_max": top.item()}


def reference_logprobs(ref: ModelOnLayout, cfg: TrainConfig, producer: ParallelLayout,
                       ids: list[int], token_ids: dict[int, list[int]], tokens: dict[int, int],
                       pad_id: int) -> tuple[dict[int, torch.Tensor], int]:
    """The LOGPROB stage: the reference model's logprob of every prediction of this replica's
    episodes, on every rank of the replica. Returns ({sample id: [tokens - 1]}, bytes received).

    ``producer`` is the rollout layout; every rank of replica d holds ``token_ids`` of its block
    ``split_evenly(len(tokens), dp)[d]`` (the ids ``play`` returned); ``tokens`` holds every
    episode's length (identical on all ranks). The episodes go to the
    reference model's layout in length-grouped micro-batches for its dp (``micro_batch_plan``),
    the forward runs there (``runtime.step.forward_logprobs``), and the logprobs, which exist on
    the last pp_stage only and cp-chunked, come back to every rank of their rollout replica:
    two point-to-point dispatches, nothing gathered on one rank.
    """
    from earl_megatron.runtime.dispatcher import SampleMeta, dispatch
    from earl_megatron.runtime.step import forward_logprobs

    if producer.cp != 1:
        raise ValueError(f"rollout layout {producer} has cp={producer.cp}; the engine decodes "
                         "with cp=1 and replicas hold whole episodes")
    lay, me = ref.layout, ref.coords
    plan = micro_batch_plan(cfg, lay, tokens)
    length_of = plan.length_of
    local: dict[str, dict] = {spec.name: {} for spec in LOGPROB_TENSORS}
    for s in ids:
        local["input_ids"][s], local["labels"][s] = shifted_ids(token_ids[s], length_of[s],
                                                                pad_id)
    result, _, _ = dispatch(producer, lay, [SampleMeta(s, length_of[s]) for s in ids], local,
                            LOGPROB_TENSORS,
                            producer_pp_stages={spec.name: "all" for spec in LOGPROB_TENSORS},
                            assignment=plan.assignment)
    groups_of_ids = [list(mb) for mb in plan.assignment[me.dp]]
    batches = microbatches(result.tensors, groups_of_ids,
                           seq_lens=plan.micro_batch_lengths(me.dp), cp=lay.cp, cp_rank=me.cp,
                           tensors=LOGPROB_TENSORS)
    ref.tcfg.variable_seq_lengths = lay.pp > 1
    out = forward_logprobs(ref, batches, seq_len=plan.longest, micro_batch_size=plan.max_rows)
    back = {REF_LOGPROBS.name: {s: lp[i] for mb, lp in zip(groups_of_ids, out)
                                for i, s in enumerate(mb)}}
    # the way back: producer = L's last pp_stage (cp chunks), consumer = every rank of replica d
    mine = [s for mb in groups_of_ids for s in mb]
    blocks = [[tuple(b)] for b in split_evenly(len(tokens), producer.dp)]
    returned, _, _ = dispatch(lay, producer, [SampleMeta(s, length_of[s]) for s in mine], back,
                              (REF_LOGPROBS,), producer_pp_stages={REF_LOGPROBS.name: "last"},
                              assignment=blocks)
    got = returned.tensors[REF_LOGPROBS.name]
    moved = int(result.stats.bytes_received + returned.stats.bytes_received)
    return {s: got[s][:len(token_ids[s]) - 1] for s in ids}, moved


def _policy_loss_config(cfg: TrainConfig) -> PolicyLossConfig:
    a = cfg.algorithm
    return PolicyLossConfig(clip_eps_low=a.clip_eps, clip_eps_high=a.clip_eps,
                            kl_coef=a.kl_coef if a.kl_mode == "loss" else 0.0,
                            entropy_coef=a.entropy_coef)


def _ref_logp(mb: dict, logp: torch.Tensor) -> Optional[torch.Tensor]:
    if "ref_logprobs" not in mb:
        return None
    # off the policy tokens (padding, filler rows) the reference is 0: use logp there, so k3 is 0
    # instead of exp(-logp), which could overflow to inf and make inf * 0 = nan in the masked sum
    return torch.where(mb["loss_mask"] > 0, mb["ref_logprobs"], logp.detach())


def _ratio_sums(logp: torch.Tensor, mb: dict, pcfg: PolicyLossConfig) -> torch.Tensor:
    """(sum of pi/pi_old, tokens outside the clip range, policy tokens) over policy tokens."""
    m = mb["loss_mask"].double()
    ratio = torch.exp(logp.detach().double() - mb["old_logprobs"].double())
    clipped = ((ratio < 1.0 - pcfg.clip_eps_low) | (ratio > 1.0 + pcfg.clip_eps_high)).double()
    return torch.stack([(ratio * m).sum(), (clipped * m).sum(), m.sum()])


def rl_loss_fn(cfg: TrainConfig, ratio_sums: list):
    """Per-token loss on Megatron's cross-entropy output (the labels path: no entropy).
    Appends each micro-batch's ``_ratio_sums`` to ``ratio_sums`` for the metrics."""
    pcfg = _policy_loss_config(cfg)

    def loss_fn(output: torch.Tensor, mb: dict) -> torch.Tensor:
        logp = -output.float()  # Megatron returns the vocab-parallel cross entropy per token
        ratio_sums.append(_ratio_sums(logp, mb, pcfg))
        return policy_loss(logp, mb["old_logprobs"], mb["advantages"], pcfg,
                           ref_logp=_ref_logp(mb, logp))

    return loss_fn


def rl_logprob_loss_fn(cfg: TrainConfig, entropy_sums: list, ratio_sums: list):
    """Per-token loss on the logits path (entropy_coef > 0): TokenLogprobs -> loss with the
    entropy bonus. Appends each micro-batch's (masked entropy sum, policy tokens) to
    ``entropy_sums`` and its ``_ratio_sums`` to ``ratio_sums`` for the metrics."""
    pcfg = _policy_loss_config(cfg)

    def loss_fn(tl, mb: dict) -> torch.Tensor:
        m = mb["loss_mask"].float()
        entropy_sums.append(torch.stack([(tl.entropy.detach().double() * m).sum(),
                                         m.double().sum()]))
        ratio_sums.append(_ratio_sums(tl.logp, mb, pcfg))
        return policy_loss(tl.logp, mb["old_logprobs"], mb["advantages"], pcfg,
                           ref_logp=_ref_logp(mb, tl.logp), entropy=tl.entropy)

    return loss_fn


def _global_sums(mol: ModelOnLayout, sums: list, width: int) -> torch.Tensor:
    """Per-micro-batch sums added over the world: the last pp_stage's tp rank 0 counts (tp
    ranks hold the same values), cp chunks and dp ranks add up. Collective."""
    import torch.distributed as dist

    acc = torch.zeros(width, dtype=torch.float64)
    if mol.post_process and mol.coords.tp == 0:
        acc += sum(sums, torch.zeros(width, dtype=torch.float64))
    dist.all_reduce(acc)
    return acc


def micro_batch_plan(cfg: TrainConfig, train_layout: ParallelLayout,
                     tokens: dict[int, int]) -> MicroBatchPlan:
    """Length-grouped micro-batches of the TRAIN stage for episodes of ``tokens`` tokens each."""
    return plan_micro_batches({s: n - 1 for s, n in tokens.items()}, train_layout.dp,
                              cfg.algorithm.micro_batch_size, CP_MULTIPLE,
                              cfg.algorithm.micro_batch_tokens)


def train_on(mol: ModelOnLayout, cfg: TrainConfig, producer: ParallelLayout, ids: list[int],
             samples: dict, advantages: dict, plan: MicroBatchPlan
             ) -> tuple[float, int, dict[str, float]]:
    """Dispatch this rank's samples to the train layout and run the optimizer step(s).

    ``plan`` (``micro_batch_plan``) fixes which samples train together and each micro-batch's
    padded length; ``samples`` were built with those lengths. Returns (loss, bytes received,
    stats): ``grad_norm`` (before clipping), ``ratio_mean`` (pi/pi_old over policy tokens) and
    ``clip_fraction`` (policy tokens whose ratio left [1 - clip_eps, 1 + clip_eps]), all of the
    last epoch's step, and ``entropy``, the mean entropy per policy token of the policy that
    sampled (entropy_coef > 0 only).
    The reference logprobs travel only when the loss reads them (kl_mode=loss): 4 bytes per
    token more; the entropy bonus takes the logits path (one V/tp-wide fp32 buffer more per
    micro-batch), so it is used only when entropy_coef > 0.
    """
    from earl_megatron.runtime.dispatcher import SampleMeta, dispatch
    from earl_megatron.runtime.step import train_step, train_step_logprobs

    a = cfg.algorithm
    lay = mol.layout
    length_of = plan.length_of
    tensors = train_tensors(with_ref=a.kl_mode == "loss")
    local = {spec.name: {} for spec in tensors}
    for s in ids:
        t = samples[s]
        local["input_ids"][s] = t.input_ids
        local["labels"][s] = t.labels
        local["loss_mask"][s] = t.loss_mask
        local["old_logprobs"][s] = t.old_logprobs
        local["advantages"][s] = advantages[s]
        if "ref_logprobs" in local:
            local["ref_logprobs"][s] = t.ref_logprobs
    meta = [SampleMeta(s, length_of[s]) for s in ids]
    result, _, _ = dispatch(producer, lay, meta, local, tensors,
                            producer_pp_stages={spec.name: "all" for spec in tensors},
                            assignment=plan.assignment)
    groups_of_ids = [list(mb) for mb in plan.assignment[mol.coords.dp]]
    # every dp rank runs the same number of micro-batches (one all-masked row of the shortest
    # length fills in; it adds nothing to the loss or the token count)
    count = max(len(mbs) for mbs in plan.assignment)
    seq_lens = plan.micro_batch_lengths(mol.coords.dp)
    batches = microbatches(result.tensors, groups_of_ids, seq_lens=seq_lens, cp=lay.cp,
                           cp_rank=mol.coords.cp, tensors=tensors)
    shortest = min(length_of.values())
    while len(batches) < count:
        batches += microbatches({}, [[]], seq_lens=[shortest], cp=lay.cp,
                                cp_rank=mol.coords.cp, rows=1, tensors=tensors)
    # micro-batches differ in length and rows: pipeline stages exchange each one's shape
    mol.tcfg.variable_seq_lengths = lay.pp > 1
    kwargs = dict(seq_len=plan.longest, micro_batch_size=plan.max_rows)
    loss, stats = math.nan, {}
    for epoch in range(a.epochs):
        ratios: list = []
        if a.entropy_coef:
            sums: list = []
            r = train_step_logprobs(mol, batches, loss_fn=rl_logprob_loss_fn(cfg, sums, ratios),
                                    **kwargs)
            if epoch == 0:
                # the sampling policy's entropy (before this batch's first update)
                acc = _global_sums(mol, sums, 2)
                stats["entropy"] = acc[0].item() / max(acc[1].item(), 1.0)
        else:
            r = train_step(mol, batches, loss_fn=rl_loss_fn(cfg, ratios), **kwargs)
        loss = r.loss
        acc = _global_sums(mol, ratios, 3)
        stats.update(grad_norm=r.grad_norm, ratio_mean=acc[0].item() / max(acc[2].item(), 1.0),
                     clip_fraction=acc[1].item() / max(acc[2].item(), 1.0))
    return loss, int(result.stats.bytes_received), stats
