"""The agentic RL loop, SPMD: every rank runs the same iteration, no driver process.

    plan layouts ─► ROLLOUT (switch, embedded engine, multi-turn episodes per dp replica)
                 ─► advantages (global stats by all-reduce over owners, never gathered)
                 ─► TRAIN (switch weights + optimizer state, dispatch samples point to point,
                          Megatron schedule with the policy loss) ─► metrics, checkpoint

The selector (or the static layouts of the config) gives each stage its layout; the switcher moves
the live model and optimizer between them in memory; the dispatcher moves per-sample tensors from
the rollout layout's replicas to the train layout's dp ranks and cp chunks.

On-policy (``algorithm.epochs == 1``) the engine's rollout logprobs serve as the old logprobs:
they equal the trainer's recomputed ones within 1e-4 in fp32 (tested in the engine's tests), so
the separate LOGPROB forward pass is skipped; PPO epochs > 1 reuse the same old logprobs.

Invariants: iteration ``i`` draws environment seeds and sampling seeds from (run.seed, i) only, so
a run resumed from a checkpoint replays the same iterations as one that never stopped.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from earl_megatron.config.train import TrainConfig
from earl_megatron.envs import make_env
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.rl.advantages import reinforce_pp_returns
from earl_megatron.rl.losses import PolicyLossConfig, policy_loss
from earl_megatron.rollout.agent_loop import AgentLoopConfig, run_episodes
from earl_megatron.rollout.engine import split_evenly
from earl_megatron.runtime.build import ModelOnLayout, OptimizerSpec
from earl_megatron.trainer.data import TRAIN_TENSORS, microbatches

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
         sample_seed: int, opponent: Optional[str] = None):
    """This replica's block of episodes (all ranks of a replica return the same episodes)."""
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
    episodes = run_episodes(engine, envs, [seeds[i] for i in block], tokenizer, loop_cfg)
    engine.close()
    return list(block), episodes


def compute_advantages(cfg: TrainConfig, mol: ModelOnLayout, ids: list[int], samples: dict,
                       num_episodes: int) -> dict[int, torch.Tensor]:
    """Per-sample advantages; normalisation statistics all-reduced over one owner per sample."""
    from earl_megatron.runtime.dispatcher import group_mean_std, masked_mean_std

    owner = mol.coords.tp == 0 and mol.coords.pp == 0 and mol.coords.cp == 0
    masks = {s: samples[s].loss_mask for s in ids}
    rewards = torch.tensor([samples[s].reward for s in ids])
    if cfg.algorithm.name == "grpo":
        g = cfg.algorithm.group_size
        owned = {s: samples[s].reward for s in ids} if owner else {}
        mean, std, _ = group_mean_std(owned, lambda s: s // g, num_episodes // g)
        out = {}
        for s in ids:
            a = (samples[s].reward - mean[s // g].item()) / (std[s // g].item() + 1e-6)
            out[s] = a * masks[s]
        return out
    returns = {s: reinforce_pp_returns(rewards[i:i + 1], masks[s][None])[0]
               for i, s in enumerate(ids)}
    vals = [returns[s] for s in ids] if owner else []
    msk = [masks[s] for s in ids] if owner else []
    mean, std, _ = masked_mean_std(vals, msk)
    return {s: (returns[s] - mean) / (std + 1e-6) * masks[s] for s in ids}


def rl_loss_fn(cfg: TrainConfig):
    pcfg = PolicyLossConfig(clip_eps_low=cfg.algorithm.clip_eps,
                            clip_eps_high=cfg.algorithm.clip_eps)

    def loss_fn(output: torch.Tensor, mb: dict) -> torch.Tensor:
        logp = -output.float()  # Megatron returns the vocab-parallel cross entropy per token
        return policy_loss(logp, mb["old_logprobs"], mb["advantages"], pcfg)

    return loss_fn


def train_on(mol: ModelOnLayout, cfg: TrainConfig, producer: ParallelLayout, ids: list[int],
             samples: dict, advantages: dict, length: int) -> tuple[float, int]:
    """Dispatch this rank's samples to the train layout and run the optimizer step(s)."""
    from earl_megatron.runtime.dispatcher import SampleMeta, dispatch
    from earl_megatron.runtime.step import train_step

    lay = mol.layout
    mbs = cfg.algorithm.micro_batch_size
    n_total = cfg.rollout.episodes_per_iteration
    per_dp = -(-n_total // lay.dp)
    num_mb = max(1, -(-per_dp // mbs))
    local = {spec.name: {} for spec in TRAIN_TENSORS}
    for s in ids:
        t = samples[s]
        local["input_ids"][s] = t.input_ids
        local["labels"][s] = t.labels
        local["loss_mask"][s] = t.loss_mask
        local["old_logprobs"][s] = t.old_logprobs
        local["advantages"][s] = advantages[s]
    meta = [SampleMeta(s, length) for s in ids]
    result, consumer, _ = dispatch(producer, lay, meta, local, TRAIN_TENSORS,
                                   num_micro_batches=num_mb,
                                   producer_pp_stages={spec.name: "all" for spec in TRAIN_TENSORS})
    groups_of_ids = [list(mb) for mb in consumer.micro_batches[mol.coords.dp] if len(mb)]
    if not groups_of_ids:
        raise RuntimeError(f"dp rank {mol.coords.dp} of {lay} received no samples: "
                           f"{n_total} episodes cannot feed dp={lay.dp}; raise "
                           "rollout.episodes_per_iteration")
    # Megatron's schedule needs one micro-batch size on every rank: pad short ones with
    # all-masked rows (they add nothing to the loss or the token count)
    size_t = torch.tensor([max([len(g) for g in groups_of_ids] or [1])])
    dist.all_reduce(size_t, op=dist.ReduceOp.MAX)
    size = int(size_t)
    batches = microbatches(result.tensors, groups_of_ids, seq_len=length, cp=lay.cp,
                           cp_rank=mol.coords.cp)
    for b in batches:
        short = size - b["input_ids"].shape[0]
        if short:
            for k, v in b.items():
                b[k] = torch.cat([v, torch.zeros((short,) + tuple(v.shape[1:]), dtype=v.dtype)])
    _equalize_microbatch_count(batches, size, length, lay, mol)
    loss = math.nan
    for _ in range(cfg.algorithm.epochs):
        r = train_step(mol, batches, seq_len=length, micro_batch_size=size,
                       loss_fn=rl_loss_fn(cfg))
        loss = r.loss
    return loss, int(result.stats.bytes_received)


def _equalize_microbatch_count(batches: list, size: int, length: int, lay, mol) -> None:
    """Every dp rank must run the same number of micro-batches (pipeline and DDP collectives)."""
    n = torch.tensor([len(batches)])
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    template = batches[0]
    while len(batches) < int(n):
        batches.append({k: torch.zeros_like(v) if k != "position_ids" else v
                        for k, v in template.items()})
