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
import time
from typing import Optional

from earl_megatron.plan.selector import LayoutOverBudgetError, NoLayoutFitsError
from earl_megatron.plan.split import env_seconds, scored_rates
from earl_megatron.rollout.agent_loop import RolloutAbandoned
from earl_megatron.seeds import episode_seeds, rollout_sample_seed
from earl_megatron.trainer import resume
from earl_megatron.trainer.audit import RunAudit
from earl_megatron.trainer.critic import critic_saver
from earl_megatron.trainer.loop import LoopState, Meeting
from earl_megatron.trainer.model_pair import ModelPair
from earl_megatron.trainer.record import StageTimer, gather_by_sample
from earl_megatron.trainer.stages import reference_logprobs


class Colocated:
    """The colocated placement of ``trainer`` (module docstring)."""

    lag = 0
    trains = True

    def __init__(self, trainer, auto=None):
        self.tr = trainer
        self.auto = auto
        """rollout.placement=auto (trainer/auto.py): re-planned before every stage; None: fixed."""
        self.seg_start = 0
        """The iteration this placement started at (auto re-plans from the one after)."""
        self.audit = RunAudit.from_env(trainer.rank)
        """Tests: what each replica played and trained (trainer/audit.py)."""
        self._last: Optional[tuple] = None
        """(record, lengths) of the last iteration trained here (auto's measured rates)."""
        self._sent = None
        """The episode pool's outcome of the stage just played (audited once kept)."""
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
        ppo = tr.cfg.algorithm.name == "ppo"
        if ppo:   # counted in every plan from the first (trainer/planner.py)
            tr.planner.critic_layout = tr.planner.critic_choice()
        begin = resume.start(tr.cfg, tr.planner, tr.out, tr.world, tr.optimizer, tr.kl_on,
                             any_placement=self.auto is not None)
        self.models = begin.models
        if ppo and not self._critic_after_warm_start(begin.iteration):
            self._add_critic(begin.checkpoint)
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
        if self.auto is not None:
            messages.append(self.describe())
        return begin.iteration, messages

    def _add_critic(self, checkpoint) -> None:
        """ppo: the critic in its layout (trainer/planner.py ``critic_choice``: layout.train, or
        auto's plan, a checkpoint's last when it restored one) beside the policy
        (trainer/critic.py), its weights and Adam state from ``checkpoint``'s critic/ when
        resuming one; each batch then moves it where the planner plans its stages."""
        from earl_megatron.trainer.critic import build_critic, load_critic

        tr, models = self.tr, self.models
        a = tr.cfg.algorithm
        tr.planner.critic_layout = tr.planner.critic_choice()
        # a fresh trunk from the policy: the policy moved into the critic's layout (the
        # switcher, point to point) so each rank copies its own shard (a LoRA policy's merged
        # on it), then back, so the planner starts from the layout it would have
        copy = checkpoint is None and not a.critic.init
        start = models.policy.layout
        policy = models.policy_in(tr.planner.critic_layout if copy else start)
        models.add_critic(build_critic(tr.cfg, policy, tr.planner.critic_layout,
                                       resuming=checkpoint is not None))
        if models.policy.layout != start:
            models.policy_in(start)
            models.critic_in(tr.planner.critic_layout)   # the critic's groups current again
        if checkpoint is not None:
            load_critic(models.critic, checkpoint)

    def _critic_after_warm_start(self, iteration: int) -> bool:
        """ppo on a fresh run with a warm start: the critic's trunk is the warmed policy, so
        it is built after the warm start (``warm_start``), not before; with
        algorithm.critic.init its trunk is that init's either way."""
        cfg = self.tr.cfg
        return iteration == 0 and bool(cfg.sft.steps) and not cfg.algorithm.critic.init

    def warm_start(self) -> bool:
        """The warm start on the world's policy; KL on: the reference is then the warmed
        policy; ppo: the critic is built from it (``_critic_after_warm_start``)."""
        if not self.tr.warm_start(self.models):
            return False
        self._warm_reference()
        if self.tr.cfg.algorithm.name == "ppo" and self.models.critic is None:
            self._add_critic(None)
        return True

    def _warm_reference(self) -> None:
        if self.models.reference is not None:
            ref = self.models.reference_in(self.models.reference.layout)
            self.tr.warmed_reference(ref)

    def moved_in(self) -> None:
        """auto moved the run here: the policy (and reference) built in the plan's rollout
        layout from the checkpoint just written, the episode pool restored on every rank;
        ppo: the critic in its layout for this placement, from the checkpoint's critic/."""
        from earl_megatron.runtime.checkpoint import load_checkpoint
        from earl_megatron.runtime.checkpoint_files import find_checkpoint
        from earl_megatron.trainer.model_pair import build_model_pair

        tr, cfg = self.tr, self.tr.cfg
        found = find_checkpoint(tr.out / "checkpoints")
        state = found.state
        lay = self.auto.plan.rollout.layout
        self.models = build_model_pair(cfg.model, lay, lay if tr.kl_on else None,
                                       optimizer=tr.optimizer, seed=cfg.run.seed,
                                       init=cfg.run.init)
        load_checkpoint(self.models.policy, found.path)
        if cfg.algorithm.name == "ppo":
            self._add_critic(found.path)
        if cfg.sft.steps:
            self._warm_reference()
        tr.planner.restore([], state["last_lengths"], state.get("profile"))
        tr.history[:] = state["history"]
        tr.saved = state["iteration"]
        if state.get("pool") is not None:
            tr.pool.restore(state["pool"])
        self._mark_completed(state["iteration"])

    def describe(self) -> str:
        line = f"colocated placement on {self.tr.world} ranks"
        return line + (f" ({self.auto.plan.reason})" if self.auto is not None else "")

    def begin(self, j: int, evaluate: bool) -> None:
        self.seg_start = j
        if self.auto is not None and self.tr.pool is not None:
            # auto's colocated plan is the synchronous loop (its period: rollout, then train):
            # the pool at bound 0 admits one batch and plays it to the end (a group it restored
            # past that bound is dropped and counted, never trained stale)
            self.tr.pool.k = 0
        if evaluate:
            self.tr.evaluate_into("start", self.models)

    def play(self, j: int):
        """Stage j on every rank; None when told to stop before it."""
        if self.tr.stop.world_should_stop():
            return None
        if self.auto is not None and j > self.seg_start:
            plan = self._replan()
            if not plan.colocated:
                return _Move(plan)
        with self._keeping_trained():
            played = self._play(j)
        if self.auto is not None and self.auto.probing:
            self.auto.probing = False
            plan = self._probe(played)
            if not plan.colocated:       # nothing trained: stage j plays again there
                if self.tr.pool is not None:
                    self.tr.pool.rewind()
                return _Move(plan)
        if self._sent is not None:
            self.audit.sent(self.tr.pool, j, self._sent)
        return played

    def _replan(self):
        """auto, before stage j: rank 0 re-plans from iteration j - 1's measured seconds (the
        stage's decoding apart from its environments' time); every rank takes its plan."""
        auto, proposal = self.auto, None
        if self.tr.rank == 0:
            rec, lengths = self._last if self._last is not None else ({}, [])
            rates = auto.colocated_rates(rec, lengths)
            env = env_seconds(rec.get("seconds", {}).get("rollout", 0.0), rec)
            proposal = auto.replan_or_keep(lambda: auto.propose(lengths, rates, env))
        return self._take(proposal)

    def _probe(self, played):
        """auto, a fresh run's first stage before it trains: rank 0 plans from its rollout
        (decoding apart from the environments' time) and a timed scoring forward over its
        batch (plan/split.py ``scored_rates``); every rank takes the plan. A move now writes
        no checkpoint: nothing has trained."""
        tr, auto, (ids, episodes, metrics) = self.tr, self.auto, played
        t, _, policy = self._stage
        tokens = gather_by_sample(ids, [len(e.token_ids) for e in episodes])
        if not tokens:      # an abandoned stage (the world's view): nothing measured, stay
            return auto.plan
        t0 = time.perf_counter()
        reference_logprobs(policy, policy.layout, ids, {s: e.token_ids for s, e in
                                                        zip(ids, episodes)},
                           tokens, tr.tok.pad_token_id, tr.batch)
        scored, proposal = time.perf_counter() - t0, None
        if tr.rank == 0:
            lengths = [tokens[s] for s in sorted(tokens)]
            stage = t.seconds.get("rollout", 0.0)
            env = env_seconds(stage, metrics)
            wp = auto.planner
            wp.last_lengths = lengths
            proposal = auto.plan     # a stage too short to time: stay
            if stage > 0:
                rates = scored_rates(wp.selector, wp.split_workload(env), stage, scored,
                                     sum(lengths))
                proposal = auto.replan_or_keep(lambda: auto.propose(lengths, rates, env))
        return self._take(proposal)

    def _take(self, proposal):
        plan = self.auto.agree(proposal)
        if plan.colocated:
            self.auto.plan = plan
        return plan

    def _play(self, j: int):
        tr, cfg = self.tr, self.tr.cfg
        plan, t, models = tr.planner, StageTimer(tr.carried), self.models
        ref = models.reference
        with t("plan+switch"):
            carried = tr.pool.begin() if tr.pool is not None else ()
            layouts = {"rollout": plan.plan("rollout", plan.rollout_lengths(carried),
                                            models.policy.layout,
                                            plan.weight_bytes(ref and ref.layout))}
            policy = models.policy_in(layouts["rollout"])
        n, pool_metrics, self._sent = cfg.rollout.episodes_per_iteration, {}, None
        with t("rollout"):
            try:
                if tr.pool is not None:   # asynchronous: episodes carry over
                    out = tr.rollout.play_pool(
                        policy, tr.pool, j, sample_seed=rollout_sample_seed(cfg.run.seed, j),
                        should_stop=tr.stop.replica_should_stop,
                        **({"time_decode": True} if self.auto is not None else {}))
                    ids, episodes, pool_metrics = out.ids, out.episodes, out.metrics
                    self._sent = out    # audited once the stage is kept (``play``)
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
        if isinstance(played, _Move):   # auto: iteration j - 1 saved, stage j plays there
            self.save_completed()
            return Meeting(move=played.plan)
        if tr.stop.world_should_stop():   # every rank, abandoned or not: stop untrained
            if tr.pool is not None:
                tr.pool.rewind()
            return Meeting(stop=True)
        return Meeting(batch=played)

    def train(self, j: int, batch: tuple) -> dict:
        tr = self.tr
        t, layouts, policy = self._stage
        ids, episodes, pool_metrics = batch
        t0 = time.perf_counter()
        with self._keeping_trained():
            rec = tr.score_and_train(j, self.models, policy, layouts, ids, episodes,
                                     pool_metrics, t, sync=True)
        # the batch a replica played is the batch it trained: its leader says so for its block
        self.audit.stage(policy, "train", j, t0, ids=ids, episodes=episodes)
        self._mark_completed(j)
        self._last = (rec, list(tr.planner.last_lengths or []))
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

    def release(self) -> None:
        """auto leaves this placement: its models go before the next one's are built."""
        self.models = None

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
            pool=tr.pool.state() if tr.pool is not None else None),
            also=critic_saver(self.models))   # ppo: the critic under critic/


class _Move:
    """auto's decision before a stage: leave for ``plan``."""

    def __init__(self, plan):
        self.plan = plan
