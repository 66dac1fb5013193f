"""Supervised warm start: next-token loss on the agent's tokens of chat trajectories, through the
RL trainer's own path (dispatcher, length-grouped micro-batches, Megatron schedule and optimizer).

    traces: JSONL file | env.expert(seed)          rollout/trajectories.py
        -> (token ids, loss mask) per trace        mask 1 on the agent's tokens (as in RL)
    step s: batch = step_batch(n, batch_size, seed, s)
        producer DP(world): rank r builds the tensors of its block of the batch
        -> dispatcher -> train layout (dp block, cp chunks; micro_batch_plan's micro-batches)
        -> runtime.step.train_step: Megatron's per-token cross entropy under the loss mask

    loss = sum over agent tokens of -log p(token) / number of agent tokens in the batch

Invariants (tests/unit/test_trajectories.py, tests/distributed/test_sft.py):
- The batch of step ``s`` is a pure function of (number of traces, batch_size, seed, s): epochs
  are seeded permutations of all traces, each trace at most once per epoch, so a resumed warm
  start replays the same batches.
- The loss is normalised by the global count of agent tokens (runtime/step.py), so one step on
  the same weights gives the same loss, and the same update, on every layout.
- The learning rate is set on the optimizer's parameter groups before every step (a layout
  switch rebuilds the optimizer at its configured rate, algorithm.lr); ``set_lr`` puts RL's rate
  back afterwards.
"""

from __future__ import annotations

import random
from typing import Sequence

import torch
import torch.distributed as dist

from earl_megatron.config.sft import SFTConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.rollout.engine import split_evenly
from earl_megatron.rollout.trajectories import (Trajectory, expert_trajectories, read_jsonl,
                                                trajectory_tokens)
from earl_megatron.runtime.step_inputs import TRAIN_TENSORS, shifted_ids
from earl_megatron.seeds import expert_seeds
from earl_megatron.trainer.stages import BatchShape, dispatched_microbatches, micro_batch_plan

SFT_TENSORS = TRAIN_TENSORS[:3]
"""input_ids (first pp_stage), labels and loss_mask (last): all the cross entropy reads."""

Sample = tuple[list[int], list[int]]
"""(token ids, loss mask) of one trace."""


def load_traces(scfg: SFTConfig, env_name: str, env_kwargs: dict, run_seed: int
                ) -> list[Trajectory]:
    """The warm start's traces: ``scfg.data`` if set, else the environment's expert."""
    if scfg.data is not None:
        return read_jsonl(scfg.data)
    from earl_megatron.envs import make_env
    return expert_trajectories(lambda: make_env(env_name, **env_kwargs),
                               expert_seeds(run_seed, scfg.expert_episodes))


def tokenize_traces(traces: Sequence[Trajectory], tokenizer, max_tokens: int) -> list[Sample]:
    """Tokens and loss masks of every trace; a trace longer than ``max_tokens`` (the model's
    positions) or with no agent token is an error naming it."""
    out = []
    for i, t in enumerate(traces):
        ids, mask = trajectory_tokens(t, tokenizer)
        if len(ids) > max_tokens:
            raise ValueError(f"trace {i} has {len(ids)} tokens, more than the model's "
                             f"{max_tokens} positions; shorten it or raise "
                             "model.max_position_embeddings")
        if not any(mask[1:]):
            raise ValueError(f"trace {i} has no agent token to train on")
        out.append((ids, mask))
    return out


def step_batch(num_traces: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Trace indices of step ``step``: an epoch is ``num_traces // batch_size`` steps over one
    permutation (epoch e shuffled by Random("sft:seed:e")); the ``num_traces % batch_size``
    traces at its end wait for a later epoch's shuffle. No trace is twice in an epoch."""
    if not 1 <= batch_size <= num_traces:
        raise ValueError(f"batch_size={batch_size} must be in [1, {num_traces}] (the number of "
                         "traces); lower sft.batch_size or give more traces")
    epoch, k = divmod(step, num_traces // batch_size)
    perm = list(range(num_traces))
    random.Random(f"sft:{seed}:{epoch}").shuffle(perm)
    return perm[k * batch_size:(k + 1) * batch_size]


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def sample_tensors(ids: Sequence[int], mask: Sequence[int], length: int, pad_id: int) -> dict:
    """input_ids, labels and label-aligned loss_mask of ``length`` predictions."""
    input_ids, labels = shifted_ids(ids, length, pad_id)
    m = torch.zeros(length + 1)
    m[:len(mask)] = torch.tensor(mask, dtype=torch.float32)
    return {"input_ids": input_ids, "labels": labels, "loss_mask": m[1:].clone()}


def sft_step(on_layout, samples: Sequence[Sample], batch: Sequence[int], *, lr: float, pad_id: int,
             shape: BatchShape):
    """One optimizer step on the traces ``batch`` (indices into ``samples``), in ``on_layout``'s
    layout.

    Sample ids are positions in ``batch``; rank r of the producer layout DP(world) builds the
    tensors of its block ``split_evenly(len(batch), world)[r]`` and the dispatcher moves them to
    the train layout, in RL's length-grouped micro-batches (trainer/stages.micro_batch_plan:
    ``shape``, padding to a multiple of 2 * cp). Returns (TrainStepResult, bytes received here).
    """
    from earl_megatron.runtime.step import train_step

    world, rank = dist.get_world_size(), dist.get_rank()
    lay = on_layout.layout
    plan = micro_batch_plan(lay, {s: len(samples[i][0]) for s, i in enumerate(batch)}, shape,
                            on_layout.cfg)
    length_of = plan.length_of
    producer = ParallelLayout(dp=world)
    mine = split_evenly(len(batch), world)[rank]
    local: dict = {spec.name: {} for spec in SFT_TENSORS}
    for s in mine:
        ids, mask = samples[batch[s]]
        for name, t in sample_tensors(ids, mask, length_of[s], pad_id).items():
            local[name][s] = t
    batches, _, received = dispatched_microbatches(on_layout, producer, mine, local, plan,
                                                   SFT_TENSORS)
    set_lr(on_layout.optimizer, lr)
    res = train_step(on_layout, batches, seq_len=plan.longest, micro_batch_size=plan.max_rows)
    return res, received
