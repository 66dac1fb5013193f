"""Runner: the trainer's state across iterations (model, selector state, history, checkpoints).

Reads as the loop it runs::

    for it in iterations:
        layouts = plan(it)                       # selector or static, per stage
        mol = switch(mol, layouts.rollout)       # weights + optimizer state, in memory
        episodes = play(...)                     # per dp replica, KV-cached Megatron engine
        advantages = compute_advantages(...)     # all-reduce over owners
        mol = switch(mol, layouts.train)
        loss = train_on(...)                     # dispatch point to point, Megatron schedule
        record, checkpoint (periodic, on SIGTERM)

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
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.runtime.build import build_on_layout
from earl_megatron.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from earl_megatron.trainer import loop
from earl_megatron.trainer.data import episode_tensors, padded_length


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
        self._selector = self._make_selector() if cfg.layout.mode == "auto" else None

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
        return Selector(self.cfg.model, cluster, opts,
                        SelectorConfig(memory_margin=lc.memory_margin, hysteresis=lc.hysteresis,
                                       max_tp=lc.max_tp, max_cp=lc.max_cp, max_pp=lc.max_pp))

    def plan(self, current: Optional[ParallelLayout]) -> dict[str, ParallelLayout]:
        if self._selector is None:
            return {s: ParallelLayout.parse(self.cfg.layout.static(s), world_size=self.world,
                                            model=self.cfg.model.shape)
                    for s in ("rollout", "train")}
        from earl_megatron.plan.selector import SelectorState
        from earl_megatron.plan.specs import Stage, StageWorkload

        n = self.cfg.rollout.episodes_per_iteration
        lengths = self.last_lengths or [128] * n
        longest = max(lengths)
        mbs = self.cfg.algorithm.micro_batch_size
        wls = [StageWorkload.of(Stage.ROLLOUT, lengths, responses_in_flight=n),
               StageWorkload.of(Stage.TRAIN, lengths, micro_batch_tokens=mbs * longest)]
        plans, self.selector_state = self._selector.plan_iteration(
            wls, current=current, state=self.selector_state or SelectorState())
        self.last_plans = plans
        return {"rollout": plans[0].layout, "train": plans[1].layout}

    # ------------------------------------------------------------------ the loop
    def train(self) -> list[dict]:
        cfg = self.cfg
        start, mol = self._start()
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if start == 0 and self.rank == 0:
            self._log_line("iter  rollout   train     reward  win   illegal unparsable ctx   "
                           "loss     s/iter")
        evals = {}
        if start == 0:
            evals["start"], mol = self.evaluate(mol)
        for it in range(start, cfg.run.iterations):
            t0 = time.perf_counter()
            try:
                layouts = self.plan(mol.layout)
            except Exception:
                # e.g. NoLayoutFitsError once contexts outgrow the budget: keep what was
                # trained (the error says what would fit; rerun with it to resume from here)
                if it > start:
                    self._checkpoint(mol, it - 1)
                raise
            mol = self._switch(mol, layouts["rollout"])
            t1 = time.perf_counter()
            seeds = loop.episode_seeds(cfg, it, cfg.rollout.episodes_per_iteration)
            block, episodes = loop.play(mol, cfg, self.tok, seeds,
                                        temperature=cfg.rollout.temperature,
                                        sample_seed=cfg.run.seed * 7919 + it)
            t2 = time.perf_counter()
            lengths = self._all_lengths(block, episodes)
            length = padded_length(max(lengths), loop.CP_MULTIPLE)
            samples = {s: episode_tensors(e.token_ids, e.loss_mask, e.logprobs, e.reward,
                                               length, self.tok.pad_token_id)
                       for s, e in zip(block, episodes)}
            adv = loop.compute_advantages(cfg, mol, list(block), samples, len(seeds))
            producer = mol.layout
            mol = self._switch(mol, layouts["train"])
            t3 = time.perf_counter()
            loss, moved = loop.train_on(mol, cfg, producer, list(block), samples, adv, length)
            t4 = time.perf_counter()
            self.last_lengths = lengths
            rec = self._record(it, layouts, episodes, lengths, loss, moved,
                               {"plan+switch": t1 - t0, "rollout": t2 - t1,
                                "switch": t3 - t2, "train": t4 - t3, "total": t4 - t0})
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
            self._log_line(f"evaluation: {json.dumps(evals)}")
            from earl_megatron.trainer.report import write_report
            write_report(self.out, self.history, evals)
        return self.history

    # ------------------------------------------------------------------ pieces
    def _start(self):
        cfg = self.cfg
        ckpt = latest_checkpoint(self.out / "checkpoints") if cfg.run.resume else None
        if ckpt is not None:
            state = json.loads((ckpt / "loop.json").read_text())
            lay = ParallelLayout.parse(state["layout"], world_size=self.world,
                                       model=cfg.model.shape)
            mol = build_on_layout(cfg.model, lay, optimizer=loop.optimizer_spec(cfg),
                                  seed=cfg.run.seed)
            load_checkpoint(mol, ckpt)
            self.history = state["history"]
            self.last_lengths = state["last_lengths"]
            self._restore_selector(state.get("selector"))
            if self.rank == 0:
                self._log_line(f"resumed from {ckpt} at iteration {state['iteration'] + 1}")
            return state["iteration"] + 1, mol
        first = self.plan(None)["train"]
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

    def _switch(self, mol, layout: ParallelLayout):
        from earl_megatron.runtime.switcher import switch_layout
        return mol if layout == mol.layout else switch_layout(mol, layout)

    def _all_lengths(self, block, episodes) -> list[int]:
        parts: list = [None] * self.world
        dist.all_gather_object(parts, [(s, len(e.token_ids)) for s, e in zip(block, episodes)])
        by_id = dict(p for part in parts for p in part)
        return [by_id[s] for s in sorted(by_id)]

    def evaluate(self, mol):
        """Win rate per eval opponent on held-out seeds, greedy and sampled (all ranks call it).

        "sampled" plays the stochastic policy at the rollout temperature (what training
        optimises); "greedy" plays its argmax.
        """
        cfg = self.cfg
        out = {}
        if mol.layout.cp != 1:
            # the engine decodes with cp=1: spend the cp ranks on dp for the evaluation
            lay = mol.layout
            mol = self._switch(mol, ParallelLayout(tp=lay.tp, pp=lay.pp, dp=lay.dp * lay.cp))
        n = cfg.run.eval_episodes
        seeds = [10**9 + cfg.run.seed * 100_003 + i for i in range(n)]
        for opp in cfg.env.eval_opponents:
            for mode, temp in (("greedy", 0.0), ("sampled", cfg.rollout.temperature)):
                block, eps = loop.play(mol, cfg, self.tok, seeds, temperature=temp,
                                       sample_seed=424242, opponent=opp)
                parts: list = [None] * self.world
                dist.all_gather_object(parts, [(s, e.info.get("outcome"), e.reward)
                                               for s, e in zip(block, eps)])
                by_id = {s: (o, r) for part in parts for s, o, r in part}
                wins = sum(1 for o, _ in by_id.values() if o == "win")
                out[f"{opp}/{mode}"] = {
                    "win_rate": wins / len(by_id),
                    "mean_reward": sum(r for _, r in by_id.values()) / len(by_id)}
        return out, mol

    def _record(self, it, layouts, episodes, lengths, loss, moved, seconds) -> dict:
        parts: list = [None] * self.world
        mine = [(e.reward, e.info.get("outcome"), bool(e.info.get("illegal")),
                 bool(e.info.get("unparsable"))) for e in episodes]
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
               "mean_context": sum(lengths) / len(lengths), "max_context": max(lengths),
               "loss": loss, "seconds": seconds, "dispatch_bytes": moved}
        if self._selector is not None:
            rec["predicted_memory_gb"] = {p.stage.value: p.predicted_memory_bytes / 2**30
                                          for p in self.last_plans}
        if self.rank == 0:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            self._log_line(f"{it:4d}  {rec['layouts']['rollout']:9s} {rec['layouts']['train']:9s} "
                           f"{rec['reward']:+.3f}  {rec['win_rate']:.2f}  "
                           f"{rec['illegal_rate']:.2f}    {rec['unparsable_rate']:.2f}       "
                           f"{rec['mean_context']:5.0f} {loss:+.4f}  {seconds['total']:.1f}")
        return rec

    def _checkpoint(self, mol, it: int) -> None:
        state = {"iteration": it, "layout": str(mol.layout), "history": self.history,
                 "last_lengths": self.last_lengths,
                 "selector": [[s, str(l)] for s, l in (self.selector_state.chosen
                                                       if self.selector_state else ())]}
        save_checkpoint(mol, self.out / "checkpoints", it, state)

    def _restore_selector(self, chosen) -> None:
        if not chosen or self._selector is None:
            return
        from earl_megatron.plan.selector import SelectorState
        self.selector_state = SelectorState(tuple(
            (s, ParallelLayout.parse(l, world_size=self.world)) for s, l in chosen))

    def _on_sigterm(self, signum, frame) -> None:
        self._stop = True  # finish the iteration, checkpoint, exit (Slurm preemption)

    def _log_line(self, text: str) -> None:
        print(text, flush=True)
