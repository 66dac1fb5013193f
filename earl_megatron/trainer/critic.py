"""PPO's critic in the colocated loop (``algorithm.name=ppo``, issue #45): its build, the VALUES
stage, GAE advantages, the CRITIC TRAIN stage and its checkpoint.

    build       the value model (models/value_model.py) in its layout, its trunk the policy's
                initial weights (or algorithm.critic.init's), its own Megatron optimizer
                (algorithm.critic.lr) and DDP
    VALUES      the critic's value of every prediction of the batch, on its layout's
                micro-batches, dispatched there and back like the reference's logprobs
                (trainer/stages.scored_on)
    advantages  GAE over each episode's policy tokens (rl/value.py; KL in the reward comes off
                the token rewards first), normalised over the batch's policy tokens like
                REINFORCE++'s; the returns are the critic's targets
    TRAIN       the policy's PPO-clip step as for every estimator (skipped during
                algorithm.critic.warmup)
    CRITIC      ``epochs`` optimizer steps of the clipped value loss (rl/value.value_loss,
    TRAIN       token-mean over the global batch) on the critic layout's micro-batches

Placement: the critic trains where the policy trains. Each batch's critic stages run in its
TRAIN layout: before VALUES the critic moves there (``ModelPair.critic_in``: the switcher moves
its weights, value head included, and its Adam state in memory, as the policy's; a no-op when
it is there with its groups live), so under layout.mode=auto it follows the context as the
policy does. The planner counts it so (trainer/planner.py: the TRAIN plan with the critic's
state in each candidate's own layout, every other stage with it where it is). One move per
batch: VALUES runs in the TRAIN layout too, not in LOGPROB's (its forward needs less than
CRITIC TRAIN). It is built in ``critic_choice``'s layout (layout.train; under auto the first
batch's plan, or a checkpoint's last TRAIN layout); split placement: the train pool's TRAIN
layout (trainer/split_sides.py), where it stays. Both critic stages dispatch from the batch's
rollout layout to the critic's and (VALUES) back; CRITIC TRAIN plans its own micro-batches in
the critic's layout (its sample tensors, padded for TRAIN's plan, are cut or padded to them:
every prediction is inside both) and runs the recompute mode the planner gives it for the batch
(``StagePlanner.critic_train``, planned with VALUES, before the policy's TRAIN step; recorded
as ``critic_recompute``).

Checkpoint: the critic's weights and Adam state are saved in the policy's checkpoint directory,
under ``critic/`` (Megatron dist_checkpointing, the value head under ``value_head.*``), before
the directory is published, and loaded from there on resume.

Metrics (global): ``value_loss`` (the last epoch's loss before its step), ``value_grad_norm``,
``value_clip_frac`` (tokens whose clipped term decided the loss), ``explained_variance``,
``value_mean`` and ``return_mean`` (of the values the batch was scored with and of the GAE
returns, per policy token).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from earl_megatron.plan.batching import MicroBatchPlan
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.placement import TensorSpec
from earl_megatron.rl.value import (explained_variance, explained_variance_inputs, gae,
                                    value_clip_sums, value_loss)
from earl_megatron.runtime.build import ModelOnLayout, OptimizerSpec, build_on_layout
from earl_megatron.runtime.checkpoint import CRITIC_DIR, load_model_state, save_model_state
from earl_megatron.runtime.io_errors import CheckpointError
from earl_megatron.runtime.recompute import set_recompute
from earl_megatron.runtime.reduce import global_moments, global_sum
from earl_megatron.trainer.scoring import normalized, owns_samples
from earl_megatron.trainer.stages import (dispatched_microbatches, micro_batch_plan,
                                          over_world, scored_on)

CRITIC_TENSORS = (
    TensorSpec("input_ids", "int64", per_token=True, pp_stages="first"),
    TensorSpec("loss_mask", "float32", per_token=True, pp_stages="last"),
    TensorSpec("old_values", "float32", per_token=True, pp_stages="last"),
    TensorSpec("returns", "float32", per_token=True, pp_stages="last"),
)
"""What the CRITIC TRAIN stage reads: its input (first pp_stage) and the loss's terms (last)."""


