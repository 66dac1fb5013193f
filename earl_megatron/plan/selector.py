"""The layout selector: the fastest layout that fits, per stage, with the cost of switching counted.

For one stage's workload::

    valid layouts (enumerate_layouts)  --memory model-->  fitting: total <= budget * (1 - margin)
        --time model x profile factor + switch cost from the live layout-->  ranked candidates
        --hysteresis against last iteration's choice for this stage-->  LayoutPlan

Switch cost: the bytes each rank receives in the reshard plan the switcher runs
(plan/reshard_plan.py, ``receive_bytes``: what the rank owns in the new layout and did not hold
in the old one) for the weights and, for TRAIN, the optimizer state (which lives in the TRAIN
layout), over the slowest link a reshard may use, plus the fixed regroup time. When ROLLOUT
runs on inference servers (``ClusterSpec.decode_engine.servers``: SGLang), a ROLLOUT layout
whose (tp, dp) differs from the servers' (the last ROLLOUT choice) also pays their restart and a
weight push (plan/server_restart.py: measured restart seconds per (model, tp) from the profile
table, else ``SelectorConfig.server_restart_s``); such layouts are tp x dp only, and fit only if
the servers' static KV pool holds one sequence.

Hysteresis: the previous choice for the stage is kept unless the best candidate's cost is lower
by more than ``hysteresis`` (a fraction), so a workload that oscillates around a boundary does not
flap. The state is a frozen ``SelectorState`` passed in and returned; nothing is mutated.

Invariants (tested): a plan's layout is valid for the world size and model; its predicted memory
is at most budget x (1 - margin); equal inputs give equal plans (ties break by cost, then memory,
then layout order); ``NoLayoutFitsError`` lists only suggestions it has checked fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout, enumerate_layouts
from earl_megatron.plan.memory_model import (MemoryEstimate, memory_breakdown,
                                             server_pool_fits, train_state_split)
from earl_megatron.plan.profile_table import ProfileTable
from earl_megatron.plan.reshard_plan import receive_bytes
from earl_megatron.plan.server_restart import server_switch_seconds
from earl_megatron.plan.specs import (ClusterSpec, Recompute, Stage, StageWorkload, TrainOptions,
                                     human_bytes)
from earl_megatron.plan.time_model import StageTime, stage_time

@dataclass(frozen=True)
class SelectorConfig:
    memory_margin: float = 0.1
    """Keep this fraction of device memory free (fragmentation, estimate error)."""
    hysteresis: float = 0.05
    """Switch away from last iteration's layout only if the new one is this fraction cheaper."""
    max_tp: Optional[int] = None
    max_cp: Optional[int] = None
    max_pp: Optional[int] = None
    rollout_max_pp: Optional[int] = None
    """Cap on pp for ROLLOUT (None: max_pp). Servers (SGLang) get pp = cp = 1 regardless."""
    rollout_cp: bool = False
    """Allow cp > 1 for ROLLOUT. Off: Megatron-Core's inference engines and SGLang do not split
    a KV cache by sequence position."""
    server_restart_s: float = 60.0
    """Seconds a restart of the rollout servers costs (decode engine ``servers``) until the
    profile table holds a measurement for the (model, tp) (plan/server_restart.py)."""

    def __post_init__(self):
        if not 0 <= self.memory_margin < 1:
            raise ValueError(f"memory_margin must be in [0, 1), got {self.memory_margin}")
        if not self.server_restart_s >= 0:
            raise ValueError(f"server_restart_s must be >= 0, got {self.server_restart_s}")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"hysteresis must be in [0, 1), got {self.hysteresis}")


@dataclass(frozen=True)
class SelectorState:
    """Last chosen layout per stage, as sorted (stage value, layout) pairs."""

    chosen: tuple[tuple[str, ParallelLayout], ...] = ()

    def previous(self, stage: Stage) -> Optional[ParallelLayout]:
        return dict(self.chosen).get(stage.value)

    def with_choice(self, stage: Stage, layout: ParallelLayout) -> "SelectorState":
        d = dict(self.chosen)
        d[stage.value] = layout
        return SelectorState(tuple(sorted(d.items())))


