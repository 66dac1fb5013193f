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

The reference is the initial policy (the seed's init, or run.init), frozen, with no optimizer;
with LoRA (``model.lora``) the base model without adapters, which is the initial policy.
It is NOT checkpointed: rebuilt on resume from (seed | init), which gives the same weights in
any layout (build_on_layout seeds Megatron's init in a forked RNG from the seed).

PPO's critic (``algorithm.name=ppo``, trainer/critic.py) sits beside them: ``critic_in(layout)``
makes its groups current like the others', but it never switches: it lives in one layout
(trainer/planner.py ``critic_choice``), whose groups stay cached.
"""

from __future__ import annotations

from typing import Optional

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.runtime import groups
from earl_megatron.runtime.build import ModelOnLayout, OptimizerSpec, build_on_layout
from earl_megatron.runtime.recompute import set_recompute
from earl_megatron.runtime.switcher import switch_layout


class ModelPair:
    def __init__(self, policy: ModelOnLayout, reference: Optional[ModelOnLayout], *,
                 pools: Optional[tuple[ParallelLayout, ...]] = None, live: str = "policy"):
        self.policy = policy
        self.reference = reference
        self.pools = pools
        """Split placement's pools (the train pool first): the models switch inside it."""
        self._live = live
        """Whose process groups are current: "policy", "reference" or "critic" (the model
        built last)."""
        self.critic: Optional[ModelOnLayout] = None
        """PPO's value model (``add_critic``); None for every other estimator."""

    def policy_in(self, layout: ParallelLayout) -> ModelOnLayout:
        self.policy = self._live_in(self.policy, layout, "policy")
        return self.policy

    def trainee(self, layout: ParallelLayout, recompute: str) -> ModelOnLayout:
        """The policy in ``layout``, running the TRAIN stage's recompute mode (the planner's
        choice) from its next forward: Megatron reads it at forward time, no rebuild."""
        policy = self.policy_in(layout)
        set_recompute(policy, recompute)
        return policy

    def reference_in(self, layout: ParallelLayout) -> ModelOnLayout:
        self.reference = self._live_in(self.reference, layout, "reference")
        return self.reference

    def add_critic(self, critic: ModelOnLayout) -> None:
        """PPO: the critic just built (its groups current)."""
        self.critic, self._live = critic, "critic"

    def critic_in(self, layout: ParallelLayout) -> ModelOnLayout:
        """The critic with its groups current; it lives in one layout (module docstring)."""
        if layout != self.critic.layout or not (self._live == "critic" or
                                                groups.activate(layout)):
            raise RuntimeError(f"the critic lives in {self.critic.layout} and cannot move to "
                               f"{layout} or be regrouped (issue #45): raise "
                               "cluster.group_cache_layouts (config/critic.py)")
        self._live = "critic"
        return self.critic

    def _live_in(self, model: ModelOnLayout, layout: ParallelLayout, who: str) -> ModelOnLayout:
        pools = None if self.pools is None else (layout,) + tuple(self.pools[1:])

        def activated() -> bool:
            return groups.activate(layout) if pools is None else groups.activate_pool(pools)

        if not (layout == model.layout and (self._live == who or activated())):
            model = switch_layout(model, layout, pools=pools)
        self._live = who
        return model


def build_model_pair(model: ModelConfig, policy_layout: ParallelLayout,
                     reference_layout: Optional[ParallelLayout], *, optimizer: OptimizerSpec,
                     seed: int, init: Optional[str] = None) -> ModelPair:
    """The policy (from ``init``, an HF directory or converted checkpoint, or Megatron's seeded
    init) and the reference in its own layout (None: KL off). The reference is built first: the
    model built last owns the live process groups."""
    reference = None
    if reference_layout is not None:
        # a LoRA run's reference is its frozen base without adapters: the initial policy
        # exactly (B starts at zero), without the adapters' work in every forward
        reference = _initial(model.base, reference_layout, None, seed, init)
    return ModelPair(_initial(model, policy_layout, optimizer, seed, init), reference)


def _initial(model: ModelConfig, layout: ParallelLayout, optimizer: Optional[OptimizerSpec],
             seed: int, init: Optional[str]) -> ModelOnLayout:
    ddp = optimizer is not None
    if init:
        from earl_megatron.weights.convert import load_policy
        return load_policy(init, layout, ddp=ddp, optimizer=optimizer, seed=seed)
    return build_on_layout(model, layout, ddp=ddp, optimizer=optimizer, seed=seed)