def build_critic(cfg, policy: Optional[ModelOnLayout], layout: ParallelLayout, *,
                 pools: Optional[tuple] = None, resuming: bool = False
                 ) -> Optional[ModelOnLayout]:
    """The critic in ``layout`` with its optimizer. Collective over the world. No rank reads
    more than its shard: the trunk is the policy's weights, which must be in ``layout``
    (``copied_from``; a LoRA policy's adapters merged on the shard, so the trunk computes what
    the policy does), the head new from run.seed. An ``algorithm.critic.init`` is read in
    ``layout`` itself: a model's trunk, and a value model's or a PPO run's critic's head too
    (weights/critic_import.py); a PEFT adapter is loaded as a policy there, base and adapter,
    and copied merged. ``resuming`` (every rank alike): a checkpoint's critic/ is loaded over
    it next (``load_critic``), so nothing is read: the trunk keeps Megatron's init.

    Split placement (``pools``, the train pool first): the train pool's ranks build it in
    their pool's ``layout``, its groups made by them alone; a rollout rank passes ``policy``
    None, joins a ``critic.init``'s collective read (a converted or trained one) and gets
    None."""
    from earl_megatron.models.value_model import critic_config, critic_loader
    from earl_megatron.weights.critic_import import critic_init, join_critic_init

    a, seed = cfg.algorithm, cfg.run.seed
    if policy is None:
        if a.critic.init and not resuming and not join_critic_init(a.critic.init):
            from earl_megatron.weights.convert import join_policy_load
            join_policy_load(a.critic.init)
        return None
    ccfg = critic_config(cfg.model)
    spec = OptimizerSpec(lr=a.critic.lr, weight_decay=a.weight_decay, clip_grad=a.clip_grad,
                         use_distributed_optimizer=a.use_distributed_optimizer)
    if resuming:
        fill = lambda gpt, coords: None   # noqa: E731 - load_critic's, next
    elif a.critic.init:
        read = critic_init(a.critic.init, cfg.model, layout)
        fill = read[1] if read is not None else copied_from(_as_policy(cfg, layout, pools))
    else:
        if policy.layout != layout:
            raise ValueError(f"the critic copies the policy's shards: pass the policy in the "
                             f"critic's layout {layout}, not {policy.layout} "
                             "(models.policy_in(layout))")
        fill = copied_from(policy)
    return build_on_layout(ccfg, layout, load=critic_loader(None, ccfg, layout, fill=fill),
                           optimizer=spec, seed=seed, pools=pools, local=pools is not None)


def _as_policy(cfg, layout: ParallelLayout, pools: Optional[tuple]) -> ModelOnLayout:
    """``algorithm.critic.init`` that critic_import leaves to the policy's loader (a PEFT
    adapter: its base with the adapter), loaded in the critic's ``layout``."""
    from earl_megatron.models.value_model import critic_config
    from earl_megatron.weights.convert import load_policy
    from earl_megatron.weights.critic_import import same_shape

    init = cfg.algorithm.critic.init
    source = load_policy(init, layout, ddp=False, seed=cfg.run.seed,
                         pools=None if pools is None else (layout,) + pools[1:])
    same_shape(critic_config(source.cfg), critic_config(cfg.model), init)
    return source


def copied_from(policy: ModelOnLayout):
    """``critic_loader``'s fill from the policy in the critic's own layout: each trunk tensor
    is this rank's shard of the policy's same tensor, copied; an adapted linear's
    (``<linear>.base.weight`` beside ``lora_a`` / ``lora_b``) is merged on the shard,
    ``W + scaling B A`` with this rank's A and B, which are the rows or columns of the whole
    product that the shard of W holds (models/lora.py's split: column-parallel B by rows,
    row-parallel A by columns). No rank gathers the model."""
    from earl_megatron.models.value_model import CriticTrunk
    from earl_megatron.weights.peft_export import merged

    mine = dict(policy.module().named_parameters())
    scaling = policy.cfg.lora.scaling if policy.cfg.lora.enabled else 0.0

    def shard(name: str) -> torch.Tensor:
        if name in mine:
            return mine[name]
        linear, kind = name.rsplit(".", 1)   # an adapted linear's base
        base = mine[f"{linear}.base.{kind}"]
        if kind != "weight":
            return base
        return merged(base, mine[f"{linear}.lora_a"], mine[f"{linear}.lora_b"], scaling)

    def fill(gpt, coords) -> None:
        with torch.no_grad():
            for name, p in CriticTrunk(gpt).named_parameters():
                p.copy_(shard(name))

    return fill