@dataclass(frozen=True)
class Candidate:
    layout: ParallelLayout
    memory: MemoryEstimate
    time: StageTime
    scale: float
    """Profile-table factor applied to the analytic time (1.0 without a table)."""
    switch_seconds: float

    @property
    def predicted_seconds(self) -> float:
        return self.time.total * self.scale

    @property
    def cost(self) -> float:
        return self.predicted_seconds + self.switch_seconds


@dataclass(frozen=True)
class LayoutPlan:
    stage: Stage
    chosen: Candidate
    runner_up: Optional[Candidate]
    reason: str
    num_valid: int
    oom: tuple[ParallelLayout, ...]
    """Valid layouts rejected because their predicted memory exceeds the budget."""
    budget_bytes: int

    @property
    def layout(self) -> ParallelLayout:
        return self.chosen.layout

    @property
    def predicted_memory_bytes(self) -> int:
        return self.chosen.memory.total

    @property
    def predicted_seconds(self) -> float:
        return self.chosen.predicted_seconds


class NoLayoutFitsError(RuntimeError):
    """No valid layout fits; ``suggestions`` are changes checked to make one fit."""

    def __init__(self, stage: Stage, budget_bytes: int, smallest: Optional[MemoryEstimate],
                 suggestions: tuple[str, ...]):
        self.stage, self.budget_bytes, self.smallest = stage, budget_bytes, smallest
        self.suggestions = suggestions
        need = smallest.describe() if smallest else "no valid layout at all"
        fixes = "; ".join(suggestions) if suggestions else (
            "nothing checked fits (up to 64x the devices, recompute, a smaller micro-batch, fewer "
            "responses, shorter contexts): the weights and optimizer state alone are too large")
        super().__init__(f"no layout fits stage {stage.value} in {human_bytes(budget_bytes)} per "
                         f"rank; the smallest is {need}. Would fit: {fixes}")


class LayoutOverBudgetError(RuntimeError):
    """A fixed (static) layout does not fit the budget: what a GPU run would hit as an OOM."""

    def __init__(self, estimate: MemoryEstimate, budget_bytes: int, longest: int):
        self.estimate, self.budget_bytes, self.longest = estimate, budget_bytes, longest
        st, lay = estimate.stage.value, estimate.layout
        super().__init__(
            f"static layout {lay} for stage {st} needs {estimate.describe()} per rank for "
            f"contexts up to {longest} tokens, over the {human_bytes(budget_bytes)} budget: "
            f"use layout=auto (the selector moves to a layout that fits as contexts grow), a "
            f"static layout.{st}= with more tp, cp or pp, or a larger layout.memory_budget_gb")


# ------------------------------------------------------------------------------ switch cost
def switch_seconds(model: ModelConfig, cluster: ClusterSpec, src: Optional[ParallelLayout],
                   dst: ParallelLayout, train_opts: TrainOptions = TrainOptions(), *,
                   optimizer_src: Optional[ParallelLayout] = None) -> float:
    """Seconds to switch the live layout ``src`` to ``dst`` (0 if equal or nothing is live).

    ``optimizer_src``: the layout the optimizer state lives in, when ``dst`` is a TRAIN layout
    (its state must follow when the TRAIN layout changes)."""
    pb = train_opts.param_bytes(model)
    recv = [0] * dst.world_size
    moved = False
    if src is not None and src != dst:
        recv = list(receive_bytes(model, src, dst, element_bytes=pb))
        moved = True
    if optimizer_src is not None and optimizer_src != dst:
        obpp = train_opts.optimizer_bytes_per_param(model)
        shard_src = optimizer_src.dp * optimizer_src.cp if train_opts.distributed_optimizer else 1
        shard_dst = dst.dp * dst.cp if train_opts.distributed_optimizer else 1
        weights = receive_bytes(model, optimizer_src, dst, element_bytes=obpp)
        for r in range(dst.world_size):
            if shard_src == shard_dst and (not model.is_moe or optimizer_src.edp == dst.edp):
                recv[r] += math.ceil(weights[r] / shard_dst)
            else:                       # shard boundaries move: assume the whole shard does
                recv[r] += train_state_split(model, dst, dst.coords(r).pp, train_opts)[1]
        moved = True
    if not moved:
        return 0.0
    bw = (cluster.inter_node_bandwidth / cluster.devices_per_node if cluster.nodes > 1
          else cluster.intra_node_bandwidth)
    return cluster.regroup_seconds + max(recv) / bw


