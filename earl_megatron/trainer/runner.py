"""The trainer: agentic RL with a layout per stage, SPMD (every rank runs the same loop).

    for it in iterations:
        plan ROLLOUT's layout; switch the policy there        (weights + Adam state, in memory)
        play the iteration's episodes                        (per rollout dp replica)
        plan LOGPROB and TRAIN on the episodes just played
        [kl on] the reference scores them in its layout      (dispatched there and back)
        advantages                                           (global stats by all-reduce)
        switch the policy to TRAIN's layout; train           (dispatched point to point)
        record; checkpoint (periodic, last, when stopping); evaluate (periodic)

``iteration`` is that loop body, in one screen; the machinery sits in named objects beside
it: ``StagePlanner`` (trainer/planner.py), ``ModelPair`` (trainer/model_pair.py), the rollout
engine (trainer/rollout.py), the stages (trainer/stages.py, trainer/scoring.py) and the ``Recorder``
(trainer/record.py). Only this module and train.py read ``TrainConfig``; everything below takes
the values it uses.

Old logprobs (``algorithm.old_logprobs``): "rollout" uses the engine's logprobs (equal to the
trainer's within 1e-4 in fp32, tested with both engines); "recompute" re-scores the episodes on
the policy before TRAIN (trainer/old_logprobs.py). SGLang rollouts are always re-scored, to
record rollout_logprob_diff[_max]; epochs > 1 reuse the old logprobs. ``algorithm.off_policy``
weights the advantages by pi_old / pi_rollout (capped, or past the cap dropped) after the
advantage check.

Asynchronous RL (``algorithm.max_staleness`` = k >= 1, trainer/episode_pool.py, docs/async.md):
"play the iteration's episodes" becomes "continue the episodes in flight and start new ones, up
to (k + 1) batches, until one batch of groups has finished"; the rest carry over to the next
iteration's rollout, in whatever layout it plans (with their contexts counted), and the pool is
part of every checkpoint. k = 0 is the synchronous loop above, unchanged (a parity test against
records of the loop before the pool existed).

Split placement (``rollout.placement=split``, trainer/split_loop.py): a rollout pool plays the
next batch while a train pool runs ``score_and_train`` (the loop body after the rollout) on this
one; the pools meet once per iteration.

Where a run starts (the newest complete checkpoint, the warm start's, or fresh) is
trainer/resume.py's; the evaluations (start, every run.eval_every, end) trainer/evaluation.py's.

Stopping (trainer/stop.py: SIGTERM, or the run's stop file, <run>/stop): a rollout or an
evaluation is abandoned at its next turn, a train stage that began is finished; the last
completed iteration is checkpointed with the layout and selector state it ended with (so the
resumed run replays an abandoned iteration exactly), evaluation is skipped, the process exits 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch.distributed as dist

from earl_megatron.config.train import TrainConfig, sglang_kv_tokens, sglang_mem_fraction
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.selector import LayoutOverBudgetError, NoLayoutFitsError
from earl_megatron.rl.advantages import tis_weighted
from earl_megatron.rl.losses import PolicyLossConfig
from earl_megatron.rollout.agent_loop import RolloutAbandoned
from earl_megatron.runtime import groups
from earl_megatron.runtime.build import OptimizerSpec
from earl_megatron.runtime.checkpoint import base_hf_config, save_checkpoint
from earl_megatron.seeds import episode_seeds, rollout_sample_seed
from earl_megatron.trainer import resume
from earl_megatron.trainer.data import episode_tensors
from earl_megatron.trainer.episode_pool import staleness_metrics
from earl_megatron.trainer.evaluation import evaluate
from earl_megatron.trainer.agent_rollout import AgentSpec, agent_metrics
from earl_megatron.trainer.model_pair import ModelPair
from earl_megatron.trainer.old_logprobs import rescore
from earl_megatron.trainer.planner import StagePlanner
from earl_megatron.trainer.record import Recorder, StageTimer, gather_by_sample
from earl_megatron.trainer.rollout import EpisodeSpec
from earl_megatron.trainer.rollout_engines import make_rollout
from earl_megatron.trainer.samples import SampleWriter
from earl_megatron.trainer.scoring import (AdvantageConfig, advantage_check, advantages,
                                           kl_to_reference, owns_samples)
from earl_megatron.trainer.stages import (BatchShape, micro_batch_plan, reference_logprobs,
                                          train_on)
from earl_megatron.trainer.stop import StopControl


def agent_spec(cfg: TrainConfig) -> Optional[AgentSpec]:
    """env.name=agent: the agent programs' spec (trainer/agent_rollout.py); None otherwise."""
    if cfg.env.name != "agent":
        return None
    r = cfg.rollout
    return AgentSpec.from_env_kwargs(dict(cfg.env.kwargs), concurrency=r.agent_concurrency,
                                     timeout_s=r.agent_timeout_s, host=r.agent_host,
                                     port=r.agent_port)


