"""What a model's training state keeps resident beside another model's stage, and where PPO's
critic is placed (issue #45). Pure functions over the memory model and the selector.

The trainer (trainer/planner.py ``train_bytes``, ``critic_choice``) and the dry-run planner
(tools/plan_layouts.py ``--critic``) both call these, so ``earl plan`` counts the critic exactly
as a run does. Invariants:

- ``weight_bytes``: the weights of the most loaded pp_stage in ``layout``, in the trainer's
  parameter dtype (``TrainOptions.param_bytes``).
- ``train_bytes``: those weights plus the grads and optimizer state (``train_state_bytes``),
  the whole training state one model keeps beside another's stage; with LoRA the grads and
  optimizer state only (the adapters'), since the stage beside it runs on the same weights and
  counts them. The critic (the policy's shape, its value head counted as the output layer: an
  overestimate) is counted with this function on the policy's config.
- ``critic_plan``: the selector's plan for ``workload`` (a TRAIN stage) with the policy's
  training state in that same layout counted resident: a first choice alone, then again with
  that counted. The selector's state (its hysteresis) is not read or changed.
"""

from __future__ import annotations

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.memory_model import param_count_per_rank, train_state_bytes
from earl_megatron.plan.selector import LayoutPlan, Selector
from earl_megatron.plan.specs import StageWorkload, TrainOptions

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


def critic_plan(selector: Selector, workload: StageWorkload) -> LayoutPlan:
    """The critic's plan under auto: the selector's for ``workload`` (TRAIN) with the policy's
    training state in the first choice's layout resident (NoLayoutFitsError when nothing
    fits); its layout is the critic's, its memory the critic's TRAIN beside that state."""
    alone = selector.plan(workload)[0].layout
    resident = train_bytes(selector.model, alone, selector.train_opts)
    return selector.plan(workload, resident_bytes=resident)[0]
