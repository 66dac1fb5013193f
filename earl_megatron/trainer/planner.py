"""The stage planner: the layout of each RL stage at its boundary, auto or static.

auto: the selector (plan/selector.py) chooses from the episode lengths, the memory model and
the cost of switching from the stage's current layout (hysteresis keeps it from flapping).
static: the config's layout, checked against the same memory model and budget first
(LayoutOverBudgetError instead of an out-of-memory crash mid-stage).

Memory of the other model: the reference shard stays resident while the policy rolls out and
trains, and the policy's weights, grads and Adam state stay resident while the reference scores:
``resident_bytes`` carries it into each stage's plan or check.

State: the selector's last choice per stage, saved with checkpoints (``state_json``) and
restored on resume (``restore``); the planner holds nothing else between iterations.
"""

from __future__ import annotations

from typing import Optional

from earl_megatron.config.model import ModelConfig
from earl_megatron.config.train import ClusterConfig, ConfigError, LayoutConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.memory_model import param_count_per_rank, train_state_bytes
from earl_megatron.plan.selector import (LayoutOverBudgetError, Selector, SelectorConfig,
                                         SelectorState)
from earl_megatron.plan.specs import ClusterSpec, GiB, Stage, StageWorkload, TrainOptions
from earl_megatron.trainer.stages import BatchShape

FIRST_ROLLOUT_TOKENS = 128
"""Episode length the first rollout is planned for, before any episode was played."""


class StagePlanner:
    def __init__(self, model: ModelConfig, layout: LayoutConfig, cluster: ClusterConfig,
                 world: int, *, distributed_optimizer: bool, episodes: int, batch: BatchShape,
                 rollout_max_pp: Optional[int] = None):
        self.model, self.layout_cfg, self.world = model, layout, world
        self.episodes, self.batch = episodes, batch
        self.auto = layout.mode == "auto"
        self.opts = TrainOptions(distributed_optimizer=distributed_optimizer)
        self.selector = Selector(model, _cluster_spec(cluster, layout, world), self.opts,
                                 SelectorConfig(memory_margin=layout.memory_margin,
                                                hysteresis=layout.hysteresis,
                                                max_tp=layout.max_tp, max_cp=layout.max_cp,
                                                max_pp=layout.max_pp,
                                                rollout_max_pp=rollout_max_pp))
        self.state = SelectorState()
        self.predicted_memory: dict[str, int] = {}
        self.reasons: dict[str, str] = {}
        self.last_lengths: list[int] = []

    def plan(self, stage: str, lengths: list[int], current: Optional[ParallelLayout],
             resident_bytes: int = 0) -> ParallelLayout:
        """The layout of ``stage`` for episodes of ``lengths`` tokens (NoLayoutFitsError when
        nothing fits in auto mode, LayoutOverBudgetError when the static layout does not)."""
        wl = self._workload(stage, lengths)
        if not self.auto:
            lay = ParallelLayout.parse(self.layout_cfg.static(stage), world_size=self.world,
                                       model=self.model)
            mem = self.selector.memory(lay, wl, resident_bytes)
            if mem.total > self.selector.budget_bytes:
                raise LayoutOverBudgetError(mem, self.selector.budget_bytes, max(lengths))
            self.predicted_memory[stage] = mem.total
            return lay
        plan, self.state = self.selector.plan(wl, current=current, state=self.state,
                                              resident_bytes=resident_bytes)
        self.predicted_memory[stage] = plan.predicted_memory_bytes
        self.reasons[stage] = plan.reason
        return plan.layout

    def rollout_lengths(self) -> list[int]:
        """Rollout plans on the last iteration's episode lengths (the first: a prompt budget)."""
        return self.last_lengths or [FIRST_ROLLOUT_TOKENS] * self.episodes

    def _workload(self, stage: str, lengths: list[int]) -> StageWorkload:
        if stage == "rollout":
            return StageWorkload.of(Stage.ROLLOUT, lengths, responses_in_flight=self.episodes)
        longest = max(lengths)
        tokens = self.batch.micro_batch_size * longest
        if self.batch.micro_batch_tokens:  # length-grouped micro-batches: a long one trains alone
            tokens = max(longest, min(self.batch.micro_batch_tokens, tokens))
        return StageWorkload.of(Stage(stage), lengths, micro_batch_tokens=tokens)

    # --- what the other model keeps resident, per rank (its most loaded pp_stage) ---------
    def weight_bytes(self, layout: Optional[ParallelLayout]) -> int:
        """A model's weights in ``layout`` (0 for None: no such model)."""
        if layout is None:
            return 0
        return max(param_count_per_rank(self.model, layout, r) for r in range(layout.pp)) \
            * self.opts.param_bytes(self.model)

    def train_bytes(self, layout: ParallelLayout) -> int:
        """The policy's weights, grads and Adam state in ``layout``."""
        return self.weight_bytes(layout) + train_state_bytes(self.model, layout, self.opts)

    # --- checkpointed state ---------------------------------------------------------------
    def state_json(self, state: Optional[SelectorState] = None) -> list:
        """The selector state (default: the current one) as JSON."""
        return [[s, str(lay)] for s, lay in (state or self.state).chosen]

    def restore(self, chosen: list, last_lengths: list[int]) -> None:
        self.last_lengths = list(last_lengths)
        if chosen and self.auto:
            self.state = SelectorState(tuple(
                (s, ParallelLayout.parse(lay, world_size=self.world)) for s, lay in chosen))


def _cluster_spec(c: ClusterConfig, layout: LayoutConfig, world: int) -> ClusterSpec:
    if c.preset == "cpu":
        budget = int((layout.memory_budget_gb or 2.0) * GiB)
        return ClusterSpec.cpu(ranks=world, memory_budget_bytes=budget)
    if c.preset == "h100":
        spec = ClusterSpec.h100_80gb(nodes=c.nodes, inter_node_gbps=c.inter_node_gbps)
        if layout.memory_budget_gb:
            spec = spec.with_(device_memory_bytes=int(layout.memory_budget_gb * GiB))
        return spec
    raise ConfigError(f"cluster.preset={c.preset!r}: use cpu or h100")