# ------------------------------------------------------------------------------ selection
def _load(workload: StageWorkload) -> int:
    return workload.responses_in_flight if workload.stage is Stage.ROLLOUT \
        else workload.num_sequences


def _profile_workload(workload: StageWorkload, context: int, load: int) -> StageWorkload:
    """The uniform workload a profile entry measured: ``load`` sequences of ``context`` tokens."""
    return replace(workload, contexts=((context, load),), responses_in_flight=load,
                   predicted_context=0)


@dataclass(frozen=True)
class Selector:
    """Model, cluster and options fixed for a run; ``plan`` picks one stage's layout."""

    model: ModelConfig
    cluster: ClusterSpec
    train_opts: TrainOptions = TrainOptions()
    config: SelectorConfig = SelectorConfig()
    profile: Optional[ProfileTable] = None

    @property
    def budget_bytes(self) -> int:
        return int(self.cluster.device_memory_bytes * (1 - self.config.memory_margin))

    def valid_layouts(self, stage: Optional[Stage] = None) -> list[ParallelLayout]:
        """Layouts valid for the world and model, within the config's caps, for ``stage``."""
        c = self.config
        max_cp = 1 if stage is Stage.ROLLOUT and not c.rollout_cp else c.max_cp
        max_pp = c.max_pp
        if stage is Stage.ROLLOUT and c.rollout_max_pp is not None:
            max_pp = min(c.rollout_max_pp, max_pp or c.rollout_max_pp)
        servers = stage is Stage.ROLLOUT and self.cluster.decode_engine.servers
        if servers:
            max_cp = max_pp = 1             # SGLang servers: tp x dp only
        # MoE: every ep, with experts tensor-split like the rest (etp = tp) or not at all (etp 1)
        layouts = enumerate_layouts(self.cluster.world_size, self.model, max_tp=c.max_tp,
                                    max_cp=max_cp, max_pp=max_pp, expert_tp="both")
        if servers:     # the trainer starts its servers with tp and dp only (no ep flag)
            layouts = [lay for lay in layouts if lay.ep == 1 and lay.etp is None]
        return layouts

    def memory(self, layout: ParallelLayout, workload: StageWorkload,
               resident_bytes: int = 0) -> MemoryEstimate:
        return memory_breakdown(self.model, layout, workload, self.train_opts,
                                cluster=self.cluster, resident_bytes=resident_bytes)

    def fits(self, estimate: MemoryEstimate) -> bool:
        """Within the budget (and, on servers, their static pool holds one sequence)."""
        return estimate.total <= self.budget_bytes and server_pool_fits(estimate, self.cluster)

    def evaluate(self, layout: ParallelLayout, workload: StageWorkload, *,
                 current: Optional[ParallelLayout] = None, state: SelectorState = SelectorState(),
                 resident_bytes: int = 0) -> Candidate:
        """Memory, time, profile factor and switch cost of one layout (fitting or not)."""
        t = stage_time(self.model, layout, workload, self.cluster, self.train_opts)
        scale = 1.0
        if self.profile is not None:
            def analytic_for(lay):
                return lambda ctx, ld: stage_time(self.model, lay, _profile_workload(
                    workload, ctx, ld), self.cluster, self.train_opts).total
            scale = self.profile.scale_factor(workload.stage, layout, workload.contexts[-1][0],
                                              _load(workload), analytic_for)
        opt_src = state.previous(Stage.TRAIN) if workload.stage is Stage.TRAIN else None
        sw = switch_seconds(self.model, self.cluster, current, layout, self.train_opts,
                            optimizer_src=opt_src)
        if workload.stage is Stage.ROLLOUT and self.cluster.decode_engine.servers:
            sw += server_switch_seconds(self.model, self.cluster, state.previous(Stage.ROLLOUT),
                                        layout, self.profile, self.config.server_restart_s,
                                        self.train_opts)
        return Candidate(layout, self.memory(layout, workload, resident_bytes), t, scale, sw)

    def plan(self, workload: StageWorkload, *, current: Optional[ParallelLayout] = None,
             state: SelectorState = SelectorState(),
             resident_bytes: int = 0) -> tuple[LayoutPlan, SelectorState]:
        """Choose the layout for ``workload``; return the plan and the next state.

        ``current``: the live layout (the previous stage's), from which switching is costed."""
        valid = self.valid_layouts(workload.stage)
        budget = self.budget_bytes
        fitting, oom, smallest = [], [], None
        for lay in valid:
            mem = self.memory(lay, workload, resident_bytes)
            if self.fits(mem):
                fitting.append(self.evaluate(lay, workload, current=current, state=state,
                                             resident_bytes=resident_bytes))
            else:
                oom.append(lay)
                if smallest is None or mem.total < smallest.total:
                    smallest = mem
        if not fitting:
            raise NoLayoutFitsError(workload.stage, budget, smallest,
                                    self._suggestions(workload, resident_bytes))
        ranked = sorted(fitting, key=lambda c: (c.cost, c.memory.total, c.layout))
        best = ranked[0]
        chosen, runner_up = best, (ranked[1] if len(ranked) > 1 else None)
        prev = state.previous(workload.stage)
        incumbent = next((c for c in ranked if c.layout == prev), None)
        if incumbent is not None and incumbent is not best \
                and best.cost >= incumbent.cost * (1 - self.config.hysteresis):
            chosen, runner_up = incumbent, best
            reason = (f"kept {prev}: best alternative {best.layout} is only "
                      f"{100 * (1 - best.cost / incumbent.cost):.1f}% cheaper (switch "
                      f"{best.switch_seconds:.3g} s included), under the "
                      f"{100 * self.config.hysteresis:.0f}% hysteresis")
        else:
            gone = prev is not None and incumbent is None
            reason = (f"{best.layout}: last layout {prev} no longer fits; fastest of "
                      f"{len(ranked)}" if gone else
                      f"{best.layout}: fastest of {len(ranked)} fitting layouts")
            if runner_up is not None:
                reason += f" ({best.cost:.3g} s vs {runner_up.cost:.3g} s for {runner_up.layout})"
        reason += f"; {human_bytes(chosen.memory.total)} of {human_bytes(budget)}"
        if self.model.is_moe:
            reason += "; " + self._expert_reason(chosen, valid, workload, resident_bytes)
        plan = LayoutPlan(workload.stage, chosen, runner_up, reason, len(valid), tuple(oom),
                          budget)
        return plan, state.with_choice(workload.stage, chosen.layout)

    def plan_iteration(self, workloads: Sequence[StageWorkload], *,
                       current: Optional[ParallelLayout] = None,
                       state: SelectorState = SelectorState()
                       ) -> tuple[tuple[LayoutPlan, ...], SelectorState]:
        """Plan the stages of one iteration in order; each switches from the previous one."""
        plans = []
        for wl in workloads:
            plan, state = self.plan(wl, current=current, state=state)
            plans.append(plan)
            current = plan.layout
        return tuple(plans), state

    def _expert_reason(self, chosen: Candidate, valid: Sequence[ParallelLayout],
                       workload: StageWorkload, resident_bytes: int) -> str:
        """What EP buys and costs in the chosen layout: experts and weights per rank against
        the same layout at ep = 1, and the all-to-all's seconds."""
        lay, e = chosen.layout, self.model.num_experts
        text = (f"EP{lay.ep}: {e // lay.ep} of {e} experts per rank"
                + (f" (expert TP {lay.expert_tp})" if lay.expert_tp != lay.tp else ""))
        if lay.ep > 1:
            text += f", all-to-all {chosen.time.ep_comm * chosen.scale:.3g} s"
            ep1 = replace(lay, ep=1, etp=None)
            if ep1 in valid:
                m1 = self.memory(ep1, workload, resident_bytes)
                text += (f"; {ep1} (EP1) would need {human_bytes(m1.total)}, weights "
                         f"{human_bytes(m1.weights)} vs {human_bytes(chosen.memory.weights)}"
                         + ("" if self.fits(m1) else ", over the budget"))
        return text

    # -------------------------------------------------------------- what would fit
    def fits_somewhere(self, workload: StageWorkload, resident_bytes: int = 0) -> \
            Optional[MemoryEstimate]:
        """The smallest-memory fitting estimate, or None if nothing fits."""
        best = None
        for lay in self.valid_layouts(workload.stage):
            mem = self.memory(lay, workload, resident_bytes)
            if self.fits(mem) and (best is None or mem.total < best.total):
                best = mem
        return best

    def _suggestions(self, workload: StageWorkload, resident_bytes: int) -> tuple[str, ...]:
        out = []
        for k in (2, 4, 8, 16, 32, 64):
            bigger = replace(self, cluster=self.cluster.with_(nodes=self.cluster.nodes * k))
            fit = bigger.fits_somewhere(workload, resident_bytes)
            if fit is not None:
                out.append(f"{bigger.cluster.nodes} nodes ({bigger.cluster.world_size} devices), "
                           f"e.g. {fit.layout} at {human_bytes(fit.total)}")
                break
        if workload.stage is Stage.TRAIN:
            order = [Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL]
            for rc in order[order.index(self.train_opts.recompute) + 1:]:
                other = replace(self, train_opts=self.train_opts.with_(recompute=rc))
                fit = other.fits_somewhere(workload, resident_bytes)
                if fit is not None:
                    out.append(f"recompute={rc.value}, e.g. {fit.layout} at "
                               f"{human_bytes(fit.total)}")
                    break
        # A TRAIN/LOGPROB micro-batch holds at least one whole sequence; rollout chunks prefill.
        floor = 1 if workload.stage is Stage.ROLLOUT else workload.max_context
        mb = workload.micro_batch_tokens
        while mb > floor and mb > 1:
            mb //= 2
            fit = self.fits_somewhere(workload.with_(micro_batch_tokens=mb), resident_bytes)
            if fit is not None:
                out.append(f"micro_batch_tokens={mb}, e.g. {fit.layout} at "
                           f"{human_bytes(fit.total)}")
                break
        if workload.stage is Stage.ROLLOUT and workload.responses_in_flight > 1:
            r = _largest(lambda n: self.fits_somewhere(
                workload.with_(responses_in_flight=n), resident_bytes) is not None,
                1, workload.responses_in_flight - 1)
            if r:
                out.append(f"responses_in_flight={r}")
        if workload.max_context > 1:
            top = workload.contexts[-1][0]
            s = _largest(lambda n: self.fits_somewhere(
                workload.scaled_to(n).with_(predicted_context=0), resident_bytes) is not None,
                1, workload.max_context - 1)
            if s and s < top:
                out.append(f"contexts up to {s} tokens (now {workload.max_context})")
        return tuple(out)


def _largest(ok, lo: int, hi: int) -> int:
    """Largest n in [lo, hi] with ok(n), assuming ok is monotone (true then false); 0 if none."""
    if hi < lo or not ok(lo):
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def select_layout(model: ModelConfig, cluster: ClusterSpec, workload: StageWorkload,
                  train_opts: TrainOptions = TrainOptions(), *,
                  current: Optional[ParallelLayout] = None,
                  state: SelectorState = SelectorState(),
                  config: SelectorConfig = SelectorConfig(),
                  profile: Optional[ProfileTable] = None,
                  resident_bytes: int = 0) -> tuple[LayoutPlan, SelectorState]:
    """Functional form of ``Selector(...).plan(...)``."""
    return Selector(model, cluster, train_opts, config, profile).plan(
        workload, current=current, state=state, resident_bytes=resident_bytes)
