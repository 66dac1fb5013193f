"""The trainer's models: the policy and, with KL on, the frozen reference, and whose process
groups are live.

A Megatron model keeps the groups it was built under and reads parallel_state's globals while
it runs, so only one model's layout can be current at a time. ``policy_in(layout)`` and
``reference_in(layout)`` return the model in ``layout`` with its groups current:

- same layout, its groups already live: nothing to do;
- same layout, the other model's groups live: re-activated in place when runtime/groups still
  caches the layout (``groups.activate``), else switched to the same layout (a rebuild under
  fresh groups: local copies only);
- another layout: the switcher moves weights (and the policy's optimizer state) in memory.

``trainee(layout, recompute)`` is ``policy_in`` for the TRAIN stage, with its recompute mode set
(runtime/recompute.py).

Split placement's train pool (``pools``: the world's pools, this rank's first): the switch runs
on the pool alone, its new layout's groups made by its ranks while the rollout pool plays
(runtime/switcher.py ``pools``, runtime/groups.py ``local``).

The reference is the initial policy (the seed's init, or run.init), frozen, with no optimizer.
It is NOT checkpointed: rebuilt on resume from (seed | init), which gives the same weights in
any layout (build_on_layout seeds Megatron's init in a forked RNG from the seed).

With LoRA (``model.lora``) there is no second model: the reference is the policy's own frozen
base with its adapters off (``base_reference``), which is the initial policy (B starts at zero)
and is never trained. ``reference_in(layout)`` is then the policy moved to ``layout`` with every
``LoraLinear`` off (models/lora.py ``set_adapters``); ``policy_in`` and ``trainee`` turn them
on again, so whoever asks for the policy gets it with adapters. ``reference`` is the policy
object itself (its layout is the reference's). Invariant: every forward of the policy goes
through ``policy_in`` / ``trainee`` (rollout, re-scoring, training, evaluation, the warm start
do); ``models.policy`` read directly after ``reference_in`` still has its adapters off.

PPO's critic (``algorithm.name=ppo``, trainer/critic.py) sits beside them: ``critic_in(layout)``
moves it to the batch's TRAIN layout (trainer/critic.py) as ``policy_in`` moves the policy:
its value head is a row of the tensor table (``ModelConfig.value_head``), so the switcher moves
the head and its Adam state with the trunk.
"""

from __future__ import annotations

from typing import Optional

from earl_megatron.config.model import ModelConfig
from earl_megatron.models.lora import set_adapters
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.runtime import groups
from earl_megatron.runtime.build import ModelOnLayout, OptimizerSpec, build_on_layout
from earl_megatron.runtime.recompute import set_recompute
from earl_megatron.runtime.switcher import switch_layout


class ModelPair:
    def __init__(self, policy: ModelOnLayout, reference: Optional[ModelOnLayout], *,
                 pools: Optional[tuple[ParallelLayout, ...]] = None, live: str = "policy",
                 base_reference: bool = False):
        if base_reference and (reference is not None or not policy.cfg.lora.enabled):
            raise ValueError("base_reference: the reference is the LoRA policy's own base; "
                             "pass reference=None and a policy with model.lora")
        self.policy = policy
        self._reference = reference
        self.base_reference = base_reference
        """LoRA with KL: the reference is the policy with its adapters off (module docstring)."""
        self.pools = pools
        """Split placement's pools (the train pool first): the models switch inside it."""
        self._live = live
        """Whose process groups are current: "policy", "reference" or "critic" (the model
        built last)."""
        self.critic: Optional[ModelOnLayout] = None
        """PPO's value model (``add_critic``); None for every other estimator."""

    @property
    def reference(self) -> Optional[ModelOnLayout]:
        """The KL reference (None: KL off); with ``base_reference`` the policy object."""
        return self.policy if self.base_reference else self._reference

    def policy_in(self, layout: ParallelLayout) -> ModelOnLayout:
        self.policy = self._live_in(self.policy, layout, "policy")
        if self.base_reference:
            set_adapters(self.policy.model, True)
        return self.policy

    def trainee(self, layout: ParallelLayout, recompute: str) -> ModelOnLayout:
        """The policy in ``layout``, running the TRAIN stage's recompute mode (the planner's
        choice) from its next forward: Megatron reads it at forward time, no rebuild."""
        policy = self.policy_in(layout)
        set_recompute(policy, recompute)
        return policy

    def reference_in(self, layout: ParallelLayout) -> ModelOnLayout:
        if self.base_reference:   # the policy's base: moved like the policy, adapters off
            policy = self.policy_in(layout)
            set_adapters(policy.model, False)
            return policy
        self._reference = self._live_in(self._reference, layout, "reference")
        return self._reference

    def add_critic(self, critic: ModelOnLayout) -> None:
        """PPO: the critic just built (its groups current)."""
        self.critic, self._live = critic, "critic"

    def critic_in(self, layout: ParallelLayout) -> ModelOnLayout:
        """The critic in ``layout`` with its groups current, moved like the policy (weights
        and Adam state, in memory)."""
        self.critic = self._live_in(self.critic, layout, "critic")
        return self.critic

    def _pools_with(self, layout: ParallelLayout) -> Optional[tuple[ParallelLayout, ...]]:
        """Split placement: the pools with this rank's (the train pool) in ``layout``."""
        return None if self.pools is None else (layout,) + tuple(self.pools[1:])

    def _reactivated(self, layout: ParallelLayout) -> bool:
        """``layout``'s cached groups (this pool's, on a split) current again; False: none."""
        pools = self._pools_with(layout)
        return groups.activate(layout) if pools is None else groups.activate_pool(pools)

    def _live_in(self, model: ModelOnLayout, layout: ParallelLayout, who: str) -> ModelOnLayout:
        pools = self._pools_with(layout)
        if not (layout == model.layout and (self._live == who or self._reactivated(layout))):
            model = switch_layout(model, layout, pools=pools)
        self._live = who
        return model


def build_model_pair(model: ModelConfig, policy_layout: ParallelLayout,
                     reference_layout: Optional[ParallelLayout], *, optimizer: OptimizerSpec,
                     seed: int, init: Optional[str] = None) -> ModelPair:
    """The policy (from ``init``, an HF directory or converted checkpoint, or Megatron's seeded
    init; with ``model.lora``, fresh adapters over that base) and the reference in its own
    layout (None: KL off; with LoRA the policy's base, no second model, and
    ``reference_layout`` only says that KL is on). The reference is built first: the model built
    last owns the live process groups."""
    if model.lora.enabled:
        return ModelPair(_initial(model, policy_layout, optimizer, seed, init), None,
                         base_reference=reference_layout is not None)
    reference = None
    if reference_layout is not None:
        reference = _initial(model, reference_layout, None, seed, init)
    return ModelPair(_initial(model, policy_layout, optimizer, seed, init), reference)


def _initial(model: ModelConfig, layout: ParallelLayout, optimizer: Optional[OptimizerSpec],
             seed: int, init: Optional[str]) -> ModelOnLayout:
    ddp = optimizer is not None
    if init:
        from earl_megatron.weights.convert import load_policy
        # the checkpoint's base; model.lora's adapters drawn fresh over it (A from the seed,
        # B zero), so the first forward is the checkpoint's
        return load_policy(init, layout, ddp=ddp, optimizer=optimizer, seed=seed,
                           lora=model.lora)
    return build_on_layout(model, layout, ddp=ddp, optimizer=optimizer, seed=seed)
