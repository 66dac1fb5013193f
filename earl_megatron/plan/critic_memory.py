"""What a model's training state keeps resident beside another model's stage, and where PPO's
critic is placed (issue #45). Pure functions over the memory model and the selector.

The trainer (trainer/planner.py: ``train_bytes``, ``critic_choice``, and under auto the TRAIN
plan that counts the critic ``beside_critic``, since the critic moves with each batch's
TRAIN layout) and the dry-run planner (tools/plan_layouts.py ``--critic``) both call these, so
``earl plan`` counts the critic exactly as a run does. Invariants:

- ``weight_bytes``: the weights of the most loaded pp_stage in ``layout``, in the trainer's
  parameter dtype (``TrainOptions.param_bytes``).
- ``train_bytes``: those weights plus the grads and optimizer state (``train_state_bytes``),
  the whole training state one model keeps beside another's stage; with LoRA the grads and
  optimizer state only (the adapters'), since the stage beside it (the reference's LOGPROB)
  runs on the same weights and counts them.
- ``held_bytes``: the same with the weights always counted: a model beside a stage of ANOTHER
  model (the critic beside the policy's stages, the policy beside the critic's TRAIN), which
  shares none of its weights. The critic is counted as ``critic_model``: the policy's config
  (its value head counted as the output layer: an overestimate), a LoRA policy's base (its
  critic trains every parameter: trainer/critic.py).
- ``critic_plan``: the selector's plan for ``workload`` (a TRAIN stage) with the policy's
  training state counted resident in each candidate's own layout (the policy is laid out like
  the candidate): every valid TRAIN layout L and every recompute mode the selector weighs
  there is kept when the critic's TRAIN in L beside ``train_bytes(model, L)`` fits, and the
  candidates are ranked as ``Selector.plan`` ranks them (cost, recompute order, memory,
  layout). It is ``Selector.plan`` itself run on a selector whose memory estimate adds that
  layout's policy state (``_Beside``), so the loop, the ranking, the reason and
  ``NoLayoutFitsError``'s suggestions (each re-checked under the same rule) are the
  selector's. The selector's state (its hysteresis) is not read or changed. The trainer
  builds the critic where it places it (``critic_choice``, the first batch); each batch's
  TRAIN plan (the mirror rule: the critic's state in each candidate's layout) then moves it.

  It replaced a first choice alone whose policy state was then counted in every candidate
  (one resident value for all): from that first choice's layout, which spreads the state less
  than the layouts that fit both, it planned OOM where another layout held policy and critic.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Optional

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.memory_model import (MemoryEstimate, param_count_per_rank,
                                             train_state_bytes)
from earl_megatron.plan.selector import LayoutPlan, Selector
from earl_megatron.plan.specs import Recompute, Stage, StageWorkload, TrainOptions, human_bytes

FIRST_ROLLOUT_TOKENS = 128
"""Episode length the first rollout is planned for, before any episode was played, and so the
length the critic's layout is chosen for (trainer/planner.py)."""


def weight_bytes(model: ModelConfig, layout: ParallelLayout, opts: TrainOptions) -> int:
    """Bytes of ``model``'s weights per rank of its most loaded pp_stage in ``layout``."""
    return max(param_count_per_rank(model, layout, r) for r in range(layout.pp)) \
        * opts.param_bytes(model)


def train_bytes(model: ModelConfig, layout: ParallelLayout, opts: TrainOptions) -> int:
    """Weights, grads and optimizer state per rank in ``layout`` (module docstring; with LoRA
    the grads and optimizer state only)."""
    weights = 0 if model.lora.enabled else weight_bytes(model, layout, opts)
    return weights + train_state_bytes(model, layout, opts)


def held_bytes(model: ModelConfig, layout: ParallelLayout, opts: TrainOptions) -> int:
    """Weights, grads and optimizer state per rank in ``layout``, the weights counted with LoRA
    too: a model held beside another model's stage (module docstring)."""
    return weight_bytes(model, layout, opts) + train_state_bytes(model, layout, opts)


def critic_model(model: ModelConfig) -> ModelConfig:
    """The config the critic of policy ``model`` is counted as (module docstring)."""
    return model.base


@dataclass(frozen=True)
class _Beside(Selector):
    """A selector whose every estimate counts, besides ``resident_bytes``, the training state
    of ``beside`` (``held_bytes``) in the estimated layout itself."""

    beside: ModelConfig = field(kw_only=True)   # required: Selector's fields have defaults

    def memory(self, layout: ParallelLayout, workload: StageWorkload,
               resident_bytes: int = 0, recompute: Optional[Recompute] = None) -> MemoryEstimate:
        other = held_bytes(self.beside, layout, self.train_opts)
        return super().memory(layout, workload, resident_bytes + other, recompute)


def beside_train_state(selector: Selector, beside: ModelConfig) -> Selector:
    """``selector`` with every estimate counting ``beside`` in training (weights, grads, Adam
    state) in the estimated layout itself: the critic's TRAIN beside a policy laid out like it
    (``critic_plan``), or the policy's beside its critic (``beside_critic``)."""
    return _Beside(**{f.name: getattr(selector, f.name) for f in fields(selector)},
                   beside=beside)


def beside_critic(selector: Selector) -> Selector:
    """``selector`` (the policy's) with the critic's training state counted in each estimated
    layout itself: a TRAIN the critic trains beside and follows (trainer/planner.py under auto),
    or a split's train pool, where the critic lives in the pool's TRAIN layout (plan/split.py;
    for the pool's LOGPROB candidates an estimate of the same bytes)."""
    return beside_train_state(selector, critic_model(selector.model))


def critic_selector(selector: Selector) -> Selector:
    """``selector`` estimating the critic of its (policy) model: ``critic_model``'s memory."""
    return replace(selector, model=critic_model(selector.model))


def critic_plan(selector: Selector, workload: StageWorkload) -> LayoutPlan:
    """The critic's plan under auto: ``selector``'s plan for ``workload`` (TRAIN) with the
    policy's training state counted resident in each candidate's own layout (module
    docstring; NoLayoutFitsError, with suggestions checked under that rule, when none fits).
    Its layout is the critic's, its memory the critic's TRAIN there beside the policy's state
    in the same layout; ``selector`` and its state are left as they were."""
    if workload.stage is not Stage.TRAIN:
        raise ValueError(f"the critic is placed for TRAIN, not {workload.stage.value}")
    plan = beside_train_state(critic_selector(selector), selector.model).plan(workload)[0]
    return replace(plan, reason=(
        f"{plan.reason}; the policy's train state counted resident in each candidate's own "
        f"layout ({human_bytes(plan.chosen.memory.resident)} in {plan.layout})"))