def values_of(critic: ModelOnLayout, producer: ParallelLayout, ids: list[int], episodes: list,
              tokens: dict[int, int], pad_id: int, shape) -> tuple[dict, int]:
    """The VALUES stage: {sample id: the critic's values [tokens - 1], label-aligned} of this
    replica's episodes on every rank of the replica, and the bytes received."""
    from earl_megatron.runtime.step import forward_values

    return scored_on(critic, producer, ids, {s: e.token_ids for s, e in zip(ids, episodes)},
                     tokens, pad_id, shape, forward=forward_values)


def _padded(row: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like, dtype=torch.float32)
    out[:row.numel()] = row.float()
    return out


def gae_advantages(policy: ModelOnLayout, ids: list[int], samples: dict, values: dict,
                   gamma: float, lam: float, kl: Optional[dict] = None, kl_coef: float = 0.0
                   ) -> tuple[dict, dict, dict, dict[str, float]]:
    """(advantages normalised over the batch's policy tokens, returns, old values, metrics) of
    this rank's samples, each [length] of its TRAIN sample; ``kl`` (k1 per token) with
    ``kl_coef``: KL in the reward, off each policy token's reward before GAE."""
    raw, returns, old = {}, {}, {}
    for s in ids:
        t = samples[s]
        old[s] = _padded(values[s], t.loss_mask) * t.loss_mask
        rewards = t.token_rewards - kl_coef * kl[s] * t.loss_mask if kl_coef else \
            t.token_rewards
        raw[s], returns[s] = gae(rewards, old[s], t.loss_mask, gamma, lam)
    adv = normalized(policy, ids, samples, raw)
    # each owned sample's returns (group 0) and residuals R - V (group 1), counted once
    mine = [explained_variance_inputs(old[s], returns[s], samples[s].loss_mask) for s in ids] \
        if owns_samples(policy) else []
    x = torch.cat([m[0] for m in mine]) if mine else torch.zeros(0, dtype=torch.float64)
    group = torch.cat([m[1] for m in mine]) if mine else torch.zeros(0, dtype=torch.long)
    moments = global_moments(x, group, 2, unbiased=False)
    mean_r, mean_res = float(moments.mean[0]), float(moments.mean[1])
    return adv, returns, old, {"explained_variance": explained_variance(moments),
                               "return_mean": mean_r, "value_mean": mean_r - mean_res}


def _fitted(row: torch.Tensor, length: int, fill) -> torch.Tensor:
    """``row`` cut or padded with ``fill`` to ``length`` (both plans hold every prediction)."""
    if row.numel() >= length:
        return row[:length]
    return torch.cat([row, row.new_full((length - row.numel(),), fill)])


def train_critic(critic: ModelOnLayout, producer: ParallelLayout, ids: list[int], samples: dict,
                 old_values: dict, returns: dict, plan: MicroBatchPlan, clip: Optional[float],
                 epochs: int, pad_id: int = 0) -> dict[str, float]:
    """The CRITIC TRAIN stage: dispatch this rank's samples to the critic's layout in ``plan``'s
    micro-batches (the critic layout's plan; each sample's tensors fitted to its length there,
    input padded with ``pad_id``) and run ``epochs`` optimizer steps of the clipped value loss;
    the global metrics (module docstring) and ``value_bytes``."""
    from earl_megatron.runtime.step import train_step_values

    local = {spec.name: {} for spec in CRITIC_TENSORS}
    for s in ids:
        n = plan.length_of[s]
        local["input_ids"][s] = _fitted(samples[s].input_ids, n, pad_id)
        local["loss_mask"][s] = _fitted(samples[s].loss_mask, n, 0)
        local["old_values"][s] = _fitted(old_values[s], n, 0)
        local["returns"][s] = _fitted(returns[s], n, 0)
    batches, _, received = dispatched_microbatches(critic, producer, ids, local, plan,
                                                   CRITIC_TENSORS)
    r, sums = None, torch.zeros(2, dtype=torch.float64)
    for _ in range(epochs):
        clips: list = []

        def loss_fn(v: torch.Tensor, mb: dict) -> torch.Tensor:
            args = (v, mb["old_values"], mb["returns"], mb["loss_mask"], clip)
            clips.append(value_clip_sums(*args))
            return value_loss(*args)

        r = train_step_values(critic, batches, seq_len=plan.longest,
                              micro_batch_size=plan.max_rows, loss_fn=loss_fn)
        sums = over_world(critic, clips, 2)
    return {"value_loss": r.loss, "value_grad_norm": r.grad_norm,
            "value_clip_frac": sums[0].item() / max(sums[1].item(), 1.0),
            "value_bytes": received}


