"""Colocated placement (``rollout.placement=colocated``, the default): every rank plays, then
every rank trains, each stage in the layout the selector plans for it.

    play j      plan ROLLOUT's layout; switch the policy there (weights + Adam state, in memory);
                play stage j (k = 0: the iteration's episodes; k >= 1: continue the episodes in
                flight and start new ones until one batch of groups has finished)
    meet j      the world agrees whether to stop (an untrained stage is abandoned, its episode
                pool rewound)
    train j     score_and_train (trainer/runner.py) in the policy's rollout layout, then the
                trained weights to the rollout engine (local: the engine reads the policy)
    after j     the world agrees whether to stop; checkpoint when due (periodic, the last, a stop)

The loop is trainer/loop.py's. A checkpoint records the layout and selector state the last
completed iteration ended with (``_mark_completed``), even when the policy has moved on into an
abandoned iteration (its weights have not: nothing trained), so the resumed run replays the
abandoned iteration exactly.
"""

from __future__ import annotations

import contextlib
from typing import Optional

from earl_megatron.plan.selector import LayoutOverBudgetError, NoLayoutFitsError
from earl_megatron.rollout.agent_loop import RolloutAbandoned
from earl_megatron.seeds import episode_seeds, rollout_sample_seed
from earl_megatron.trainer import resume
from earl_megatron.trainer.loop import LoopState, Meeting
from earl_megatron.trainer.model_pair import ModelPair
from earl_megatron.trainer.record import StageTimer


class Colocated:
    """The colocated placement of ``trainer`` (module docstring)."""

    lag = 0
    trains = True

    def __init__(self, trainer):
        self.tr = trainer
        self.models: Optional[ModelPair] = None
        self._completed: dict = {}
        """The last completed iteration, its policy layout and selector state."""
        self._stage: Optional[tuple] = None
        """(timer, layouts, policy) of the stage just played, for its train step."""

    def planned_world(self) -> int:
        """Ranks the stage planner lays out: the world."""
        return self.tr.world

    def start(self) -> tuple[int, list[str]]:
        tr = self.tr
        begin = resume.start(tr.cfg, tr.planner, tr.out, tr.world, tr.optimizer, tr.kl_on)
        self.models = begin.models
        tr.history.extend(begin.history)
        tr.saved, tr.sft_start, tr.sft_history = begin.saved, begin.sft_step, begin.sft_history
        messages = begin.messages
        if begin.pool and tr.pool is not None:
            tr.pool.restore(begin.pool)
        elif begin.pool and begin.pool["entries"]:
            messages.append(f"the checkpoint held {len(begin.pool['entries'])} episodes in "
                            "flight; algorithm.max_staleness=0 drops them")
        self._mark_completed(begin.iteration - 1)
        if begin.iteration > 0 and tr.cfg.sft.steps:   # an RL checkpoint: warmed before it
            self._warm_reference()
        return begin.iteration, messages

    def warm_start(self) -> bool:
        """The warm start on the world's policy; KL on: the reference is then the warmed
        policy."""
        if not self.tr.warm_start(self.models):
            return False
        self._warm_reference()
        return True

    def _warm_reference(self) -> None:
        if self.models.reference is not None:
            ref = self.models.reference_in(self.models.reference.layout)
            self.tr.warmed_reference(ref)

    def begin(self, j: int, evaluate: bool) -> None:
        if evaluate:
            self.tr.evaluate_into("start", self.models)

    def play(self, j: int):
        """Stage j on every rank; None when told to stop before it."""
        if self.tr.stop.world_should_stop():
            return None
        with self._keeping_trained():
            return self._play(j)

    def _play(self, j: int):
        tr, cfg = self.tr, self.tr.cfg
        plan, t, models = tr.planner, StageTimer(), self.models
        ref = models.reference
        with t("plan+switch"):
            carried = tr.pool.begin() if tr.pool is not None else ()
            layouts = {"rollout": plan.plan("rollout", plan.rollout_lengths(carried),
                                            models.policy.layout,
                                            plan.weight_bytes(ref and ref.layout))}
            policy = models.policy_in(layouts["rollout"])
        n, pool_metrics = cfg.rollout.episodes_per_iteration, {}
        with t("rollout"):
            try:
                if tr.pool is not None:   # asynchronous: episodes carry over
                    out = tr.rollout.play_pool(
                        policy, tr.pool, j, sample_seed=rollout_sample_seed(cfg.run.seed, j),
                        should_stop=tr.stop.replica_should_stop)
                    ids, episodes, pool_metrics = out.ids, out.episodes, out.metrics
                else:
                    seeds = episode_seeds(cfg.run.seed, j, n, cfg.algorithm.group_size)
                    ids, episodes = tr.rollout.play(
                        policy, seeds, temperature=cfg.rollout.temperature,
                        sample_seed=rollout_sample_seed(cfg.run.seed, j),
                        should_stop=tr.stop.replica_should_stop, version=j)
            except RolloutAbandoned:
                ids, episodes = [], []
        tr.record_server_starts()
        self._stage = (t, layouts, policy)
        return ids, episodes, pool_metrics

    def meet(self, j: int, played) -> Meeting:
        tr = self.tr
        if played is None:
            return Meeting(stop=True)
        if tr.stop.world_should_stop():   # every rank, abandoned or not: stop untrained
            if tr.pool is not None:
                tr.pool.rewind()
            return Meeting(stop=True)
        return Meeting(batch=played)

    def train(self, j: int, batch: tuple) -> dict:
        tr = self.tr
        t, layouts, policy = self._stage
        ids, episodes, pool_metrics = batch
        with self._keeping_trained():
            rec = tr.score_and_train(j, self.models, policy, layouts, ids, episodes,
                                     pool_metrics, t, sync=True)
        self._mark_completed(j)
        return rec

    @contextlib.contextmanager
    def _keeping_trained(self):
        """Contexts outgrew the budget (a stage's plan found no layout): keep what was trained
        (the error says what would fit; rerun with it to resume here)."""
        try:
            yield
        except (NoLayoutFitsError, LayoutOverBudgetError):
            self.save_completed()
            raise

    def after_train(self, j: int) -> bool:
        tr = self.tr
        stop = tr.stop.world_should_stop()
        if tr.checkpoint_due(j, stop):
            self._checkpoint(j)
        return stop

    def move(self, plan) -> None:
        raise AssertionError("colocated placement never moves")

    def save_completed(self) -> None:
        done = self._completed["iteration"]
        if done >= 0 and self.tr.saved != done:
            self._checkpoint(done)

    def _mark_completed(self, it: int) -> None:
        self._completed = {"iteration": it, "layout": self.models.policy.layout,
                           "selector": self.tr.planner.state}

    def _checkpoint(self, it: int) -> None:
        """Checkpoint iteration ``it``, the last completed one, with the layout and selector
        state it ended with; the weights save from whatever layout they are in (checkpoints
        load under any)."""
        tr, done = self.tr, self._completed
        assert done["iteration"] == it, (done["iteration"], it)
        policy = self.models.policy_in(self.models.policy.layout)
        ref = self.models.reference
        tr.write_checkpoint(policy, LoopState(
            iteration=it, layout=str(done["layout"]), world_size=tr.world,
            history=tr.history, last_lengths=tr.planner.last_lengths,
            ref_layout=str(ref.layout) if ref is not None else None,
            selector=tr.planner.state_json(done["selector"]),
            profile=tr.planner.profile_json(),
            pool=tr.pool.state() if tr.pool is not None else None))
