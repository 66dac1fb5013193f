"""The trainer: what every placement shares, and ``score_and_train``, the iteration after its
rollout.

    score_and_train(j, batch):
        [re-score]  old logprobs on the policy (recompute; always with SGLang)
        plan LOGPROB and TRAIN on the episodes just played
        [kl on] the reference scores them in its layout      (dispatched there and back)
        advantages                                           (global stats by all-reduce)
        switch the policy to TRAIN's layout; train           (dispatched point to point)
        [ppo] VALUES before the advantages (GAE), the critic's train step after TRAIN
        [colocated] the trained weights to the rollout engine; record

The loop around it is trainer/loop.py's, one for every placement (trainer/colocated.py,
trainer/split.py); the machinery sits in named objects beside it: ``StagePlanner``
(trainer/planner.py), ``ModelPair`` (trainer/model_pair.py), the rollout engine
(trainer/rollout.py), the stages (trainer/stages.py, trainer/scoring.py) and the ``Recorder``
(trainer/record.py). Only the trainer's modules and train.py read ``TrainConfig``; everything
below takes the values it uses.

Old logprobs (``algorithm.old_logprobs``): "rollout" uses the engine's logprobs (equal to the
trainer's within 1e-4 in fp32, tested with both engines); "recompute" re-scores the episodes on
the policy before TRAIN (trainer/old_logprobs.py). SGLang rollouts are always re-scored, to
record rollout_logprob_diff[_max]; epochs > 1 reuse the old logprobs. ``algorithm.off_policy``
weights the advantages by pi_old / pi_rollout (capped, or past the cap dropped) after the
advantage check.

Asynchronous RL (``algorithm.max_staleness`` = k >= 1, trainer/episode_pool.py, docs/async.md):
the rollout stage continues the episodes in flight and starts new ones, up to (k + 1) batches,
until one batch of groups has finished; the rest carry over to the next stage, and the pool is
part of every checkpoint. k = 0 is the synchronous loop (a parity test against records of the
loop before the pool existed).

Where a run starts (the newest complete checkpoint, the warm start's, or fresh) is
trainer/resume.py's (split: trainer/split.py's); the evaluations (start, every run.eval_every,
end) trainer/evaluation.py's.

Stopping (trainer/stop.py: SIGTERM, or the run's stop file, <run>/stop): a rollout or an
evaluation is abandoned at its next turn, a train stage that began is finished; the last
completed iteration is checkpointed with the layout and selector state it ended with (so the
resumed run replays an abandoned iteration exactly), evaluation is skipped, the process exits 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch.distributed as dist

from earl_megatron.config.train import (LayoutConfig, TrainConfig, sglang_kv_tokens,
                                        sglang_mem_fraction)
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.rl.advantages import tis_weighted
from earl_megatron.rl.losses import PolicyLossConfig
from earl_megatron.runtime import groups
from earl_megatron.runtime.build import OptimizerSpec
from earl_megatron.runtime.checkpoint import base_hf_config, save_checkpoint
from earl_megatron.weights.peft_import import model_dir
from earl_megatron.trainer.data import episode_tensors
from earl_megatron.trainer.episode_pool import staleness_metrics
from earl_megatron.trainer.evaluation import evaluate
from earl_megatron.trainer.agent_rollout import agent_metrics, agent_programs_on_moe, agent_spec
from earl_megatron.trainer.model_pair import ModelPair
from earl_megatron.trainer.old_logprobs import rescore
from earl_megatron.trainer.planner import StagePlanner
from earl_megatron.trainer.record import Recorder, StageTimer, gather_by_sample
from earl_megatron.trainer.rollout import EpisodeSpec
from earl_megatron.trainer.rollout_engines import make_rollout
from earl_megatron.trainer.samples import SampleWriter
from earl_megatron.trainer.scoring import (AdvantageConfig, advantage_check, advantages,
                                           kl_to_reference, loss_weights, overlong_filtered,
                                           overlong_metrics, owns_samples, shaped_overlong)
from earl_megatron.trainer.stages import (BatchShape, micro_batch_plan, reference_logprobs,
                                          train_on)
from earl_megatron.trainer.auto import Auto
from earl_megatron.trainer.colocated import Colocated
from earl_megatron.trainer.critic import critic_scores, critic_step
from earl_megatron.trainer.split import Split
from earl_megatron.trainer.stop import StopControl


class Trainer:
    def __init__(self, cfg: TrainConfig, tokenizer):
        self.cfg, self.tok = cfg, tokenizer
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.out = Path(cfg.run.output_dir)
        a, r = cfg.algorithm, cfg.rollout
        self.kl_on = a.kl_mode != "off"
        self.batch = BatchShape(a.micro_batch_size, a.micro_batch_tokens)
        self.loss = PolicyLossConfig(clip_eps_low=a.clip_low, clip_eps_high=a.clip_high,
                                     kl_coef=a.kl_coef if a.kl_mode == "loss" else 0.0,
                                     entropy_coef=a.entropy_coef, ratio_cap=a.dual_clip,
                                     kind=a.policy_loss,
                                     kl_estimator=a.kl_estimator if a.kl_mode == "loss"
                                     else "k3")
        self.adv = AdvantageConfig(a.name, a.gamma, a.group_size,
                                   a.kl_coef if a.kl_mode == "reward" else 0.0, a.norm_by_std)
        self.loss_agg_tokens = a.loss_agg_tokens or r.max_turns * r.max_action_tokens
        """seq_mean_token_sum_norm's constant (algorithm.loss_agg_tokens, or the most policy
        tokens an episode can sample)."""
        self.optimizer = OptimizerSpec(lr=a.lr, weight_decay=a.weight_decay,
                                       clip_grad=a.clip_grad,
                                       use_distributed_optimizer=a.use_distributed_optimizer)
        groups.set_group_cache_size(cfg.cluster.group_cache_layouts)
        groups.set_group_timeout(cfg.cluster.group_timeout_s)
        self.history: list[dict] = []
        self.carried: dict[str, float] = {}
        """Seconds the next record counts before its iteration starts (auto's move): its timer's."""
        self.stop = StopControl.for_run(self.out)
        self.saved = -1
        """The iteration of the newest checkpoint this segment wrote or resumed from."""
        self.sft_start, self.sft_history = 0, []
        """The warm start's next step and its records (restored from its checkpoint)."""
        colocated = r.placement == "colocated"
        planned = r.placement == "auto" or (r.placement == "split" and
                                             cfg.layout.mode == "auto")
        self.placement = Colocated(self) if colocated else None if planned else Split(self)
        """Who plays, who trains, where they meet (trainer/loop.py); planned by the selector
        (auto, or split with auto layouts): its first plan's, made at the start."""
        # planned: the world's planner prices SGLang's servers for colocated and every split
        self.planner = self.make_planner(self.placement.planned_world() if self.placement
                                         else self.world, servers_here=colocated or planned)
        self.auto = None
        """The selector's placement plan (trainer/auto.py): auto weighs colocated and every
        split; split with auto layouts lays out its pools (rollout.pool_ranks of them, or the
        selector's count)."""
        if r.placement == "auto":
            self.auto = Auto(self)
        elif planned:
            self.auto = Auto(self, rollout_ranks=r.pool_ranks, colocated=False)
        # split placement: each side's engine is the placement's (SGLang on the rollout pool)
        self.rollout = self.make_rollout(r.engine if colocated else "embedded")
        # the trainer re-scores the episodes on the old policy: for recompute, and always for
        # SGLang (the logprob diff proves the servers hold the trainer's weights)
        self.rescore = a.old_logprobs == "recompute" or r.engine == "sglang"
        self.pool = None
        """Asynchronous RL (algorithm.max_staleness >= 1): the episodes in flight between
        rollout stages (trainer/episode_pool.py); None: the synchronous loop."""
        if a.max_staleness or a.dynamic_sampling:   # dynamic sampling: the pool at k = 0 too
            from earl_megatron.trainer.agent_pool import AgentPool
            from earl_megatron.trainer.episode_pool import EpisodePool
            from earl_megatron.trainer.rollout import loop_config
            pool_class = AgentPool if cfg.env.name == "agent" else EpisodePool
            self.pool = pool_class(cfg.env.name, dict(cfg.env.kwargs), tokenizer,
                                   loop_config(self.rollout.spec, r.temperature, 0),
                                   batch=r.episodes_per_iteration, group_size=a.group_size,
                                   max_staleness=a.max_staleness, run_seed=cfg.run.seed,
                                   env_concurrency=r.env_concurrency,
                                   **({"dynamic_rounds": a.dynamic_sampling_rounds}
                                      if a.dynamic_sampling else {}))

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

    def make_planner(self, world: int, servers_here: bool = True,
                     layout: Optional[LayoutConfig] = None) -> StagePlanner:
        """The stage planner of ``world`` ranks for this run's model, layouts (``layout``: other
        than the config's) and batch; ``servers_here``: SGLang's servers share these ranks'
        devices (False: split placement's train pool, whose devices hold no server)."""
        cfg, a, r = self.cfg, self.cfg.algorithm, self.cfg.rollout
        frac = sglang_mem_fraction(r.sglang_mem_fraction, r.sglang_device) \
            if r.engine == "sglang" and servers_here else None
        return StagePlanner(cfg.model, layout or cfg.layout, cfg.cluster, world,
                            distributed_optimizer=a.use_distributed_optimizer,
                            episodes=r.episodes_per_iteration, batch=self.batch,
                            sglang_mem_fraction=frac, sglang_restart_s=r.sglang_restart_s,
                            prefill_tokens=r.prefill_tokens,
                            in_flight=(a.max_staleness + 1) * r.episodes_per_iteration,
                            rollout_max_ep=1 if agent_programs_on_moe(cfg) else None,
                            critic=a.name == "ppo")

    # ------------------------------------------------------------------ one iteration
    def score_and_train(self, it: int, models: ModelPair, policy, layouts: dict, ids: list,
                        episodes: list, pool_metrics: dict, t: StageTimer, *,
                        sync: bool, train_layout: Optional[ParallelLayout] = None,
                        logprob_layout: Optional[ParallelLayout] = None) -> dict:
        """The iteration after its rollout: re-score, plan LOGPROB and TRAIN, advantages, train,
        [``sync``: weights to the rollout engine], record. ``policy`` holds the batch (each
        replica its block whole: the rollout layout's rule); split placement's train pool calls
        it with the episodes it received and its pool's layouts as ``train_layout`` and
        ``logprob_layout`` (default: the train one; checked against the budget, not planned:
        trainer/split.py)."""
        cfg, plan, ref = self.cfg, self.planner, models.reference
        n = cfg.rollout.episodes_per_iteration
        if pool_metrics.get("dynamic_groups_trained") == 0:   # the same on every rank
            return self.recorder.skipped(it, layouts, t.total(), pool_metrics,
                                         "dynamic sampling kept no group with signal")
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
                                           plan.train_bytes(policy.layout),
                                           fixed=logprob_layout or train_layout)
        layouts["train"] = plan.plan("train", lengths, policy.layout,
                                     plan.weight_bytes(layouts.get("logprob")),
                                     fixed=train_layout)
        a = cfg.algorithm
        episodes, penalties = shaped_overlong(episodes, cfg.rollout.max_context_tokens,
                                              a.overlong_buffer, a.overlong_penalty)
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
            kl, kl_metrics = kl_to_reference(policy, ids, samples, a.kl_estimator)
            metrics.update(kl_metrics)  # beside the engine's (rollout_engine, logprob diffs)
        if models.critic is not None:   # ppo: GAE on the critic's values (trainer/critic.py)
            adv, ppo = critic_scores(self, models, policy, layouts, ids, episodes, tokens,
                                     samples, kl, t, metrics)
        else:
            adv, ppo = advantages(self.adv, policy, ids, samples, n,
                                  kl=kl if self.adv.kl_coef else None), None
        metrics.update(advantage_check(self.adv, policy, ids, samples, adv, n))
        if tis:  # off-policy weights: w * A trains exactly w * surrogate (rl/advantages.py)
            adv = {s: tis_weighted(adv[s], tis[s]) for s in ids}
        cut = []
        if a.overlong_filter:   # after the group statistics: truncated episodes train nothing
            samples, cut = overlong_filtered(samples, ids, episodes)
        if a.overlong_filter or a.overlong_buffer:
            metrics.update(overlong_metrics(policy, ids, cut, penalties, n))
        weights = loss_weights(a.loss_agg, policy, ids, samples, self.loss_agg_tokens)
        res = None   # ppo's critic warm-up (algorithm.critic.warmup): the policy waits
        if it >= a.critic.warmup:
            with t("switch"):
                trainee = models.trainee(layouts["train"], plan.recompute["train"])
            with t("train"):
                res = train_on(trainee, policy.layout, ids, samples, adv, train_plan, self.loss,
                               cfg.algorithm.epochs, routes=routes, weights=weights)
        if ppo is not None:   # timed as "critic_train"
            metrics.update(critic_step(self, models, policy, ids, samples, ppo, tokens, t))
        if sync and res is not None:
            with t("weight_sync"):
                self.rollout.sync(trainee)
            metrics.update(self.rollout.metrics())
        plan.last_lengths = lengths
        if res is not None:
            metrics.update(loss=res.loss, grad_norm=res.grad_norm, ratio_mean=res.ratio_mean,
                           clip_fraction=res.clip_fraction,
                           dispatch_bytes=res.bytes_received + moved_lp,
                           **({"entropy": res.entropy} if res.entropy is not None else {}))
        if t.peaks:   # a GPU: each stage's peak device memory beside the predicted
            metrics["measured_memory_gb"] = t.peaks_gb()
        self.sample_writer.write(it, ids, episodes,  # a few decoded, <run>/samples
                                 (policy.coords.dp, policy.layout.dp, owns_samples(policy)))
        return self.recorder.record(it, layouts, ids, episodes, lengths, t.total(), metrics,
                                    plan)

    # ------------------------------------------------------------------ the run
    def train(self) -> list[dict]:
        """The run under this config's placement (trainer/loop.py); the history."""
        from earl_megatron.trainer.loop import run_loop

        if self.auto is not None:
            self.placement = self.auto.first()
        start, messages = self.placement.start()
        return self.drive(start, messages, lambda: run_loop(self, self.placement, start))

    def drive(self, start: int, messages: list[str], loop) -> list[dict]:
        """Run ``loop()`` from iteration ``start`` inside the live view, with the recorder,
        the sample writer and the stop control in place; the history."""
        from earl_megatron.config.train import config_notes
        from earl_megatron.trackers import Trackers
        from earl_megatron.trainer.live import LiveView

        cfg = self.cfg
        view = LiveView(cfg.run.iterations, start, enabled=self.rank == 0,
                        live=cfg.run.live_view)
        trackers = Trackers(cfg.run.loggers, self.out, start, enabled=self.rank == 0,
                            say=view.message)   # run.loggers, rank 0
        self.recorder = Recorder(self.out, self.history, view, self.rank, trackers)
        self.sample_writer = SampleWriter(self.out, cfg.run.samples_per_iteration, self.tok,
                                          view, enabled=self.rank == 0,
                                          all_replicas=cfg.run.samples_all_replicas)
        messages[:0] = config_notes(cfg)  # first: what the configuration chose for the user
        messages += self.recorder.start(start)  # a line when recorded iterations are replayed
        self.stop.install()
        try:
            with view, trackers.started(cfg.to_dict()):
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

    def evaluate_into(self, when: str, models: ModelPair) -> None:
        view = self.recorder.view   # rank 0's replica's episodes (trainer/evaluation.py)
        res = evaluate(self.cfg, self.rollout, self.stop, models, self.record_server_starts,
                       lambda what, done, total: view.progress(f"evaluation {when}", done,
                                                               total, "episodes", what))
        if res is not None:  # None: told to stop meanwhile, nothing recorded
            self.recorder.evaluation(when, res)

    def record_server_starts(self) -> None:
        """Measured server (re)starts since the last call into the planner's profile table."""
        for tp, seconds in self.rollout.take_starts():
            self.planner.record_start(tp, seconds)

    def warm_start(self, models: ModelPair, planner: Optional[StagePlanner] = None) -> bool:
        """The supervised phase before RL (trainer/warm_start.py) on ``models`` (the world's
        policy), laid out by ``planner`` (default: the trainer's); False: told to stop."""
        from earl_megatron.trainer.warm_start import TraceSource, WarmStart

        cfg = self.cfg
        warm = WarmStart(cfg.sft, TraceSource(cfg.env.name, dict(cfg.env.kwargs), cfg.run.seed),
                         self.tok, batch=self.batch, rl_lr=cfg.algorithm.lr,
                         max_tokens=cfg.model.max_position_embeddings, out=self.out,
                         checkpoint_every=cfg.run.checkpoint_every, rank=self.rank,
                         log=self.recorder.view.message, start_step=self.sft_start,
                         history=self.sft_history, keep_last=cfg.run.keep_last,
                         progress=lambda done, total: self.recorder.view.progress(
                             "warm start", done, total, "steps"))
        return warm.run(models, planner or self.planner, self.stop.world_should_stop)

    def warmed_reference(self, reference) -> None:
        """KL after a warm start: the reference becomes the warmed policy (trainer/warm_start.py
        ``load_warmed``). Collective: ``reference`` None on a rank that holds none."""
        from earl_megatron.trainer.warm_start import load_warmed
        load_warmed(self.out, self.cfg.sft.steps, reference)

    def checkpoint_due(self, done: int, stop: bool) -> bool:
        """Whether iteration ``done`` is checkpointed at its safe point: a stop, the last
        iteration, or every ``run.checkpoint_every``; never twice."""
        every = self.cfg.run.checkpoint_every
        due = stop or done == self.cfg.run.iterations - 1 or bool(every and
                                                                 (done + 1) % every == 0)
        return due and self.saved != done

    def write_checkpoint(self, model, state, also=None) -> None:
        """The one checkpoint writer: ``model`` (None on a rank that holds no trained weights)
        and the loop state (trainer/loop.py ``LoopState``), atomically, with retention;
        ``also(directory)`` writes more before it is published (ppo: the critic)."""
        save_checkpoint(model, self.out / "checkpoints", state.iteration, state.to_json(),
                        keep_last=self.cfg.run.keep_last, tokenizer=self.tok,
                        hf_config=base_hf_config(model_dir(self.cfg.run.init)), also=also)
        self.saved = state.iteration
