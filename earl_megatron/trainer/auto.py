"""``rollout.placement=auto``: the selector picks the placement, colocated or a split of the world,
and re-picks it at every safe point from what the run measures. ``rollout.placement=split`` with
``layout.mode=auto`` is the same over splits only: the selector lays out both pools, and sizes
them unless ``rollout.pool_ranks`` does.

The candidates are plan/split.py's: colocated (every rank plays, then trains: ``rollout_ranks``
0) and every split whose two pools have a fitting layout; the least predicted period wins,
each side's prediction scaled by what the placement that ran measured (``MeasuredRates``), kept
where it is unless another is faster by the selector's hysteresis with the move counted.

    start          nothing measured yet: colocated when it is a candidate and fits (a split's
                   train pool would wait through the first rollout anyway, and the model alone
                   cannot tell a workload whose environments wait, which a split overlaps, from
                   one whose train step dominates); else rank 0 plans from the checkpoint's
                   lengths (or the first prompt budget); every rank takes its plan, or its error
    probe 0        a fresh run's colocated stage 0, before it trains: rank 0 plans from its
                   rollout seconds and a timed scoring forward over its batch
                   (plan/split.py ``scored_rates``); a move now writes no checkpoint (nothing
                   has trained) and stage 0 plays again in the new placement
    colocated j    before stage j, rank 0 re-plans from iteration j - 1's rollout and train
                   seconds; every rank takes the plan (trainer/colocated.py)
    split j        before meeting j, rank 0 re-plans from step j - 1 and stage j - 1
                   (trainer/split.py); the meeting carries the plan
    a move         the untrained stage is rewound, iteration j - 1 checkpointed (the weights,
                   the optimizer and the episode pool: one writer for every placement), and
                   every rank builds its side of the new placement from that checkpoint
                   (dist_checkpointing reshards the train state); stage j plays there. Its
                   seconds (the checkpoint, the build, a rewound stage) are in iteration j's
                   record as "move", and the last one measured is a floor under the model's
                   move cost, which a re-plan spreads over the iterations left

SGLang servers (``rollout.engine=sglang``): the world's planner prices them beside the policy
(colocated) or alone on a split's rollout pool, and a move's restart of them on other ranks
(plan/split.py ``move_seconds``). A move stops the old placement's servers (their process
groups killed) before the new placement is built; the new one's start on its rollout ranks and
take the checkpoint's policy from its weight source (split: the first handoff; colocated:
pushed before its first stage). tests/sglang/test_sglang_moves.py.

A colocated plan runs the synchronous colocated loop, the episode pool's bound at 0 (what the
plan's period models: the rollout, then the training); a split runs at the run's
``algorithm.max_staleness``. The world's stage planner (cp = 1: split's train pool holds each replica's episodes whole, and
decoding never uses cp) is the plan's, and the colocated placement's own planner.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch.distributed as dist

from earl_megatron.config.train import ConfigError
from earl_megatron.plan.split import MeasuredRates, SplitDoesNotFitError, SplitPlan, plan_split
from earl_megatron.runtime.checkpoint_files import find_checkpoint
from earl_megatron.trainer.audit import RunAudit


class Auto:
    """The auto placement's plan and planner, shared by the placements it moves between."""

    def __init__(self, trainer, *, rollout_ranks: Optional[int] = None, colocated: bool = True):
        self.tr = trainer
        self.rollout_ranks = rollout_ranks
        """A fixed rollout pool's size (split placement with auto layouts and
        rollout.pool_ranks); None: the selector's count."""
        self.colocated = colocated
        """Colocated is a candidate (placement=auto); False: splits only (placement=split)."""
        wp = trainer.planner
        wp.selector = replace(wp.selector, config=replace(wp.selector.config, max_cp=1))
        self.planner = wp
        """The world's stage planner (the colocated placement's, the split plan's)."""
        self.plan: Optional[SplitPlan] = None
        """The placement in force and why."""
        self.handoff = None
        """Split's handoff group, made once (trainer/handoff.py)."""
        self.moved_s = 0.0
        """The last move's measured seconds (trainer/loop.py): a floor under the model's."""
        self.probing = False
        """The colocated first stage re-plans before it trains (``first``)."""

    def propose(self, lengths: list[int], rates: Optional[MeasuredRates],
                env_seconds: float = 0.0) -> SplitPlan:
        """Rank 0: the placement for batches of ``lengths`` tokens under the measured ``rates``
        (the rollout's ``env_seconds``, which more ranks do not shorten, apart)."""
        wp = self.planner
        wp.last_lengths = list(lengths)
        if rates is None and self.plan is None and self.colocated and \
                self.rollout_ranks is None:
            # nothing measured yet: colocated first, when it fits (the first stage measures)
            try:
                plan = plan_split(wp.selector, wp.split_workload(0.0), rollout_ranks=0)
            except SplitDoesNotFitError:
                pass
            else:
                return replace(plan, reason=f"colocated first: nothing measured yet "
                               f"({plan.describe()}); the first stage measures")
        return plan_split(wp.selector, wp.split_workload(env_seconds), rates=rates,
                          current=self.plan, colocated=self.colocated,
                          rollout_ranks=self.rollout_ranks, moved_s=self.moved_s,
                          horizon=max(1, self.tr.cfg.run.iterations - self.tr.saved - 1))

    def first(self):
        """The placement to start in: rank 0 plans from the newest checkpoint's lengths, every
        rank takes its plan (or the error: nothing fits)."""
        tr = self.tr
        found = find_checkpoint(tr.out / "checkpoints") if tr.cfg.run.resume else None
        got: list = [None]
        if tr.rank == 0:
            try:
                got[0] = self.propose(found.state["last_lengths"] if found else [], None)
            except SplitDoesNotFitError as e:
                got[0] = ConfigError(
                    f"rollout.placement=auto on {tr.world} ranks: {e}. Fix: more ranks, a "
                    "larger layout.memory_budget_gb, or shorter contexts "
                    "(rollout.max_context_tokens)")
        dist.broadcast_object_list(got, src=0)
        if isinstance(got[0], Exception):
            raise got[0]
        # a fresh run that starts colocated re-plans after its first rollout, before anything
        # trains: a move then writes no checkpoint (trainer/colocated.py ``_probe``). A warm
        # start has trained (its weights would not move), a resumed run too.
        self.probing = got[0].colocated and self.colocated and found is None and \
            not tr.cfg.sft.steps
        return self.placement_for(got[0])

    def agree(self, proposal: Optional[SplitPlan]) -> SplitPlan:
        """Every rank takes rank 0's ``proposal`` (a collective)."""
        got = [proposal]
        dist.broadcast_object_list(got, src=0)
        return got[0]

    def placement_for(self, plan: SplitPlan):
        """The placement that runs ``plan`` (not started: ``start`` or ``moved_in`` next).
        Colocated with SGLang: servers on the world, fed the policy on their ranks (a split
        makes each side's engine itself, trainer/split_sides.py)."""
        from earl_megatron.trainer.colocated import Colocated
        from earl_megatron.trainer.split import Split

        self.plan = plan
        if plan.colocated:
            self.tr.planner = self.planner
            if self.tr.cfg.rollout.engine == "sglang":
                self.tr.rollout.close()
                self.tr.rollout = self.tr.make_rollout("sglang", weights="local")
            return Colocated(self.tr, auto=self)
        return Split(self.tr, auto=self)

    def move(self, old, plan: SplitPlan):
        """Leave placement ``old`` for the one of ``plan`` (another split, or colocated), built
        from the checkpoint just written; a line in the live view says so.

        SGLang: the old placement's servers stop first (their process groups killed before
        the new placement builds anything), then the new one's start on its rollout ranks,
        started by the move (the records' ``rollout_server_starts`` say so) and fed the
        checkpoint's policy by the new weight source: a split's at its first handoff
        (``HandoffWeights``), colocated's here, before its first stage (``LocalWeights``)."""
        tr = self.tr
        line = old.describe().split(" (")[0]
        j = tr.saved + 1                     # the stage that plays again in the new placement
        audit, servers = RunAudit.from_env(tr.rank), self._servers()
        stopped = tr.rollout.server_pids() if servers else []
        old.release()
        if servers:
            tr.rollout.close()               # this rank's servers of the old placement stop
            audit.stopped(j, stopped)
        new = self.placement_for(plan)
        new.moved_in()
        why = f"moved from {line} to {new.describe().split(' (')[0]}"
        if self._servers():
            tr.rollout.started_by(why)
            if plan.colocated:   # the checkpoint's policy into fresh servers, checked
                tr.rollout.start_servers(new.models.policy)
                audit.served(tr.rollout, new.models.policy, j)
        tr.recorder.view.message(f"moved from {line} to {new.describe()}")
        return new

    def _servers(self) -> bool:
        """This rank drives SGLang servers (colocated: every rank; split: the rollout pool)."""
        from earl_megatron.trainer.sglang_rollout import SGLangRollout

        return isinstance(self.tr.rollout, SGLangRollout)

    def replan_or_keep(self, propose) -> SplitPlan:
        """Rank 0: ``propose()``, or the plan in force when nothing else fits (said in a
        line)."""
        try:
            return propose()
        except SplitDoesNotFitError as e:
            self.tr.recorder.view.message(f"auto kept its placement: no other fits ({e})")
            return self.plan

    def colocated_rates(self, record: dict, lengths: list[int]) -> Optional[MeasuredRates]:
        """What a colocated iteration measured: its rollout stage's seconds and its scoring
        and training seconds, over the batch's tokens."""
        sec = record.get("seconds", {})
        rollout = sec.get("rollout", 0.0)
        train = sum(sec.get(k, 0.0) for k in ("old_logprob", "logprob", "switch", "train"))
        if not lengths or rollout <= 0 or train <= 0:
            return None
        return MeasuredRates(0, rollout, sum(lengths), train, sum(lengths))
