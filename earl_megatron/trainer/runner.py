"""Runner: the trainer's state across iterations (model, selector state, history, checkpoints).

Reads as the loop it runs::

    for it in iterations:
        layouts = plan(it)                       # selector or static, per stage
        mol = switch(mol, layouts.rollout)       # weights + optimizer state, in memory
        episodes = play(...)                     # per dp replica, KV-cached Megatron engine
        plan layouts.logprob, layouts.train      # at the boundary, on the episodes just played
        ref = switch(ref, layouts.logprob)       # kl on: the frozen reference model, weights only
        ref_logprobs = reference_logprobs(...)   # dispatched there and back, point to point
        advantages = compute_advantages(...)     # all-reduce over owners (kl_mode=reward: - k1)
        mol = switch(mol, layouts.train)
        loss = train_on(...)                     # dispatch point to point, Megatron schedule
        record, checkpoint (periodic, on SIGTERM)

Two models, each usable only while its layout's process groups are current (a Megatron model
keeps the groups it was built under, and reads parallel_state's globals while it runs):
``_live`` says whose are. runtime/groups caches the groups of recently used layouts, so when
the policy comes back after the reference scored (or the reference after the policy), it is
re-activated in place (``groups.activate``) if its layout is still cached, and otherwise
switched to the same layout (a rebuild under fresh groups: local copies only). With kl off
there is only the policy and nothing changes.

Memory: the reference shard stays resident while the policy rolls out and trains, and the
policy's weights, grads and Adam state stay resident while the reference scores: each stage is
planned (auto) or checked (static) with the other model's bytes as ``resident_bytes``.

The reference policy is the initial one (the seed's init, or run.init), frozen. It is NOT
checkpointed: it is rebuilt on resume from (run.seed | run.init), which gives the same weights
in any layout (build_on_layout seeds Megatron's init in a forked RNG from run.seed; run.init is
read again, so it must still exist), in the layout the checkpoint recorded for it.

Resume: the newest checkpoint under run.output_dir restores weights, optimizer, selector state
and history; iteration i's seeds depend only on (run.seed, i), so the resumed run replays the
same iterations.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from earl_megatron.config.train import ConfigError, TrainConfig
from earl_megatron.envs.tool_env import tool_metrics
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.runtime.build import build_on_layout
from earl_megatron.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from earl_megatron.trainer import loop
from earl_megatron.trainer.data import episode_tensors


def _tool_row(e) -> Optional[tuple]:
    """An episode's (correct, tool calls, tool error, unparsable, turns) for tool_metrics; None
    for environments without tools (no "tool_calls" in their info)."""
    if "tool_calls" not in e.info:
        return None
    return (bool(e.info.get("correct")), int(e.info["tool_calls"]),
            bool(e.info.get("tool_error")), bool(e.info.get("unparsable")), e.turns)


class Runner:
    def __init__(self, cfg: TrainConfig, tokenizer):
        self.cfg = cfg
        self.tok = tokenizer
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.out = Path(cfg.run.output_dir)
        self.history: list[dict] = []
        self.selector_state = None
        self.last_lengths: list[int] = []
        self._stop = False
        self.view = None
        self._pending: list[str] = []
        self.auto = cfg.layout.mode == "auto"
        # the memory model serves both modes: choosing (auto), checking a static layout (static)
        self._selector = self._make_selector()
        self.predicted_memory: dict[str, int] = {}
        self.reasons: dict[str, str] = {}
        self.ref = None
        """The reference policy (ModelOnLayout without optimizer) when kl_mode is not off."""
        self._live = "policy"
        """Whose process groups are live: "policy" or "ref" (see the module docstring)."""
        self._sft_start, self._sft_history = 0, []
        """The warm start's next step and its records (resumed from its checkpoint)."""
        from earl_megatron.runtime import groups
        groups.set_group_cache_size(cfg.cluster.group_cache_layouts)

    # ------------------------------------------------------------------ planning
    def _make_selector(self):
        from earl_megatron.plan.selector import Selector, SelectorConfig
        from earl_megatron.plan.specs import ClusterSpec, GiB, TrainOptions

        c, lc = self.cfg.cluster, self.cfg.layout
        if c.preset == "cpu":
            budget = int((lc.memory_budget_gb or 2.0) * GiB)
            cluster = ClusterSpec.cpu(ranks=self.world, memory_budget_bytes=budget)
        elif c.preset == "h100":
            cluster = ClusterSpec.h100_80gb(nodes=c.nodes, inter_node_gbps=c.inter_node_gbps)
            if lc.memory_budget_gb:
                cluster = cluster.with_(device_memory_bytes=int(lc.memory_budget_gb * GiB))
        else:
            raise ConfigError(f"cluster.preset={c.preset!r}: use cpu or h100")
        opts = TrainOptions(distributed_optimizer=self.cfg.algorithm.use_distributed_optimizer)
        self._train_opts = opts
        return Selector(self.cfg.model, cluster, opts,
                        SelectorConfig(memory_margin=lc.memory_margin, hysteresis=lc.hysteresis,
                                       max_tp=lc.max_tp, max_cp=lc.max_cp, max_pp=lc.max_pp))

    def plan_stage(self, stage: str, lengths: list[int], current: Optional[ParallelLayout],
                   resident_bytes: int = 0) -> ParallelLayout:
        """The layout of ``stage`` at its boundary, for episodes of ``lengths`` tokens.

        auto: the selector's choice (switching from ``current`` is costed; NoLayoutFitsError
        when nothing fits). static: the config's layout, checked against the same memory model
        and budget first (LayoutOverBudgetError instead of an out-of-memory crash mid-stage).
        ``resident_bytes``: what the other model (reference or policy) keeps on each rank
        meanwhile.
        """
        from earl_megatron.plan.selector import LayoutOverBudgetError, SelectorState

        wl = self._workload(stage, lengths)
        if not self.auto:
            lay = ParallelLayout.parse(self.cfg.layout.static(stage), world_size=self.world,
                                       model=self.cfg.model.shape)
            mem = self._selector.memory(lay, wl, resident_bytes)
            if mem.total > self._selector.budget_bytes:
                raise LayoutOverBudgetError(mem, self._selector.budget_bytes, max(lengths))
            self.predicted_memory[stage] = mem.total
            return lay
        plan, self.selector_state = self._selector.plan(
            wl, current=current, state=self.selector_state or SelectorState(),
            resident_bytes=resident_bytes)
        self.predicted_memory[stage] = plan.predicted_memory_bytes
        self.reasons[stage] = plan.reason
        return plan.layout

    def _workload(self, stage: str, lengths: list[int]):
        from earl_megatron.plan.specs import Stage, StageWorkload

        a = self.cfg.algorithm
        if stage == "rollout":
            return StageWorkload.of(Stage.ROLLOUT, lengths,
                                    responses_in_flight=self.cfg.rollout.episodes_per_iteration)
        longest = max(lengths)
        tokens = a.micro_batch_size * longest
        if a.micro_batch_tokens:  # length-grouped micro-batches: a long sample trains alone
            tokens = max(longest, min(a.micro_batch_tokens, tokens))
        return StageWorkload.of(Stage(stage), lengths, micro_batch_tokens=tokens)

    def _ref_bytes(self, layout: Optional[ParallelLayout]) -> int:
        """Per rank (most loaded pp_stage): the reference's weights in ``layout`` (0: no ref)."""
        from earl_megatron.plan.memory_model import param_count_per_rank

        if self.ref is None or layout is None:
            return 0
        return max(param_count_per_rank(self.cfg.model, layout, r) for r in range(layout.pp)) \
            * self._train_opts.param_bytes(self.cfg.model)

    def _policy_bytes(self, layout: ParallelLayout) -> int:
        """Per rank: the policy's weights, grads and Adam state in ``layout`` (resident during
        LOGPROB)."""
        from earl_megatron.plan.memory_model import param_count_per_rank, train_state_bytes

        weights = max(param_count_per_rank(self.cfg.model, layout, r) for r in range(layout.pp)) \
            * self._train_opts.param_bytes(self.cfg.model)
        return weights + train_state_bytes(self.cfg.model, layout, self._train_opts)

    def _predicted_lengths(self) -> list[int]:
        """Rollout plans on the last iteration's episode lengths (the first: the prompt budget)."""
        return self.last_lengths or [128] * self.cfg.rollout.episodes_per_iteration

    # ------------------------------------------------------------------ the loop
    def train(self) -> list[dict]:
        cfg = self.cfg
        start, mol = self._start()
        if self.rank == 0:
            # metrics.jsonl restarts from what the checkpoint knows: lines of iterations after it
            # (a run killed between its metrics line and its checkpoint) or of an earlier run
            # (run.resume=false) are dropped, so the file never repeats an iteration
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "metrics.jsonl").write_text(
                "".join(json.dumps(h) + "\n" for h in self.history))
        signal.signal(signal.SIGTERM, self._on_sigterm)
        from earl_megatron.trainer.live import LiveView
        self.view = LiveView(cfg.run.iterations, start, self.out, enabled=self.rank == 0,
                             tensorboard=cfg.run.tensorboard, live=cfg.run.live_view)
        with self.view:
            for line in self._pending:
                self.view.message(line)
            if start == 0 and cfg.sft.steps:
                from earl_megatron.trainer.warm_start import WarmStart
                warm = WarmStart(self, self._sft_start, self._sft_history)
                mol = warm.run(mol)
                self._sft_history = warm.history
                if self._stop:  # SIGTERM during the warm start: checkpointed, resume later
                    return self.history
            return self._train(start, mol)

    def _train(self, start: int, mol) -> list[dict]:
        cfg = self.cfg
        evals = {}
        if start == 0:
            evals["start"], mol = self.evaluate(mol)
        for it in range(start, cfg.run.iterations):
            t0 = time.perf_counter()
            ref_now = self.ref.layout if self.ref is not None else None
            layouts = {"rollout": self._plan_or_save(it, start, mol, "rollout",
                                                     self._predicted_lengths(),
                                                     resident=self._ref_bytes(ref_now))}
            mol = self._switch(mol, layouts["rollout"])
            t1 = time.perf_counter()
            seeds = loop.episode_seeds(cfg, it, cfg.rollout.episodes_per_iteration)
            block, episodes = loop.play(mol, cfg, self.tok, seeds,
                                        temperature=cfg.rollout.temperature,
                                        sample_seed=cfg.run.seed * 7919 + it)
            t2 = time.perf_counter()
            tokens = self._all_lengths(block, episodes)
            lengths = [tokens[s] for s in sorted(tokens)]
            # LOGPROB and TRAIN are planned at this boundary, on the episodes just played (the
            # selector reads nothing that LOGPROB changes), while the policy's groups are live
            if self.ref is not None:
                layouts["logprob"] = self._plan_or_save(
                    it, start, mol, "logprob", lengths, current=self.ref.layout,
                    resident=self._policy_bytes(mol.layout))
            layouts["train"] = self._plan_or_save(
                it, start, mol, "train", lengths,
                resident=self._ref_bytes(layouts.get("logprob")))
            mplan = loop.micro_batch_plan(cfg, layouts["train"], tokens)
            length_of = mplan.length_of
            ref_lp, moved_lp, extra, kl = {}, 0, {}, None
            if self.ref is not None:
                self._switch_ref(layouts["logprob"])
                ref_lp, moved_lp = loop.reference_logprobs(
                    self.ref, cfg, mol.layout, list(block),
                    {s: e.token_ids for s, e in zip(block, episodes)}, tokens,
                    self.tok.pad_token_id)
            t3 = time.perf_counter()
            samples = {s: episode_tensors(e.token_ids, e.loss_mask, e.logprobs, e.reward,
                                          length_of[s], self.tok.pad_token_id, e.turn_rewards,
                                          ref_logprobs=ref_lp.get(s))
                       for s, e in zip(block, episodes)}
            if self.ref is not None:
                kl, extra = loop.kl_to_reference(cfg, mol, list(block), samples)
            adv = loop.compute_advantages(cfg, mol, list(block), samples, len(seeds),
                                          kl=kl if cfg.algorithm.kl_mode == "reward" else None)
            producer = mol.layout
            mol = self._switch(mol, layouts["train"])
            t4 = time.perf_counter()
            loss, moved, entropy = loop.train_on(mol, cfg, producer, list(block), samples, adv,
                                                 mplan)
            t5 = time.perf_counter()
            if entropy is not None:
                extra["entropy"] = entropy
            self.last_lengths = lengths
            seconds = {"plan+switch": t1 - t0, "rollout": t2 - t1}
            if self.ref is not None:
                seconds["logprob"] = t3 - t2
            seconds.update({"switch": t4 - (t3 if self.ref is not None else t2),
                            "train": t5 - t4, "total": t5 - t0})
            rec = self._record(it, layouts, episodes, lengths, loss, moved + moved_lp, seconds,
                               extra)
            self.history.append(rec)
            # ranks may see SIGTERM at different moments: agree before any collective save
            flag = torch.tensor([int(self._stop)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self._stop = bool(flag.item())
            last = it == cfg.run.iterations - 1
            if self._stop or last or (cfg.run.checkpoint_every and
                                      (it + 1) % cfg.run.checkpoint_every == 0):
                self._checkpoint(mol, it)
            if cfg.run.eval_every and (it + 1) % cfg.run.eval_every == 0 and not last:
                evals[f"iter{it + 1}"], mol = self.evaluate(mol)
            if self._stop:
                break
        if not self._stop:
            evals["end"], mol = self.evaluate(mol)
        if self.rank == 0:
            (self.out / "eval.json").write_text(json.dumps(evals, indent=1))
            for when, res in evals.items():
                self._log_line(f"evaluation {when}: " + ", ".join(
                    f"{k} accuracy {v['accuracy']:.2f}, tool calls {v['tool_calls']:.2f}"
                    if "accuracy" in v else f"{k} win {v['win_rate']:.2f}"
                    for k, v in res.items()))
            from earl_megatron.trainer.report import write_report
            write_report(self.out, self.history, evals, sft=self._sft_history)
        return self.history

    # ------------------------------------------------------------------ pieces
    def _start(self):
        cfg = self.cfg
        ckpt = latest_checkpoint(self.out / "checkpoints") if cfg.run.resume else None
        if ckpt is not None:
            state = json.loads((ckpt / "loop.json").read_text())
            lay = ParallelLayout.parse(state["layout"], world_size=self.world,
                                       model=cfg.model.shape)
            ref_lay = state.get("ref_layout")
            # the reference first: the model built last owns the live process groups
            self.ref = self._build_reference(lay if ref_lay is None else ParallelLayout.parse(
                ref_lay, world_size=self.world, model=cfg.model.shape))
            mol = build_on_layout(cfg.model, lay, optimizer=loop.optimizer_spec(cfg),
                                  seed=cfg.run.seed)
            load_checkpoint(mol, ckpt)
            self.history = state["history"]
            self.last_lengths = state["last_lengths"]
            self._restore_selector(state.get("selector"))
            if self.rank == 0:
                self._log_line(f"resumed from {ckpt} at iteration {state['iteration'] + 1}")
            return state["iteration"] + 1, mol
        from earl_megatron.trainer.warm_start import resume_layout, warm_start_state
        warm = warm_start_state(cfg, self.out)
        if warm is not None:
            # killed during (or right after) the warm start: its weights, Adam state and step
            mol = build_on_layout(cfg.model, resume_layout(warm, self.world, cfg),
                                  optimizer=loop.optimizer_spec(cfg), seed=cfg.run.seed)
            load_checkpoint(mol, warm["path"])
            self._sft_start, self._sft_history = warm["sft_step"] + 1, warm["sft_history"]
            if self.rank == 0:
                self._log_line(f"resumed the warm start from {warm['path']} at step "
                               f"{self._sft_start}")
            return 0, mol
        first = self.plan_stage("rollout", self._predicted_lengths(), None)
        self.ref = self._build_reference(first)
        if cfg.run.init:
            from earl_megatron.weights.convert import load_policy, read_model_config
            found = read_model_config(cfg.run.init)
            if found != cfg.model:
                raise ConfigError(f"run.init={cfg.run.init} holds {found}, but the model config "
                                  f"is {cfg.model}; pick the matching model= recipe")
            mol = load_policy(cfg.run.init, first, optimizer=loop.optimizer_spec(cfg),
                              seed=cfg.run.seed)
            return 0, mol
        mol = build_on_layout(cfg.model, first, optimizer=loop.optimizer_spec(cfg),
                              seed=cfg.run.seed)
        return 0, mol

    def _build_reference(self, layout: ParallelLayout):
        """The reference policy in ``layout``: the initial policy, frozen, no optimizer (None
        when kl_mode=off). Rebuilt the same from (run.seed | run.init), hence not checkpointed."""
        cfg = self.cfg
        if cfg.algorithm.kl_mode == "off":
            return None
        if cfg.run.init:
            from earl_megatron.weights.convert import load_policy
            return load_policy(cfg.run.init, layout, ddp=False, optimizer=None,
                               seed=cfg.run.seed)
        return build_on_layout(cfg.model, layout, ddp=False, optimizer=None, seed=cfg.run.seed)

    def _plan_or_save(self, it: int, start: int, mol, stage: str, lengths: list[int], *,
                      current: Optional[ParallelLayout] = None, resident: int = 0):
        try:
            return self.plan_stage(stage, lengths, current or mol.layout, resident)
        except Exception:
            # NoLayoutFitsError / LayoutOverBudgetError once contexts outgrow the budget: keep
            # what was trained (the error says what would fit; rerun with it to resume here)
            if it > start:
                self._checkpoint(mol, it - 1)
            raise

    def _switch(self, mol, layout: ParallelLayout):
        """The policy in ``layout`` with its groups current."""
        mol = self._make_live(mol, layout, "policy")
        self._live = "policy"
        return mol

    def _switch_ref(self, layout: ParallelLayout) -> None:
        self.ref = self._make_live(self.ref, layout, "ref")
        self._live = "ref"

    def _make_live(self, model, layout: ParallelLayout, who: str):
        from earl_megatron.runtime import groups
        from earl_megatron.runtime.switcher import switch_layout
        if layout == model.layout and (self._live == who or groups.activate(layout)):
            return model
        return switch_layout(model, layout)

    def _all_lengths(self, block, episodes) -> dict[int, int]:
        """Tokens of every episode of the iteration, by sample id (identical on every rank)."""
        parts: list = [None] * self.world
        dist.all_gather_object(parts, [(s, len(e.token_ids)) for s, e in zip(block, episodes)])
        return dict(p for part in parts for p in part)

    def evaluate(self, mol):
        """Win rate per eval opponent on held-out seeds, greedy and sampled (all ranks call it).

        "sampled" plays the stochastic policy at the rollout temperature (what training
        optimises); "greedy" plays its argmax.
        """
        cfg = self.cfg
        out = {}
        mol = self._switch(mol, mol.layout)  # no-op unless the reference holds the groups
        if mol.layout.cp != 1:
            # the engine decodes with cp=1: spend the cp ranks on dp for the evaluation
            lay = mol.layout
            mol = self._switch(mol, ParallelLayout(tp=lay.tp, pp=lay.pp, dp=lay.dp * lay.cp))
        n = cfg.run.eval_episodes
        seeds = [10**9 + cfg.run.seed * 100_003 + i for i in range(n)]
        # games: one evaluation per opponent; an environment without opponents (the
        # calculator) is evaluated as configured, under its own name
        for opp in cfg.env.eval_opponents or (None,):
            for mode, temp in (("greedy", 0.0), ("sampled", cfg.rollout.temperature)):
                block, eps = loop.play(mol, cfg, self.tok, seeds, temperature=temp,
                                       sample_seed=424242, opponent=opp)
                parts: list = [None] * self.world
                dist.all_gather_object(parts, [(s, e.info.get("outcome"), e.reward,
                                                _tool_row(e)) for s, e in zip(block, eps)])
                by_id = {s: (o, r, t) for part in parts for s, o, r, t in part}
                wins = sum(1 for o, _, _ in by_id.values() if o == "win")
                res = {"win_rate": wins / len(by_id),
                       "mean_reward": sum(r for _, r, _ in by_id.values()) / len(by_id)}
                tool = [t for _, _, t in by_id.values() if t is not None]
                if tool:
                    res.update(tool_metrics(tool))
                out[f"{opp or cfg.env.name}/{mode}"] = res
        return out, mol

    def _record(self, it, layouts, episodes, lengths, loss, moved, seconds, extra) -> dict:
        parts: list = [None] * self.world
        mine = [(e.reward, e.info.get("outcome"), bool(e.info.get("illegal")),
                 bool(e.info.get("unparsable")), _tool_row(e)) for e in episodes]
        dist.all_gather_object(parts, (self.rank, mine))
        # every rank of a replica reports the same episodes: count each replica once
        seen, rows = set(), []
        for rank, rs in parts:
            c = layouts["rollout"].coords(rank).dp
            if c not in seen:
                seen.add(c)
                rows.extend(rs)
        n = max(len(rows), 1)
        rec = {"iteration": it,
               "layouts": {k: str(v) for k, v in layouts.items()},
               "reward": sum(r[0] for r in rows) / n,
               "win_rate": sum(r[1] == "win" for r in rows) / n,
               "illegal_rate": sum(r[2] for r in rows) / n,
               "unparsable_rate": sum(r[3] for r in rows) / n,
               **(tool_metrics([r[4] for r in rows]) if any(r[4] for r in rows) else {}),
               "mean_context": sum(lengths) / len(lengths), "max_context": max(lengths),
               "loss": loss, "seconds": seconds, "dispatch_bytes": moved}
        rec.update(extra)  # kl, ref_log_ratio_max (kl on), entropy (entropy_coef > 0)
        rec["predicted_memory_gb"] = {k: v / 2**30 for k, v in self.predicted_memory.items()}
        if self.reasons:
            rec["layout_reasons"] = dict(self.reasons)
        if self.rank == 0:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
        self.view.update(rec)
        return rec

    def _checkpoint(self, mol, it: int) -> None:
        state = {"iteration": it, "layout": str(mol.layout), "history": self.history,
                 "last_lengths": self.last_lengths,
                 "ref_layout": str(self.ref.layout) if self.ref is not None else None,
                 "selector": [[s, str(l)] for s, l in (self.selector_state.chosen
                                                       if self.selector_state else ())]}
        save_checkpoint(mol, self.out / "checkpoints", it, state)

    def _restore_selector(self, chosen) -> None:
        if not chosen or not self.auto:
            return
        from earl_megatron.plan.selector import SelectorState
        self.selector_state = SelectorState(tuple(
            (s, ParallelLayout.parse(l, world_size=self.world)) for s, l in chosen))

    def _on_sigterm(self, signum, frame) -> None:
        self._stop = True  # finish the iteration, checkpoint, exit (Slurm preemption)

    def _log_line(self, text: str) -> None:
        # rank 0 only; before the view exists (resume), lines wait for it
        if self.view is None:
            self._pending.append(text)
        else:
            self.view.message(text)
