"""The stage planner: the layout of each RL stage at its boundary, auto or static.

auto: the selector (plan/selector.py) chooses from the episode lengths, the memory model and
the cost of switching from the stage's current layout (hysteresis keeps it from flapping).
static: the config's layout, checked against the same memory model and budget first
(LayoutOverBudgetError instead of an out-of-memory crash mid-stage).

Memory of the other model: the reference shard stays resident while the policy rolls out and
trains, and the policy's weights, grads and Adam state stay resident while the reference scores:
``resident_bytes`` carries it into each stage's plan or check. PPO's critic (``critic_layout``)
adds its weights, grads and Adam state (the policy's shape: the value head is counted as the
output layer, an overestimate) to every stage's. Its stages run in the batch's TRAIN layout
(the critic trains where the policy trains and moves with it: trainer/critic.py), so under
auto the TRAIN plan counts the critic's state in each candidate's own layout, the rollout's and
the reference's in the layout it is in (``critic_layout``, the last TRAIN's). Its VALUES stage
is taken as covered by its CRITIC TRAIN estimate, which gets a recompute mode of its own
(``critic_train``: the fastest that fits beside the policy's train state). Where it is built:
``critic_choice``. The byte counts are plan/critic_memory.py's, which ``earl plan --critic``
calls too.
A LoRA run's reference is the policy's own base with its adapters off (trainer/model_pair.py):
it holds no weights of its own (``weight_bytes`` 0), and while it scores only the policy's
grads and Adam state (the adapters') are resident beside the weights the LOGPROB stage counts
(``train_bytes``).

SGLang rollouts (``sglang_mem_fraction`` given): the cluster's decode engine is the servers
(``DecodeEngine.sglang_servers`` with the fraction they are started with: weights / tp plus a
static KV pool, tp x dp layouts only), and a ROLLOUT layout change costs a server restart
(plan/server_restart.py). ``record_start`` keeps each measured server start in the profile
table by (model, tp), so later plans price a restart with the measurement instead of
``sglang_restart_s``.

Recompute (``layout.recompute``): "auto" lets the selector choose the TRAIN stage's mode with its
layout every iteration (auto layouts: the cheapest fitting (layout, mode) pair; a static layout:
its fastest fitting mode); a mode name fixes it for the run. ``recompute["train"]`` is the mode
the TRAIN stage runs with (the runner sets it on the model: runtime/recompute.py);
``recompute["critic_train"]`` the critic's (trainer/critic.py).

State: the selector's last choice per stage and the profile table (server starts), saved with
checkpoints (``state_json``, ``profile_json``) and restored on resume (``restore``); the
planner holds nothing else between iterations.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from earl_megatron.config.model import ModelConfig
from earl_megatron.config.cluster import ClusterConfig
from earl_megatron.config.train import ConfigError, LayoutConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.rollout_rules import rollout_layout_problem
from earl_megatron.plan import critic_memory
from earl_megatron.plan.critic_memory import FIRST_ROLLOUT_TOKENS
from earl_megatron.plan.memory_model import MemoryEstimate, server_pool_fits
from earl_megatron.plan.profile_table import ProfileTable
from earl_megatron.plan.selector import (RECOMPUTE_ORDER, LayoutOverBudgetError, Selector,
                                         SelectorConfig, SelectorState)
from earl_megatron.plan.server_restart import model_key
from earl_megatron.plan.split import SplitWorkload
from earl_megatron.plan.specs import (PREFILL_TOKENS, ClusterSpec, DecodeEngine, GiB, Recompute,
                                      Stage, StageWorkload, TrainOptions, cluster_spec,
                                      human_bytes)
from earl_megatron.trainer.stages import BatchShape


class StagePlanner:
    def __init__(self, model: ModelConfig, layout: LayoutConfig, cluster: ClusterConfig,
                 world: int, *, distributed_optimizer: bool, episodes: int, batch: BatchShape,
                 sglang_mem_fraction: Optional[float] = None, sglang_restart_s: float = 60.0,
                 prefill_tokens: int = PREFILL_TOKENS, in_flight: Optional[int] = None,
                 rollout_max_ep: Optional[int] = None, critic: bool = False):
        self.model, self.layout_cfg, self.world = model, layout, world
        self.episodes, self.batch, self.prefill_tokens = episodes, batch, prefill_tokens
        self.in_flight = in_flight or episodes
        """Episodes a rollout stage decodes at once: the batch, or (k + 1) batches under
        asynchronous RL (algorithm.max_staleness = k)."""
        self.auto = layout.mode == "auto"
        auto_recompute = layout.recompute == "auto"
        self.opts = TrainOptions(distributed_optimizer=distributed_optimizer,
                                 recompute=Recompute.NONE if auto_recompute
                                 else Recompute(layout.recompute))
        spec = _cluster_spec(cluster, layout, world)
        if sglang_mem_fraction is not None:
            if sglang_mem_fraction > 1 - layout.memory_margin:
                raise ConfigError(
                    f"rollout.sglang_mem_fraction={sglang_mem_fraction} leaves nothing under "
                    f"layout.memory_margin={layout.memory_margin}: the servers take that "
                    f"fraction of the device at start; use at most {1 - layout.memory_margin:g}")
            spec = spec.with_(decode_engine=DecodeEngine.sglang_servers(sglang_mem_fraction))
        self.selector = Selector(model, spec, self.opts,
                                 SelectorConfig(memory_margin=layout.memory_margin,
                                                hysteresis=layout.hysteresis,
                                                max_tp=layout.max_tp, max_cp=layout.max_cp,
                                                max_pp=layout.max_pp,
                                                server_restart_s=sglang_restart_s,
                                                auto_recompute=auto_recompute,
                                                rollout_max_ep=rollout_max_ep))
        self.servers = sglang_mem_fraction is not None
        self.profile = ProfileTable()
        self.state = SelectorState()
        self.predicted_memory: dict[str, int] = {}
        self.predicted_seconds: dict[str, float] = {}
        """Each auto-planned stage's predicted seconds (the selector's time model, without the
        switch, which the record times apart), beside the measured ones in the record."""
        self.reasons: dict[str, str] = {}
        self.recompute: dict[str, str] = {}
        """The TRAIN stage's recompute mode of the last plan ({"train": "full"})."""
        self.last_lengths: list[int] = []
        self.critic = critic
        """ppo: a critic trains where the policy trains (split plans count it there)."""
        self.critic_layout: Optional[ParallelLayout] = None
        """ppo: the critic's layout (trainer/critic.py: each batch's TRAIN layout, where the
        trainer moves it); its weights, grads and Adam state are resident beside every stage,
        counted in every plan and static check."""

    def plan(self, stage: str, lengths: list[int], current: Optional[ParallelLayout],
             resident_bytes: int = 0, *, fixed: Optional[ParallelLayout] = None
             ) -> ParallelLayout:
        """The layout of ``stage`` for episodes of ``lengths`` tokens (NoLayoutFitsError when
        nothing fits in auto mode, LayoutOverBudgetError when the static layout does not).
        ``fixed``: this layout, checked as a static one is (split placement's train pool, whose
        layout the split's plan chose)."""
        wl = self._workload(stage, lengths)
        selector = self.selector
        if self.critic_layout is not None and self.auto and fixed is None and stage == "train":
            # the critic moves to the TRAIN layout chosen here: its train state is counted in
            # each candidate's own layout (critic_memory.beside_critic)
            selector = critic_memory.beside_critic(selector)
        elif self.critic_layout is not None:   # the critic's train state beside every stage
            resident_bytes += critic_memory.held_bytes(critic_memory.critic_model(self.model),
                                                       self.critic_layout, self.opts)
        if not self.auto or fixed is not None:
            lay = fixed or ParallelLayout.parse(self.layout_cfg.static(stage),
                                                world_size=self.world, model=self.model)
            problem = stage == "rollout" and rollout_layout_problem(
                lay, "sglang" if self.servers else "embedded")
            if problem:
                raise ConfigError(f"layout.rollout={self.layout_cfg.rollout}: {problem}")
            mem, rc = self._static_memory(lay, wl, resident_bytes)
            if mem.total > self.selector.budget_bytes:
                raise LayoutOverBudgetError(mem, self.selector.budget_bytes, max(lengths))
            if not server_pool_fits(mem, self.selector.cluster):
                raise ConfigError(
                    f"layout.rollout={lay}: the SGLang servers' static KV pool (the memory "
                    f"fraction of {human_bytes(self.selector.cluster.device_memory_bytes)} minus "
                    f"what the device holds) cannot hold one {max(lengths)}-token sequence "
                    f"({mem.describe()}): raise rollout.sglang_mem_fraction or use more tp")
            self.predicted_memory[stage] = mem.total
            if stage == "train":
                self.recompute[stage] = rc.value
            return lay
        plan, self.state = selector.plan(wl, current=current, state=self.state,
                                         resident_bytes=resident_bytes)
        self.predicted_memory[stage] = plan.predicted_memory_bytes
        self.predicted_seconds[stage] = plan.predicted_seconds
        self.reasons[stage] = plan.reason
        if stage == "train":
            self.recompute[stage] = plan.recompute.value
        return plan.layout

    def critic_choice(self) -> ParallelLayout:
        """ppo: the layout the critic is built in (each batch then moves it to its TRAIN
        layout). static: layout.train. auto: the last TRAIN layout of a checkpoint's selector
        state (``restore``), else the selector's TRAIN layout for a batch of the first
        rollout's planned length, with the policy's train state counted resident in each
        candidate's own layout (the policy laid out like the candidate: plan/critic_memory.py
        ``critic_plan``), the selector's state (its hysteresis) left as it was."""
        if not self.auto:
            return ParallelLayout.parse(self.layout_cfg.static("train"), world_size=self.world,
                                        model=self.model)
        last = self.state.previous(Stage.TRAIN)
        if last is not None:
            return last
        wl = self._workload("train", [FIRST_ROLLOUT_TOKENS] * self.episodes)
        return critic_memory.critic_plan(self.selector, wl).layout

    def critic_train(self, lengths: list[int], policy_layout: ParallelLayout) -> str:
        """ppo: CRITIC TRAIN's recompute mode for a batch of ``lengths`` in the critic's layout,
        chosen as a static TRAIN layout's is (the fastest mode that fits; a mode name in
        layout.recompute fixes it), with the policy's train state in ``policy_layout``
        resident (LayoutOverBudgetError when no mode fits). Planned before the policy's TRAIN
        step, so an over-budget batch stops the iteration before anything trains; the estimate
        is ``predicted_memory["critic_train"]``."""
        wl = self._workload("train", lengths)
        mem, rc = self._static_memory(
            self.critic_layout, wl, critic_memory.held_bytes(self.model, policy_layout, self.opts),
            sel=critic_memory.critic_selector(self.selector))
        if mem.total > self.selector.budget_bytes:
            raise LayoutOverBudgetError(mem, self.selector.budget_bytes, max(lengths))
        self.predicted_memory["critic_train"] = mem.total
        self.recompute["critic_train"] = rc.value
        return rc.value

    def _static_memory(self, lay: ParallelLayout, wl: StageWorkload, resident_bytes: int,
                       sel: Optional[Selector] = None) -> tuple[MemoryEstimate, Recompute]:
        """A static layout's estimate with its recompute mode: the fastest that fits (the
        smallest estimate when none does); ``sel``: the selector of another model (the
        critic's)."""
        sel, fitting = sel or self.selector, []
        modes = sel.recompute_modes(wl.stage)
        for rc in modes:
            mem = sel.memory(lay, wl, resident_bytes, rc)
            if sel.fits(mem):
                fitting.append((sel.evaluate(lay, wl, recompute=rc).predicted_seconds,
                                RECOMPUTE_ORDER.index(rc), mem, rc))
        if fitting:
            return min(fitting, key=lambda f: f[:2])[2:]
        return sel.memory(lay, wl, resident_bytes, modes[-1]), modes[-1]

    def record_start(self, tp: int, seconds: float) -> None:
        """A measured server (re)start with this tp (the same value on every rank): later
        plans price a restart with it."""
        self.profile = self.profile.record_restart(model_key(self.model), tp, seconds)
        self.selector = replace(self.selector, profile=self.profile)

    def rollout_lengths(self, carried: Sequence[int] = ()) -> list[int]:
        """Rollout plans on the last iteration's episode lengths (the first: a prompt budget)
        for the episodes it starts, and on the contexts of the ones it continues (``carried``,
        asynchronous RL), each planned at the last batch's longest length or its own."""
        new = self.last_lengths or [FIRST_ROLLOUT_TOKENS] * self.episodes
        if not carried:
            return new
        # the new episodes grow as the last batch did; a carried one is from the last batch's
        # long tail (it outlived a stage): planned at the longest length, or its own if longer
        return list(new)[:max(self.in_flight - len(carried), 0)] + \
            [max(c, max(new)) for c in carried]

    def _workload(self, stage: str, lengths: list[int]) -> StageWorkload:
        if stage == "rollout":
            return StageWorkload.of(Stage.ROLLOUT, lengths, responses_in_flight=self.in_flight,
                                    micro_batch_tokens=self.prefill_tokens)
        longest = max(lengths)
        tokens = self.batch.micro_batch_size * longest
        if self.batch.micro_batch_tokens:  # length-grouped micro-batches: a long one trains alone
            tokens = max(longest, min(self.batch.micro_batch_tokens, tokens))
        return StageWorkload.of(Stage(stage), lengths, micro_batch_tokens=tokens)

    def split_workload(self, env_seconds: float = 0.0) -> SplitWorkload:
        """One iteration's work for split placement's plan (plan/split.py): the rollout of
        what is in flight (plus ``env_seconds`` of environments), the scoring and training of a
        batch like the last one."""
        lengths = self.last_lengths or [FIRST_ROLLOUT_TOKENS] * self.episodes
        return SplitWorkload(self._workload("rollout", self.rollout_lengths()),
                             self._workload("logprob", lengths),
                             self._workload("train", lengths), env_seconds=env_seconds,
                             critic=self.critic)

    # --- what the other model keeps resident, per rank (its most loaded pp_stage) ---------
    def weight_bytes(self, layout: Optional[ParallelLayout]) -> int:
        """The reference's own weights in ``layout`` (0 for None: no reference; 0 with LoRA:
        the reference is the policy's base, whose weights the policy's stages count)."""
        if layout is None or self.model.lora.enabled:
            return 0
        return critic_memory.weight_bytes(self.model, layout, self.opts)

    def train_bytes(self, layout: ParallelLayout) -> int:
        """What the policy keeps beside the reference while it scores: its weights, grads and
        Adam state in ``layout``; with LoRA the grads and Adam state only (the reference's
        LOGPROB stage runs on the policy's weights and counts them)."""
        return critic_memory.train_bytes(self.model, layout, self.opts)

    # --- checkpointed state ---------------------------------------------------------------
    def state_json(self, state: Optional[SelectorState] = None) -> list:
        """The selector state (default: the current one) as JSON."""
        return [[s, str(lay)] for s, lay in (state or self.state).chosen]

    def profile_json(self) -> dict:
        return self.profile.to_json()

    def restore(self, chosen: list, last_lengths: list[int],
                profile: Optional[dict] = None) -> None:
        """``profile``: a checkpoint's table (kept on another world too: its restart entries
        are keyed by (model, tp), not by layout)."""
        self.last_lengths = list(last_lengths)
        if profile:
            self.profile = ProfileTable.from_json(profile, "checkpoint loop.json profile")
            self.selector = replace(self.selector, profile=self.profile)
        if chosen and self.auto:
            self.state = SelectorState(tuple(
                (s, ParallelLayout.parse(lay, world_size=self.world)) for s, lay in chosen))


def _cluster_spec(c: ClusterConfig, layout: LayoutConfig, world: int) -> ClusterSpec:
    """``cluster.*`` -> the selector's cluster, through the one mapping (plan/specs.py): nodes x
    devices per node as torchrun started them (validate() checked nodes x local ranks = world)."""
    budget = int(layout.memory_budget_gb * GiB) if layout.memory_budget_gb else None
    try:
        return cluster_spec(c.preset, nodes=c.nodes,
                            devices_per_node=c.devices_per_node or world // c.nodes,
                            inter_node_gbps=c.inter_node_gbps, device_memory_bytes=budget)
    except ValueError as e:
        raise ConfigError(f"cluster.preset: {e}") from e