@dataclass(frozen=True)
class Targets:
    """What the CRITIC TRAIN stage trains toward, per sample of this rank: the GAE returns and
    the values the batch was scored with (the clip's centre), and the VALUES stage's bytes."""

    returns: dict
    old_values: dict
    moved: int
    recompute: str
    """CRITIC TRAIN's recompute mode (trainer/planner.py ``critic_train``)."""


def critic_scores(tr, models, policy: ModelOnLayout, layouts: dict, ids: list[int],
                  episodes: list, tokens: dict, samples: dict, kl: Optional[dict], t,
                  metrics: dict) -> tuple[dict, Targets]:
    """The trainer's VALUES stage (timed as "values") and GAE: (advantages, targets); the
    value metrics join ``metrics``."""
    a = tr.cfg.algorithm
    with t("critic_switch"):   # to the batch's TRAIN layout, counted there by every plan next
        critic = models.critic_in(layouts["train"])
    tr.planner.critic_layout = critic.layout
    with t("values"):
        values, moved = values_of(critic, policy.layout, ids, episodes, tokens,
                                  tr.tok.pad_token_id, tr.batch)
    adv, returns, old, found = gae_advantages(policy, ids, samples, values, a.gamma, a.lam, kl,
                                              tr.adv.kl_coef)
    metrics.update(found)
    # CRITIC TRAIN's plan, before anything trains: the policy's train state in its TRAIN layout
    mode = tr.planner.critic_train([tokens[s] for s in sorted(tokens)], layouts["train"])
    return adv, Targets(returns, old, moved, mode)


def critic_step(tr, models, policy: ModelOnLayout, ids: list[int], samples: dict,
                targets: Targets, tokens: dict, t) -> dict[str, float]:
    """The trainer's CRITIC TRAIN stage (timed as "critic_train") in the critic's layout, on
    its micro-batch plan of the batch (``tokens`` per sample); its metrics, ``value_bytes`` the
    bytes both critic stages' dispatches received over the world."""
    a, critic = tr.cfg.algorithm, models.critic_in(models.critic.layout)
    set_recompute(critic, targets.recompute)
    plan = micro_batch_plan(critic.layout, tokens, tr.batch, tr.cfg.model)
    with t("critic_train"):
        found = train_critic(critic, policy.layout, ids, samples, targets.old_values,
                             targets.returns, plan, a.critic.clip, a.epochs,
                             pad_id=tr.tok.pad_token_id)
    found["critic_layout"] = str(critic.layout)
    found["critic_recompute"] = targets.recompute
    # bytes the critic's two dispatches received, summed over the world (the same on every rank)
    found["value_bytes"] = int(global_sum(torch.tensor(
        [found["value_bytes"] + targets.moved], dtype=torch.float64)).item())
    return found


def critic_saver(models, *, joins: bool = False):
    """``save_checkpoint``'s ``also`` for ``models``' critic (its groups made current first);
    None without a critic. ``joins``: a rank without the critic (``models`` None: split
    placement's rollout pool under ppo) joins the collective save with nothing."""
    if models is not None and models.critic is not None:
        return lambda directory: save_critic(models.critic_in(models.critic.layout), directory)
    return (lambda directory: save_critic(None, directory)) if joins else None


def save_critic(critic: Optional[ModelOnLayout], directory: Path) -> None:
    """Collective: the critic's weights and Adam state into ``directory/critic`` (a checkpoint
    directory before it is published), its groups current; None: this rank joins."""
    save_model_state(critic, directory / CRITIC_DIR)


def load_critic(critic: Optional[ModelOnLayout], checkpoint: Path) -> None:
    """Collective: the critic's weights and Adam state from a checkpoint directory's
    ``critic/`` (None: this rank joins); a checkpoint without one (written by another
    estimator) is refused on every rank."""
    if not (Path(checkpoint) / CRITIC_DIR).is_dir():
        raise CheckpointError(f"{checkpoint} holds no critic ({CRITIC_DIR}/): it was written by "
                              "a run without algorithm.name=ppo; start a new run.output_dir "
                              "with run.init pointing at it")
    load_model_state(critic, Path(checkpoint) / CRITIC_DIR)
