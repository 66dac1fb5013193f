"""The layout selector: the fastest layout that fits, per stage, with the cost of switching counted.

For one stage's workload::

    valid layouts (enumerate_layouts)  --memory model-->  fitting: total <= budget * (1 - margin)
        --time model x profile factor + switch cost from the live layout-->  ranked candidates
        --hysteresis against last iteration's choice for this stage-->  LayoutPlan

Recompute (TRAIN, ``SelectorConfig.auto_recompute``): every (layout, recompute mode) pair is a
candidate, none / selective / full with their own memory (plan/activations.py) and time (one
more forward under full, the attention core under selective: time_model.py), except a mode
that saves no memory over a cheaper one (selective over flash attention); the least cost that
fits wins, none on ties. A mode change alone costs nothing to switch (Megatron-Core reads
the mode at forward time: runtime/recompute.py); the reason names the chosen mode against the
others on the same layout.

Switch cost (plan/switch_cost.py): the bytes each rank receives in the reshard plan the
switcher runs (plan/reshard_plan.py, ``receive_bytes``: what the rank owns in the new layout and
did not hold in the old one) for the weights and, for TRAIN, the optimizer state (which lives in
the TRAIN layout), over the slowest link a reshard may use, plus the fixed regroup time. When
ROLLOUT
runs on inference servers (``ClusterSpec.decode_engine.servers``: SGLang), a ROLLOUT layout
whose (tp, dp) differs from the servers' (the last ROLLOUT choice) also pays their restart and a
weight push (plan/server_restart.py: measured restart seconds per (model, tp) from the profile
table, else ``SelectorConfig.server_restart_s``); such layouts are tp x dp only, and fit only if
the servers' static KV pool holds one sequence.

Hysteresis: the previous choice for the stage is kept unless the best candidate's cost is lower
by more than ``hysteresis`` (a fraction), so a workload that oscillates around a boundary does not
flap. The state is a frozen ``SelectorState`` passed in and returned; nothing is mutated.

Invariants (tested): a plan's layout is valid for the world size and model; its predicted memory
is at most budget x (1 - margin); equal inputs give equal plans (ties break by cost, then recompute
none < selective < full, then memory, then layout order); ``NoLayoutFitsError`` lists only
suggestions it has checked fit (plan/what_fits.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout, enumerate_layouts
from earl_megatron.plan.memory_model import MemoryEstimate, memory_breakdown, server_pool_fits
from earl_megatron.plan.profile_table import ProfileTable
from earl_megatron.plan.server_restart import server_switch_seconds
from earl_megatron.plan.specs import (ClusterSpec, Recompute, Stage, StageWorkload, TrainOptions,
                                     human_bytes)
from earl_megatron.plan.switch_cost import switch_seconds  # noqa: F401 - re-exported
from earl_megatron.plan.time_model import StageTime, stage_time
from earl_megatron.plan.what_fits import (  # noqa: F401 - re-exported
    LayoutOverBudgetError, NoLayoutFitsError, suggestions)

RECOMPUTE_ORDER = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
"""Cheapest first in time, largest first in memory: ties go to the earlier mode."""


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
    rollout_max_ep: Optional[int] = None
    """Cap on ep for ROLLOUT (None: none). 1 for agent programs on the embedded engine: replicas
    with ep > 1 decode in lockstep, which agent programs' own timing cannot follow."""
    rollout_cp: bool = False
    """Allow cp > 1 for ROLLOUT. Off: Megatron-Core's inference engines and SGLang do not split
    a KV cache by sequence position."""
    server_restart_s: float = 60.0
    """Seconds a restart of the rollout servers costs (decode engine ``servers``) until the
    profile table holds a measurement for the (model, tp) (plan/server_restart.py)."""
    auto_recompute: bool = False
    """TRAIN: choose the recompute mode with the layout, the (layout, mode) pair of least cost
    that fits (none on ties); False: every layout with ``TrainOptions.recompute``."""

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
    recompute: Recompute = Recompute.NONE
    """The TRAIN stage's activation recomputation this candidate was priced with."""

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

    @property
    def recompute(self) -> Recompute:
        return self.chosen.recompute


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
        if stage is Stage.ROLLOUT and c.rollout_max_ep is not None:
            layouts = [lay for lay in layouts if lay.ep <= c.rollout_max_ep]
        return layouts

    def recompute_modes(self, stage: Stage) -> tuple[Recompute, ...]:
        """The modes a ``stage`` plan weighs: all three for TRAIN under ``auto_recompute``."""
        if stage is Stage.TRAIN and self.config.auto_recompute:
            return RECOMPUTE_ORDER
        return (self.train_opts.recompute,)

    def _opts(self, recompute: Optional[Recompute]) -> TrainOptions:
        return self.train_opts if recompute in (None, self.train_opts.recompute) \
            else self.train_opts.with_(recompute=recompute)

    def memory(self, layout: ParallelLayout, workload: StageWorkload,
               resident_bytes: int = 0, recompute: Optional[Recompute] = None) -> MemoryEstimate:
        return memory_breakdown(self.model, layout, workload, self._opts(recompute),
                                cluster=self.cluster, resident_bytes=resident_bytes)

    def fits(self, estimate: MemoryEstimate) -> bool:
        """Within the budget (and, on servers, their static pool holds one sequence)."""
        return estimate.total <= self.budget_bytes and server_pool_fits(estimate, self.cluster)

    def evaluate(self, layout: ParallelLayout, workload: StageWorkload, *,
                 current: Optional[ParallelLayout] = None, state: SelectorState = SelectorState(),
                 resident_bytes: int = 0, recompute: Optional[Recompute] = None) -> Candidate:
        """Memory, time, profile factor and switch cost of one layout (fitting or not), with
        ``recompute`` (None: ``train_opts.recompute``)."""
        opts = self._opts(recompute)
        t = stage_time(self.model, layout, workload, self.cluster, opts)
        scale = 1.0
        if self.profile is not None:
            def analytic_for(lay):
                return lambda ctx, ld: stage_time(self.model, lay, _profile_workload(
                    workload, ctx, ld), self.cluster, opts).total
            scale = self.profile.scale_factor(workload.stage, layout, workload.contexts[-1][0],
                                              _load(workload), analytic_for)
        opt_src = state.previous(Stage.TRAIN) if workload.stage is Stage.TRAIN else None
        sw = switch_seconds(self.model, self.cluster, current, layout, self.train_opts,
                            optimizer_src=opt_src)
        if workload.stage is Stage.ROLLOUT and self.cluster.decode_engine.servers:
            sw += server_switch_seconds(self.model, self.cluster, state.previous(Stage.ROLLOUT),
                                        layout, self.profile, self.config.server_restart_s,
                                        self.train_opts)
        return Candidate(layout, self.memory(layout, workload, resident_bytes, opts.recompute), t,
                         scale, sw, opts.recompute)

    def plan(self, workload: StageWorkload, *, current: Optional[ParallelLayout] = None,
             state: SelectorState = SelectorState(),
             resident_bytes: int = 0) -> tuple[LayoutPlan, SelectorState]:
        """Choose the layout for ``workload``; return the plan and the next state.

        ``current``: the live layout (the previous stage's), from which switching is costed."""
        valid = self.valid_layouts(workload.stage)
        budget = self.budget_bytes
        fitting, oom, smallest = [], [], None
        for lay in valid:
            fit_any, saved_from = False, None
            for rc in self.recompute_modes(workload.stage):
                mem = self.memory(lay, workload, resident_bytes, rc)
                if saved_from is not None and mem.total >= saved_from:
                    continue    # saves nothing over a cheaper mode (selective over flash)
                saved_from = mem.total
                if self.fits(mem):
                    fit_any = True
                    fitting.append(self.evaluate(lay, workload, current=current, state=state,
                                                 resident_bytes=resident_bytes, recompute=rc))
                elif smallest is None or mem.total < smallest.total:
                    smallest = mem
            if not fit_any:
                oom.append(lay)
        if not fitting:
            raise NoLayoutFitsError(workload.stage, budget, smallest,
                                    suggestions(self, workload, resident_bytes))
        ranked = sorted(fitting, key=lambda c: (c.cost, RECOMPUTE_ORDER.index(c.recompute),
                                                c.memory.total, c.layout))
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
            what = "(layout, recompute) pairs" if self.config.auto_recompute and \
                workload.stage is Stage.TRAIN else "layouts"
            reason = (f"{best.layout}: last layout {prev} no longer fits; fastest of "
                      f"{len(ranked)}" if gone else
                      f"{best.layout}: fastest of {len(ranked)} fitting {what}")
            if runner_up is not None:
                reason += (f" ({best.cost:.3g} s vs {runner_up.cost:.3g} s for "
                           f"{_name(runner_up, self)})")
        reason += f"; {human_bytes(chosen.memory.total)} of {human_bytes(budget)}"
        if len(self.recompute_modes(workload.stage)) > 1:
            reason += "; " + self._recompute_reason(chosen, workload, resident_bytes)
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

    def _recompute_reason(self, chosen: Candidate, workload: StageWorkload,
                          resident_bytes: int) -> str:
        """The chosen recompute mode against the other modes on the same layout."""
        others = []
        for rc in RECOMPUTE_ORDER:
            if rc is chosen.recompute:
                continue
            mem = self.memory(chosen.layout, workload, resident_bytes, rc)
            if not self.fits(mem):
                others.append(f"{rc.value} needs {human_bytes(mem.total)}, over the budget")
            else:
                t = stage_time(self.model, chosen.layout, workload, self.cluster,
                               self._opts(rc)).total * chosen.scale
                others.append(f"{rc.value} {t:.3g} s at {human_bytes(mem.total)}")
        return (f"recompute={chosen.recompute.value} ({chosen.predicted_seconds:.3g} s; "
                + "; ".join(others) + ")")

    # -------------------------------------------------------------- what would fit
    def fits_somewhere(self, workload: StageWorkload, resident_bytes: int = 0) -> \
            Optional[MemoryEstimate]:
        """The smallest-memory fitting estimate (over the recompute modes weighed), or None."""
        best = None
        for lay in self.valid_layouts(workload.stage):
            for rc in self.recompute_modes(workload.stage):
                mem = self.memory(lay, workload, resident_bytes, rc)
                if self.fits(mem) and (best is None or mem.total < best.total):
                    best = mem
        return best


def _name(candidate: Candidate, selector: Selector) -> str:
    """A candidate's layout, with its recompute mode when the selector weighs several."""
    if len(selector.recompute_modes(Stage.TRAIN)) > 1 and candidate.memory.stage is Stage.TRAIN:
        return f"{candidate.layout} recompute={candidate.recompute.value}"
    return str(candidate.layout)