class Trainer:
    def __init__(self, cfg: TrainConfig, tokenizer):
        self.cfg, self.tok = cfg, tokenizer
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.out = Path(cfg.run.output_dir)
        a, r = cfg.algorithm, cfg.rollout
        self.kl_on = a.kl_mode != "off"
        self.batch = BatchShape(a.micro_batch_size, a.micro_batch_tokens)
        self.loss = PolicyLossConfig(clip_eps_low=a.clip_eps, clip_eps_high=a.clip_eps,
                                     kl_coef=a.kl_coef if a.kl_mode == "loss" else 0.0,
                                     entropy_coef=a.entropy_coef)
        self.adv = AdvantageConfig(a.name, a.gamma,
                                   a.group_size, a.kl_coef if a.kl_mode == "reward" else 0.0)
        self.optimizer = OptimizerSpec(lr=a.lr, weight_decay=a.weight_decay,
                                       clip_grad=a.clip_grad,
                                       use_distributed_optimizer=a.use_distributed_optimizer)
        self.planner = self.make_planner(self.planned_world())
        self.rollout = self.make_rollout(r.engine)
        # the trainer re-scores the episodes on the old policy: for recompute, and always for
        # SGLang (the logprob diff proves the servers hold the trainer's weights)
        self.rescore = a.old_logprobs == "recompute" or r.engine == "sglang"
        self.pool = None
        """Asynchronous RL (algorithm.max_staleness >= 1): the episodes in flight between
        rollout stages (trainer/episode_pool.py); None: the synchronous loop."""
        if a.max_staleness:
            from earl_megatron.trainer.episode_pool import EpisodePool
            from earl_megatron.trainer.rollout import loop_config
            self.pool = EpisodePool(cfg.env.name, dict(cfg.env.kwargs), tokenizer,
                                    loop_config(self.rollout.spec, r.temperature, 0),
                                    batch=r.episodes_per_iteration, group_size=a.group_size,
                                    max_staleness=a.max_staleness, run_seed=cfg.run.seed,
                                    env_concurrency=r.env_concurrency)
        self.history: list[dict] = []
        self.stop = StopControl.for_run(self.out)
        self._completed: dict = {}
        """The last completed iteration, its policy layout and selector state: what a
        checkpoint holds when the next iteration is abandoned (``_mark_completed``)."""
        self._saved = -1
        """The iteration of the newest checkpoint this segment wrote or resumed from."""
        self._sft_start, self._sft_history = 0, []
        """The warm start's next step and its records (restored from its checkpoint)."""
        groups.set_group_cache_size(cfg.cluster.group_cache_layouts)
        groups.set_group_timeout(cfg.cluster.group_timeout_s)

    def planned_world(self) -> int:
        """Ranks the stage planner lays out: the world (split placement: the train pool)."""
        return self.world

    def make_rollout(self, engine: str, **pool):
        """The rollout of ``engine`` for this run (trainer/rollout_engines.py); ``pool``: split
        placement's rollout pool (``ranks``, ``ranks_group``: SGLang servers on those ranks)."""
        cfg, a, r = self.cfg, self.cfg.algorithm, self.cfg.rollout
        in_flight = (a.max_staleness + 1) * r.episodes_per_iteration
        # one memory fraction: the servers start with it and the selector plans with it
        frac = sglang_mem_fraction(r.sglang_mem_fraction, r.sglang_device) \
            if engine == "sglang" else None
        context = r.max_context_tokens or cfg.model.max_position_embeddings
        return make_rollout(engine, EpisodeSpec(
            env=cfg.env.name, env_kwargs=dict(cfg.env.kwargs), max_turns=r.max_turns,
            max_context_tokens=context,
            max_action_tokens=r.max_action_tokens, top_p=r.top_p,
            routing_replay=a.routing_replay, prefill_tokens=r.prefill_tokens,
            agent=agent_spec(cfg), env_concurrency=r.env_concurrency), self.tok,
            model=cfg.model,
            python=r.sglang_python, device=r.sglang_device, out_dir=self.out,
            mem_fraction=frac, bucket_mb=r.sglang_bucket_mb, cluster=cfg.cluster,
            kv_tokens=sglang_kv_tokens(r.sglang_device, max(in_flight, cfg.run.eval_episodes),
                                       context), **pool)

    def make_planner(self, world: int, servers_here: bool = True) -> StagePlanner:
        """The stage planner of ``world`` ranks for this run's model, layouts and batch;
        ``servers_here``: SGLang's servers share these ranks' devices (False: split placement's
        train pool, whose devices hold no server)."""
        cfg, a, r = self.cfg, self.cfg.algorithm, self.cfg.rollout
        frac = sglang_mem_fraction(r.sglang_mem_fraction, r.sglang_device) \
            if r.engine == "sglang" and servers_here else None
        return StagePlanner(cfg.model, cfg.layout, cfg.cluster, world,
                            distributed_optimizer=a.use_distributed_optimizer,
                            episodes=r.episodes_per_iteration, batch=self.batch,
                            sglang_mem_fraction=frac, sglang_restart_s=r.sglang_restart_s,
                            prefill_tokens=r.prefill_tokens,
                            in_flight=(a.max_staleness + 1) * r.episodes_per_iteration)

    # ------------------------------------------------------------------ one iteration
    def iteration(self, it: int, models: ModelPair) -> Optional[dict]:
        """One iteration's record; None when told to stop during its rollout (abandoned before
        anything trained)."""
        cfg, plan, t = self.cfg, self.planner, StageTimer()
        ref = models.reference
        with t("plan+switch"):
            carried = self.pool.begin() if self.pool is not None else ()
            layouts = {"rollout": plan.plan("rollout", plan.rollout_lengths(carried),
                                            models.policy.layout,
                                            plan.weight_bytes(ref and ref.layout))}
            policy = models.policy_in(layouts["rollout"])
        n, pool_metrics = cfg.rollout.episodes_per_iteration, {}
        with t("rollout"):
            try:
                if self.pool is not None:   # asynchronous: episodes carry over
                    out = self.rollout.play_pool(
                        policy, self.pool, it, sample_seed=rollout_sample_seed(cfg.run.seed, it),
                        should_stop=self.stop.replica_should_stop)
                    ids, episodes, pool_metrics = out.ids, out.episodes, out.metrics
                else:
                    seeds = episode_seeds(cfg.run.seed, it, n, cfg.algorithm.group_size)
                    ids, episodes = self.rollout.play(
                        policy, seeds, temperature=cfg.rollout.temperature,
                        sample_seed=rollout_sample_seed(cfg.run.seed, it),
                        should_stop=self.stop.replica_should_stop, version=it)
            except RolloutAbandoned:
                ids, episodes = [], []
        self._record_server_starts()
        if self.stop.world_should_stop():  # every rank, abandoned or not: stop untrained
            if self.pool is not None:
                self.pool.rewind()
            return None
        return self.score_and_train(it, models, policy, layouts, ids, episodes, pool_metrics,
                                    t, sync=True)

    def score_and_train(self, it: int, models: ModelPair, policy, layouts: dict, ids: list,
                        episodes: list, pool_metrics: dict, t: StageTimer, *,
                        sync: bool, train_layout: Optional[ParallelLayout] = None) -> dict:
        """The iteration after its rollout: re-score, plan LOGPROB and TRAIN, advantages, train,
        [``sync``: weights to the rollout engine], record. ``policy`` holds the batch (each
        replica its block whole: the rollout layout's rule); split placement's train pool calls
        it with the episodes it received and its pool's layout as ``train_layout`` (checked
        against the budget, not planned: trainer/split_loop.py)."""
        cfg, plan, ref = self.cfg, self.planner, models.reference
        n = cfg.rollout.episodes_per_iteration
        tokens = gather_by_sample(ids, [len(e.token_ids) for e in episodes])
        lengths = [tokens[s] for s in sorted(tokens)]
        engine_metrics, tis = {"rollout_engine": cfg.rollout.engine, **pool_metrics}, {}
        engine_metrics.update(staleness_metrics(owns_samples(policy), episodes, it,
                                                cfg.algorithm.max_staleness))
        if cfg.env.name == "agent":
            engine_metrics.update(agent_metrics(owns_samples(policy), ids, episodes, n))
        # routing replay (MoE): the rollout's experts, replayed in every later forward
        routes = {s: e.routes for s, e in zip(ids, episodes)} \
            if cfg.algorithm.routing_replay else None
        if self.rescore:
            with t("old_logprob"):
                episodes, found, tis = rescore(
                    policy, ids, episodes, tokens, self.tok.pad_token_id, self.batch,
                    temperature=cfg.rollout.temperature,
                    replace=cfg.algorithm.old_logprobs == "recompute",
                    weights=cfg.algorithm.off_policy_weights, routes=routes, version=it)
            engine_metrics.update(found)
        if ref is not None:
            layouts["logprob"] = plan.plan("logprob", lengths, ref.layout,
                                           plan.train_bytes(policy.layout))
        layouts["train"] = plan.plan("train", lengths, policy.layout,
                                     plan.weight_bytes(layouts.get("logprob")),
                                     fixed=train_layout)
        ref_lp, moved_lp, metrics, kl = {}, 0, dict(engine_metrics), None
        if ref is not None:
            with t("logprob"):
                ref_lp, moved_lp = reference_logprobs(
                    models.reference_in(layouts["logprob"]), policy.layout, ids,
                    {s: e.token_ids for s, e in zip(ids, episodes)}, tokens,
                    self.tok.pad_token_id, self.batch, routes=routes)
        train_plan = micro_batch_plan(layouts["train"], tokens, self.batch, cfg.model)
        samples = {s: episode_tensors(e.token_ids, e.loss_mask, e.logprobs, e.reward,
                                      train_plan.length_of[s], self.tok.pad_token_id,
                                      e.turn_rewards, ref_logprobs=ref_lp.get(s))
                   for s, e in zip(ids, episodes)}
        if ref is not None:
            kl, kl_metrics = kl_to_reference(policy, ids, samples,
                                             in_reward=cfg.algorithm.kl_mode == "reward")
            metrics.update(kl_metrics)  # beside the engine's (rollout_engine, logprob diffs)
        adv = advantages(self.adv, policy, ids, samples, n,
                         kl=kl if self.adv.kl_coef else None)
        metrics.update(advantage_check(self.adv, policy, ids, samples, adv, n))
        if tis:  # off-policy weights: w * A trains exactly w * surrogate (rl/advantages.py)
            adv = {s: tis_weighted(adv[s], tis[s]) for s in ids}
        with t("switch"):
            trainee = models.trainee(layouts["train"], plan.recompute["train"])
        with t("train"):
            res = train_on(trainee, policy.layout, ids, samples, adv, train_plan, self.loss,
                           cfg.algorithm.epochs, routes=routes)
        if sync:
            with t("weight_sync"):
                self.rollout.sync(trainee)
            metrics.update(self.rollout.metrics())
        plan.last_lengths = lengths
        metrics.update(loss=res.loss, grad_norm=res.grad_norm, ratio_mean=res.ratio_mean,
                       clip_fraction=res.clip_fraction,
                       dispatch_bytes=res.bytes_received + moved_lp)
        if res.entropy is not None:
            metrics["entropy"] = res.entropy
        self.sample_writer.write(it, ids, episodes)  # rank 0: a few decoded, <run>/samples
        return self.recorder.record(it, layouts, ids, episodes, lengths, t.total(), metrics,
                                    plan)

    # ------------------------------------------------------------------ the run
    def train(self) -> list[dict]:
        cfg = self.cfg
        begin = resume.start(cfg, self.planner, self.out, self.world, self.optimizer, self.kl_on)
        start, models, messages = begin.iteration, begin.models, begin.messages
        self.history.extend(begin.history)
        self._saved, self._sft_start, self._sft_history = (begin.saved, begin.sft_step,
                                                           begin.sft_history)
        if begin.pool and self.pool is not None:
            self.pool.restore(begin.pool)
        elif begin.pool and begin.pool["entries"]:
            messages.append(f"the checkpoint held {len(begin.pool['entries'])} episodes in "
                            "flight; algorithm.max_staleness=0 drops them")
        self._mark_completed(models, start - 1)
        return self.drive(start, messages, lambda: self._run(start, models))

    def drive(self, start: int, messages: list[str], loop) -> list[dict]:
        """Run ``loop()`` from iteration ``start`` inside the live view, with the recorder,
        the sample writer and the stop control in place; the history."""
        from earl_megatron.config.train import config_notes
        from earl_megatron.trainer.live import LiveView

        cfg = self.cfg
        view = LiveView(cfg.run.iterations, start, self.out, enabled=self.rank == 0,
                        tensorboard=cfg.run.tensorboard, live=cfg.run.live_view)
        self.recorder = Recorder(self.out, self.history, view, self.rank)
        self.sample_writer = SampleWriter(self.out, cfg.run.samples_per_iteration, self.tok,
                                          view, enabled=self.rank == 0)
        messages[:0] = config_notes(cfg)  # first: what the configuration chose for the user
        messages += self.recorder.start(start)  # a line when recorded iterations are replayed
        self.stop.install()
        try:
            with view:
                for line in messages:
                    view.message(line)
                if start >= cfg.run.iterations and start:
                    view.message(f"the run is complete ({start} iterations): nothing to do; "
                                 "raise run.iterations to train further")
                    return self.history
                loop()
        finally:
            self.stop.close()
            self.rollout.close()
        return self.history

    def _run(self, start: int, models: ModelPair) -> None:
        cfg = self.cfg
        if start == 0 and cfg.sft.steps and not self._warm_start(models):
            # told to stop during the warm start: it checkpointed itself; resume continues it
            self.stop.mark_stopped(-1)
            return
        if start == 0:
            self._evaluate_into("start", models)
        for it in range(start, cfg.run.iterations):
            if self.stop.world_should_stop():
                break
            try:
                rec = self.iteration(it, models)
            except (NoLayoutFitsError, LayoutOverBudgetError):
                # contexts outgrew the budget: keep what was trained (the error says what
                # would fit; rerun with it to resume here)
                if it > start:
                    self._checkpoint(models, it - 1)
                raise
            if rec is None:
                break  # abandoned: the last completed iteration is saved below
            self._mark_completed(models, it)
            stop = self.stop.world_should_stop()
            last = it == cfg.run.iterations - 1
            every = cfg.run.checkpoint_every
            if stop or last or (every and (it + 1) % every == 0):
                self._checkpoint(models, it)
            if stop:
                break
            if cfg.run.eval_every and (it + 1) % cfg.run.eval_every == 0 and not last:
                self._evaluate_into(f"iter{it + 1}", models)
        if self.stop.stopping:
            done = self._completed["iteration"]
            if done >= 0 and self._saved != done:
                self._checkpoint(models, done)
            self.recorder.view.message(
                f"stopped at a safe point after iteration {done}: checkpoint saved, evaluation "
                "skipped; rerun (or the requeued job) resumes there")
        elif cfg.run.iterations:    # run.iterations=0: the start evaluation is the run
            self._evaluate_into("end", models)
        self.recorder.finish()
        if self.stop.stopping:
            self.stop.mark_stopped(self._completed["iteration"])

    def _evaluate_into(self, when: str, models: ModelPair) -> None:
        res = evaluate(self.cfg, self.rollout, self.stop, models, self._record_server_starts)
        if res is not None:  # None: told to stop meanwhile, nothing recorded
            self.recorder.evaluation(when, res)

    def _record_server_starts(self) -> None:
        """Measured server (re)starts since the last call into the planner's profile table."""
        for tp, seconds in self.rollout.take_starts():
            self.planner.record_start(tp, seconds)

    def _mark_completed(self, models: ModelPair, it: int) -> None:
        self._completed = {"iteration": it, "layout": models.policy.layout,
                           "selector": self.planner.state}

    def _warm_start(self, models: ModelPair) -> bool:
        """The supervised phase before RL (trainer/warm_start.py); False: told to stop."""
        from earl_megatron.trainer.warm_start import TraceSource, WarmStart

        cfg = self.cfg
        warm = WarmStart(cfg.sft, TraceSource(cfg.env.name, dict(cfg.env.kwargs), cfg.run.seed),
                         self.tok, batch=self.batch, rl_lr=cfg.algorithm.lr,
                         max_tokens=cfg.model.max_position_embeddings, out=self.out,
                         checkpoint_every=cfg.run.checkpoint_every, rank=self.rank,
                         log=self.recorder.view.message, start_step=self._sft_start,
                         history=self._sft_history, keep_last=cfg.run.keep_last)
        return warm.run(models, self.planner, self.stop.world_should_stop)

    def _checkpoint(self, models: ModelPair, it: int) -> None:
        """Checkpoint iteration ``it``, the last completed one. The loop state records the
        layout and selector state that iteration ended with (``_mark_completed``), even when the
        policy has moved on into an abandoned iteration (its weights have not: nothing trained);
        the weights save from whatever layout they are in (checkpoints load under any)."""
        done = self._completed
        assert done["iteration"] == it, (done["iteration"], it)
        policy = models.policy_in(models.policy.layout)
        ref = models.reference
        state = {"iteration": it, "layout": str(done["layout"]), "world_size": self.world,
                 "history": self.history, "last_lengths": self.planner.last_lengths,
                 "ref_layout": str(ref.layout) if ref is not None else None,
                 "selector": self.planner.state_json(done["selector"]),
                 "profile": self.planner.profile_json(),
                 "pool": self.pool.state() if self.pool is not None else None}
        save_checkpoint(policy, self.out / "checkpoints", it, state,
                        keep_last=self.cfg.run.keep_last, tokenizer=self.tok,
                        hf_config=base_hf_config(self.cfg.run.init))
        self._saved = it

