"""The trainer: agentic RL with a layout per stage, SPMD (every rank runs the same loop).

    for it in iterations:
        plan ROLLOUT's layout; switch the policy there        (weights + Adam state, in memory)
        play the iteration's episodes                        (per rollout dp replica)
        plan LOGPROB and TRAIN on the episodes just played
        [kl on] the reference scores them in its layout      (dispatched there and back)
        advantages                                           (global stats by all-reduce)
        switch the policy to TRAIN's layout; train           (dispatched point to point)
        record; checkpoint (periodic, last, on SIGTERM); evaluate (periodic)

``iteration`` is that loop body, in one screen; the machinery sits in named objects beside
it: ``StagePlanner`` (trainer/planner.py), ``Models`` (trainer/models.py), the rollout engine
(trainer/rollout.py), the stages (trainer/stages.py, trainer/scoring.py) and the ``Recorder``
(trainer/record.py). Only this module and train.py read ``TrainConfig``; everything below takes
the values it uses.

Old logprobs (``algorithm.old_logprobs``): "rollout" uses the engine's logprobs (equal to the
trainer's within 1e-4 in fp32, tested with both engines); "recompute" re-scores the episodes on
the policy before TRAIN (trainer/old_logprobs.py). SGLang rollouts are always re-scored, to
record rollout_logprob_diff[_max]; PPO epochs > 1 reuse the old logprobs.

Resume: the newest checkpoint under run.output_dir restores weights, optimizer, selector state
and history; iteration i's seeds depend only on (run.seed, i), so the resumed run replays the
same iterations as one that never stopped.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from earl_megatron.config.train import ConfigError, TrainConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.selector import LayoutOverBudgetError, NoLayoutFitsError
from earl_megatron.rl.losses import PolicyLossConfig
from earl_megatron.runtime import groups
from earl_megatron.runtime.build import OptimizerSpec
from earl_megatron.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from earl_megatron.trainer.data import episode_tensors
from earl_megatron.trainer.models import Models, build_models
from earl_megatron.trainer.old_logprobs import rescore
from earl_megatron.trainer.planner import StagePlanner
from earl_megatron.trainer.record import Recorder, StageTimer, gather_by_sample
from earl_megatron.trainer.rollout import EpisodeSpec, episode_seeds, make_rollout
from earl_megatron.trainer.scoring import (AdvantageConfig, advantage_check, advantages,
                                           kl_to_reference)
from earl_megatron.trainer.stages import (BatchShape, micro_batch_plan, reference_logprobs,
                                          train_on)


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
        self.adv = AdvantageConfig("grpo" if a.name == "grpo" else "reinforce_pp", a.gamma,
                                   a.group_size, a.kl_coef if a.kl_mode == "reward" else 0.0)
        self.optimizer = OptimizerSpec(lr=a.lr, weight_decay=a.weight_decay,
                                       clip_grad=a.clip_grad,
                                       use_distributed_optimizer=a.use_distributed_optimizer)
        self.planner = StagePlanner(cfg.model, cfg.layout, cfg.cluster, self.world,
                                    distributed_optimizer=a.use_distributed_optimizer,
                                    episodes=r.episodes_per_iteration, batch=self.batch,
                                    rollout_max_pp=1 if r.engine == "sglang" else None)
        self.rollout = make_rollout(r.engine, EpisodeSpec(
            env=cfg.env.name, env_kwargs=dict(cfg.env.kwargs), max_turns=r.max_turns,
            max_context_tokens=r.max_context_tokens or cfg.model.max_position_embeddings,
            max_action_tokens=r.max_action_tokens, top_p=r.top_p), tokenizer, model=cfg.model,
            python=r.sglang_python, device=r.sglang_device, out_dir=self.out)
        # the trainer re-scores the episodes on the old policy: for recompute, and always for
        # SGLang (the logprob diff proves the servers hold the trainer's weights)
        self.rescore = a.old_logprobs == "recompute" or r.engine == "sglang"
        self.history: list[dict] = []
        self.stop_requested = False
        groups.set_group_cache_size(cfg.cluster.group_cache_layouts)

    # ------------------------------------------------------------------ one iteration
    def iteration(self, it: int, models: Models) -> dict:
        cfg, plan, t = self.cfg, self.planner, StageTimer()
        ref = models.reference
        with t("plan+switch"):
            layouts = {"rollout": plan.plan("rollout", plan.rollout_lengths(),
                                            models.policy.layout,
                                            plan.weight_bytes(ref and ref.layout))}
            policy = models.policy_in(layouts["rollout"])
        with t("rollout"):
            seeds = episode_seeds(cfg.run.seed, it, cfg.rollout.episodes_per_iteration,
                                  cfg.algorithm.group_size)
            ids, episodes = self.rollout.play(policy, seeds,
                                              temperature=cfg.rollout.temperature,
                                              sample_seed=cfg.run.seed * 7919 + it)
        tokens = gather_by_sample(ids, [len(e.token_ids) for e in episodes])
        lengths = [tokens[s] for s in sorted(tokens)]
        engine_metrics = {"rollout_engine": cfg.rollout.engine}
        if self.rescore:
            with t("old_logprob"):
                episodes, found = rescore(policy, ids, episodes, tokens, self.tok.pad_token_id,
                                          self.batch, temperature=cfg.rollout.temperature,
                                          replace=cfg.algorithm.old_logprobs == "recompute")
            engine_metrics.update(found)
        if ref is not None:
            layouts["logprob"] = plan.plan("logprob", lengths, ref.layout,
                                           plan.train_bytes(policy.layout))
        layouts["train"] = plan.plan("train", lengths, policy.layout,
                                     plan.weight_bytes(layouts.get("logprob")))
        ref_lp, moved_lp, metrics, kl = {}, 0, dict(engine_metrics), None
        if ref is not None:
            with t("logprob"):
                ref_lp, moved_lp = reference_logprobs(
                    models.reference_in(layouts["logprob"]), policy.layout, ids,
                    {s: e.token_ids for s, e in zip(ids, episodes)}, tokens,
                    self.tok.pad_token_id, self.batch)
        train_plan = micro_batch_plan(layouts["train"], tokens, self.batch)
        samples = {s: episode_tensors(e.token_ids, e.loss_mask, e.logprobs, e.reward,
                                      train_plan.length_of[s], self.tok.pad_token_id,
                                      e.turn_rewards, ref_logprobs=ref_lp.get(s))
                   for s, e in zip(ids, episodes)}
        if ref is not None:
            kl, metrics = kl_to_reference(policy, ids, samples,
                                          in_reward=cfg.algorithm.kl_mode == "reward")
        adv = advantages(self.adv, policy, ids, samples, len(seeds),
                         kl=kl if self.adv.kl_coef else None)
        with t("switch"):
            trainee = models.policy_in(layouts["train"])
        with t("train"):
            res = train_on(trainee, policy.layout, ids, samples, adv, train_plan, self.loss,
                           cfg.algorithm.epochs)
        with t("weight_sync"):
            self.rollout.sync(trainee)
        metrics.update(self.rollout.metrics())
        plan.last_lengths = lengths
        metrics.update(loss=res.loss, grad_norm=res.grad_norm,
                       dispatch_bytes=res.bytes_received + moved_lp,
                       **advantage_check(self.adv, policy, ids, samples, adv, len(seeds)))
        if res.entropy is not None:
            metrics["entropy"] = res.entropy
        return self.recorder.record(it, layouts, ids, episodes, lengths, t.total(), metrics,
                                    plan)

    # ------------------------------------------------------------------ the run
    def train(self) -> list[dict]:
        from earl_megatron.trainer.live import LiveView

        cfg = self.cfg
        start, models, messages = self._start()
        view = LiveView(cfg.run.iterations, start, self.out, enabled=self.rank == 0,
                        tensorboard=cfg.run.tensorboard, live=cfg.run.live_view)
        self.recorder = Recorder(self.out, self.history, view, self.rank)
        self.recorder.start()
        signal.signal(signal.SIGTERM, self._on_sigterm)
        evals: dict = {}
        with view:
            for line in messages:
                view.message(line)
            if start == 0:
                evals["start"] = self.evaluate(models)
            for it in range(start, cfg.run.iterations):
                try:
                    self.iteration(it, models)
                except (NoLayoutFitsError, LayoutOverBudgetError):
                    # contexts outgrew the budget: keep what was trained (the error says what
                    # would fit; rerun with it to resume here)
                    if it > start:
                        self._checkpoint(models, it - 1)
                    raise
                stop = self._agree_stop()
                last = it == cfg.run.iterations - 1
                every = cfg.run.checkpoint_every
                if stop or last or (every and (it + 1) % every == 0):
                    self._checkpoint(models, it)
                if stop:
                    break
                if cfg.run.eval_every and (it + 1) % cfg.run.eval_every == 0 and not last:
                    evals[f"iter{it + 1}"] = self.evaluate(models)
            if not self.stop_requested:
                evals["end"] = self.evaluate(models)
            self.recorder.finish(evals)
        self.rollout.close()
        return self.history

    def _start(self) -> tuple[int, Models, list[str]]:
        """(first iteration, models, messages): from the newest checkpoint, or fresh."""
        cfg = self.cfg
        ckpt = latest_checkpoint(self.out / "checkpoints") if cfg.run.resume else None
        if ckpt is not None:
            state = json.loads((ckpt / "loop.json").read_text())
            lay = self._parse(state["layout"])
            ref_lay = self._parse(state["ref_layout"] or state["layout"]) if self.kl_on else None
            models = build_models(cfg.model, lay, ref_lay, optimizer=self.optimizer,
                                  seed=cfg.run.seed, init=cfg.run.init)
            load_checkpoint(models.policy, ckpt)
            self.history.extend(state["history"])
            self.planner.restore(state.get("selector"), state["last_lengths"])
            return state["iteration"] + 1, models, [
                f"resumed from {ckpt} at iteration {state['iteration'] + 1}"]
        if cfg.run.init:
            from earl_megatron.weights.convert import read_model_config
            found = read_model_config(cfg.run.init)
            if found != cfg.model:
                raise ConfigError(f"run.init={cfg.run.init} holds {found}, but the model config "
                                  f"is {cfg.model}; pick the matching model= recipe")
        first = self.planner.plan("rollout", self.planner.rollout_lengths(), None)
        return 0, build_models(cfg.model, first, first if self.kl_on else None,
                               optimizer=self.optimizer, seed=cfg.run.seed,
                               init=cfg.run.init), []

    def _parse(self, text: str) -> ParallelLayout:
        return ParallelLayout.parse(text, world_size=self.world, model=self.cfg.model.shape)

    def evaluate(self, models: Models) -> dict:
        """Win rate per eval opponent on held-out seeds, greedy and sampled (all ranks call it).
        "sampled" plays the stochastic policy at the rollout temperature (what training
        optimises); "greedy" plays its argmax."""
        cfg = self.cfg
        lay = models.policy.layout
        # the engine decodes with cp=1: spend the cp ranks on dp for the evaluation
        policy = models.policy_in(ParallelLayout(tp=lay.tp, pp=lay.pp, dp=lay.dp * lay.cp))
        seeds = [10**9 + cfg.run.seed * 100_003 + i for i in range(cfg.run.eval_episodes)]
        out = {}
        for opp in cfg.env.eval_opponents:
            for mode, temp in (("greedy", 0.0), ("sampled", cfg.rollout.temperature)):
                ids, eps = self.rollout.play(policy, seeds, temperature=temp, sample_seed=424242,
                                             opponent=opp)
                by_id = gather_by_sample(ids, [(e.info.get("outcome"), e.reward) for e in eps])
                out[f"{opp}/{mode}"] = {
                    "win_rate": sum(o == "win" for o, _ in by_id.values()) / len(by_id),
                    "mean_reward": sum(r for _, r in by_id.values()) / len(by_id)}
        return out

    def _checkpoint(self, models: Models, it: int) -> None:
        policy = models.policy_in(models.policy.layout)
        ref = models.reference
        state = {"iteration": it, "layout": str(policy.layout), "history": self.history,
                 "last_lengths": self.planner.last_lengths,
                 "ref_layout": str(ref.layout) if ref is not None else None,
                 "selector": self.planner.state_json()}
        save_checkpoint(policy, self.out / "checkpoints", it, state)

    def _agree_stop(self) -> bool:
        # ranks may see SIGTERM at different moments: agree before any collective save
        flag = torch.tensor([int(self.stop_requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.stop_requested = bool(flag.item())
        return self.stop_requested

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_requested = True  # finish the iteration, checkpoint, exit (Slurm preemption)

