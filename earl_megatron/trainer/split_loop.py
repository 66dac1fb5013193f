"""Split placement (``rollout.placement=split``): a rollout pool plays while a train pool trains.

The world is two pools (plan/split.py, runtime/groups.py ``build_pool_groups``): the train pool,
ranks ``0 .. n_t - 1`` in ``layout.train``, holds the policy and its optimizer; the rollout
pool, the last ``rollout.pool_ranks`` ranks in ``layout.rollout``, holds a copy of the weights
without an optimizer and plays the episode pool (trainer/episode_pool.py). Each pool is SPMD
inside itself, on its own Megatron-Core groups, and the two touch only at one meeting per
iteration, where every rank of the world calls the same collectives in the same order:

    ROLLOUT POOL                                   TRAIN POOL
    stage j: play under the weights it holds       train B_{j-1} (re-score, advantages,
      (version v_j-1 after the first meeting)        one optimizer step -> v_j), record it
    ============================ meeting j (the world) ==============================
      1 agree       one all_gather_object: stop? (a signal, the stop file, an abandoned
                    stage), the stage's metrics and seconds, the packed batch's sizes
      2 checkpoint  when due (periodic, the last, a stop): iteration j-1, weights v_j, the
                    episode pool as it was before stage j (its leader sends it to rank 0)
      3 episodes    B_j, rollout replicas -> train replicas, point to point, one dispatch
                    (runtime/episode_transfer.py; its metadata came with the agreement)
      4 weights     v_j, train pool -> rollout pool, point to point by the weight plan
                    (runtime/weight_transfer.py ``hand_off``)
    then stage j+1 plays under v_j while the train pool trains B_j.

So each batch is one version behind the weights it trains (k = 1 is "one step off-policy";
stage j's admission counts that lag: plan/staleness.py ``admissible(lag=)``), and an iteration
takes ``max(rollout, train) + meeting`` rather than their sum: plan/split.py's period.

Invariants (tests/distributed/test_split_trainer.py):
- every episode the rollout pool hands over is trained exactly once, in the step after the
  meeting that moved it; an episode is in the pool, in transit at a meeting, or in the batch
  being trained, never two of these;
- no trained token is older than ``algorithm.max_staleness`` (staleness_metrics raises);
- after each handoff the rollout pool's weights equal the train pool's, bit for bit;
- a checkpoint holds the train pool's weights and optimizer after iteration j-1 and the pool
  before stage j: the resumed run plays stage j again (under v_j, lag 0), so nothing is trained
  twice or lost. A stop is agreed at a meeting (a rollout stage that saw it abandons at its next
  turn first); the train pool finishes a step it began.

The handoff runs on a process group of its own (the world's ranks, made once at setup) whose
timeout is ``cluster.weight_sync_timeout_s``: once every rank has arrived (a world barrier, so
the train pool's start evaluation or a checkpoint write is not counted), a rank that stalls or
dies in the handoff fails it on every other rank within that bound, with ``HandoffFailed``
naming the step, the limit and the checkpoint a rerun resumes from (the newest; the training
since it is done again: the handoff cannot checkpoint, its world is broken). Fault point
``split.handoff`` (info ``it``, ``rank``), tests/distributed/test_split_faults.py.

``rollout.placement=auto``: the pools' sizes and layouts are the selector's (plan/split.py
``plan_split`` over the splits of the world), planned at the start from the checkpoint's lengths
and, at every meeting, by rank 0 from the step it just trained and the stage the meeting before
measured (decoding apart from the environments' time); the others follow its plan. A move
rewinds the stage just played, checkpoints iteration j-1 and has every rank rebuild its side on
the new pools from that checkpoint (dist_checkpointing reshards the train state); the loop goes
on from stage j. tests/distributed/test_split_trainer.py forces one and checks exactly once.

``rollout.engine=sglang``: the rollout pool holds no model (``PoolSeat``); each of its replicas
leads one SGLang server (trainer/sglang_rollout.py with ``ranks=`` the pool). Step 4 then
assembles full buckets at the leaders from the train pool's shards (``hand_off_full``), which
push them into their servers after the meeting, outside the handoff's bound: a server's death
or restart is the rollout pool's time, within the engine's restart budget.
tests/sglang/test_split_sglang.py.

Not here yet (docs/async.md): auto placement with SGLang servers, the KL reference, the train
pool's own LOGPROB / TRAIN layouts, moves in memory rather than through a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from earl_megatron.config.train import ConfigError, TrainConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.rollout_rules import rollout_layout_problem
from earl_megatron.plan.split import (MeasuredRates, SplitDoesNotFitError, SplitPlan,
                                      plan_split)
from earl_megatron.rollout.agent_loop import RolloutAbandoned
from earl_megatron.runtime import groups
from earl_megatron.runtime.build import ModelOnLayout, build_on_layout, seat_on_layout
from earl_megatron.runtime.checkpoint import base_hf_config, load_checkpoint, save_checkpoint
from earl_megatron.runtime.checkpoint_files import find_checkpoint
from earl_megatron.runtime.episode_transfer import block_sizes, pack_block, \
    transfer_episodes
from earl_megatron.runtime.fault_points import fault_point
from earl_megatron.runtime.transport import Traffic
from earl_megatron.runtime.switcher import plan_params
from earl_megatron.runtime.weight_transfer import WeightPlanError, hand_off, hand_off_full
from earl_megatron.seeds import rollout_sample_seed
from earl_megatron.trainer import segments
from earl_megatron.trainer.model_pair import ModelPair
from earl_megatron.trainer.record import StageTimer
from earl_megatron.trainer.runner import Trainer
from earl_megatron.trainer.sglang_rollout import replica_leaders

AUDIT_ENV = "EARL_SPLIT_AUDIT"
"""A directory: every rank appends what it sent, trained and held to ``rank<r>.jsonl`` there
(the exactly-once and bit-exact checks of the tests; costs a weight gather per handoff)."""


class HandoffFailed(RuntimeError):
    """Split placement's weight handoff timed out or failed on this rank (module docstring)."""


def split_pools(cfg: TrainConfig, world: int) -> tuple[ParallelLayout, ParallelLayout]:
    """(train pool's layout, rollout pool's layout) of ``cfg`` on ``world`` ranks; a
    ConfigError naming the fix when they do not divide the world or cannot run."""
    n_r = cfg.rollout.pool_ranks or world // 2
    if not 1 <= n_r < world:
        raise ConfigError(f"rollout.placement=split on {world} ranks: rollout.pool_ranks="
                          f"{n_r} must leave both pools at least one rank (1 .. {world - 1})")
    n_t = world - n_r

    def parse(stage: str, text: Optional[str], n: int) -> ParallelLayout:
        try:
            return ParallelLayout.parse(text, world_size=n, model=cfg.model)
        except ValueError as e:
            raise ConfigError(f"layout.{stage}={text} on the {stage} pool's {n} ranks "
                              f"(rollout.placement=split, rollout.pool_ranks={n_r}): {e}") \
                from None

    train = parse("train", cfg.layout.train, n_t)
    rollout = parse("rollout", cfg.layout.rollout, n_r)
    problem = rollout_layout_problem(rollout, cfg.rollout.engine)
    if problem:
        raise ConfigError(f"layout.rollout={rollout}: {problem}")
    if train.cp > 1:
        raise ConfigError(f"layout.train={train}: the train pool holds each replica's episodes "
                          "whole, which cp > 1 does not yet; use tp, pp or dp there")
    episodes, g = cfg.rollout.episodes_per_iteration, cfg.algorithm.group_size
    if episodes // g < max(train.dp, rollout.dp):
        raise ConfigError(f"rollout.episodes_per_iteration={episodes} is {episodes // g} groups "
                          f"of {g}: fewer than the train pool's {train.dp} or the rollout "
                          f"pool's {rollout.dp} replicas; raise it")
    return train, rollout


class SplitTrainer(Trainer):
    """The trainer under split placement (module docstring); the train pool's half of each
    iteration is ``Trainer.score_and_train``, unchanged."""

    def __init__(self, cfg: TrainConfig, tokenizer):
        self.auto = cfg.rollout.placement == "auto"
        self.sglang = cfg.rollout.engine == "sglang"
        """The rollout pool runs SGLang servers (each replica's first rank leads one) and
        holds no model; the train pool evaluates with the embedded engine."""
        self.pools: Optional[tuple[ParallelLayout, ParallelLayout]] = \
            None if self.auto else split_pools(cfg, dist.get_world_size())
        super().__init__(cfg, tokenizer)
        self.world_planner = self.planner if self.auto else None
        """auto: the planner of the whole world, whose selector plans the split (cp = 1: the
        train pool holds each replica's episodes whole, and decoding never uses cp)."""
        if self.auto:
            sel = self.planner.selector
            self.planner.selector = replace(sel, config=replace(sel.config, max_cp=1))
        self.split_plan: Optional[SplitPlan] = None
        """auto: the split in force and why (plan/split.py)."""
        self.train_side = self.pools is not None and self.rank < self.pools[0].world_size
        self.audit = Path(os.environ[AUDIT_ENV]) if os.environ.get(AUDIT_ENV) else None
        self.model: Optional[ModelOnLayout] = None
        """This rank's model: the policy with its optimizer (train pool), or the rollout copy."""
        self.models: Optional[ModelPair] = None
        self._train_s = 0.0
        """Train pool: the seconds its last step took (scoring and training), for auto's rates."""
        self._last_rollout: dict = {"rollout_s": 0.0, "metrics": {}}
        """What the rollout pool's first rank said at the last meeting (auto's rates)."""
        dist.barrier()   # every rank arrives together: the group's setup has that timeout too
        self.handoff_group = dist.new_group(
            list(range(self.world)),
            timeout=timedelta(seconds=cfg.cluster.weight_sync_timeout_s))
        """The handoff's own group (every rank, in order: group rank = global rank), so that
        ``cluster.weight_sync_timeout_s`` bounds it, not the world's collective timeout."""

    def planned_world(self) -> int:
        return self.world if self.pools is None else self.pools[0].world_size

    def make_planner(self, world: int, servers_here: bool = False):
        """The train pool's planner (auto: the world's): no SGLang server shares its devices."""
        del servers_here
        return super().make_planner(world, servers_here=False)

    # ------------------------------------------------------------------ the pools
    def _use(self, plan: SplitPlan) -> None:
        """Take ``plan``'s pools (auto): this rank's side and its pool's stage planner."""
        train, rollout = plan.train.layout, plan.rollout.layout
        if train.cp > 1:
            raise ConfigError(f"the split's train layout {train} has cp > 1, which the train "
                              "pool does not run yet (it holds each replica's episodes whole); "
                              "set layout.max_cp=1")
        problem = rollout_layout_problem(rollout, self.cfg.rollout.engine)
        if problem:
            raise ConfigError(f"the split's rollout layout {rollout}: {problem}")
        self.split_plan, self.pools = plan, (train, rollout)
        self.train_side = self.rank < train.world_size
        self.planner = self.make_planner(train.world_size)

    def _plan_split(self, lengths: list[int], rates: Optional[MeasuredRates],
                    env_seconds: float = 0.0) -> SplitPlan:
        """auto: the split for batches of ``lengths`` tokens under the measured ``rates`` (the
        rollout's ``env_seconds``, which more ranks do not shorten, apart), kept where it is
        unless another is faster by the hysteresis, moving included. Rank 0 plans (at the start
        and before every meeting); the others take its plan."""
        wp = self.world_planner
        wp.last_lengths = list(lengths)
        return plan_split(wp.selector, wp.split_workload(env_seconds), rates=rates,
                          current=self.split_plan, colocated=False)

    # ------------------------------------------------------------------ the run
    def train(self) -> list[dict]:
        start, pool_state, messages = self._start()
        if pool_state and not self.train_side:
            self.pool.restore(pool_state)
        messages.append(self._describe())
        return self.drive(start, messages, lambda: self._run_split(start))

    def _describe(self) -> str:
        t, r = self.pools
        line = (f"split placement: train pool {_ranks(0, t.world_size)} in {t}, rollout pool "
                f"{_ranks(t.world_size, self.world)} in {r}")
        return line + (f" ({self.split_plan.reason})" if self.split_plan else "")

    def _start(self, *, moved: bool = False) -> tuple[int, Optional[dict], list[str]]:
        """Build each pool's model and load the newest checkpoint, if any: (first iteration, the
        episode pool it held, lines for the live view). auto plans the pools first (from the
        checkpoint's lengths); ``moved``: the pools were just re-planned and the checkpoint
        written, in this process."""
        cfg = self.cfg
        if not cfg.run.resume and not moved:
            refused = segments.earlier_run(self.out)
            if refused is not None:
                raise ConfigError(refused)
        found = find_checkpoint(self.out / "checkpoints") if cfg.run.resume or moved else None
        if found is not None and (found.state.get("world_size") != self.world or
                                  not found.state.get("placement")):
            raise ConfigError(
                f"{found.path} was written under placement "
                f"{found.state.get('placement') or 'colocated'} on "
                f"{found.state.get('world_size')} ranks: resume split placement on the same "
                "world size, or start a new run from it with run.init")
        if self.auto and not moved:   # rank 0 plans, every rank takes its plan (or error)
            got: list = [None]
            if self.rank == 0:
                try:
                    got[0] = self._plan_split(found.state["last_lengths"] if found else [],
                                              None)
                except SplitDoesNotFitError as e:
                    got[0] = ConfigError(
                        f"rollout.placement=auto on {self.world} ranks: {e}. Fix: more ranks, "
                        "a larger layout.memory_budget_gb, or shorter contexts "
                        "(rollout.max_context_tokens)")
            dist.broadcast_object_list(got, src=0)
            if isinstance(got[0], Exception):
                raise got[0]
            self._use(got[0])
        t, r = self.pools
        placement = {"train": str(t), "rollout": str(r)}
        if found is not None and not self.auto and found.state["placement"] != placement:
            raise ConfigError(
                f"{found.path} was written with pools {found.state['placement']}, not "
                f"{placement}: resume with the pools it was written with (or "
                "rollout.placement=auto, which plans its own), or start a new run from it "
                "with run.init")
        lay = t if self.train_side else r
        spec = self.optimizer if self.train_side else None
        self.model = self.models = None     # a move: the old pools' models go first
        if cfg.run.init and self.train_side and found is None:
            from earl_megatron.weights.convert import load_policy
            model = load_policy(cfg.run.init, lay, ddp=True, optimizer=spec,
                                seed=cfg.run.seed, pools=self.pools)
        elif self.sglang and not self.train_side:   # the servers hold the weights
            model = seat_on_layout(cfg.model, lay, seed=cfg.run.seed, pools=self.pools)
            if cfg.run.init and found is None:
                from earl_megatron.weights.convert import join_policy_load
                join_policy_load(cfg.run.init)
        else:   # the rollout pool's weights come from the train pool at the first handoff
            model = build_on_layout(cfg.model, lay, ddp=self.train_side, optimizer=spec,
                                    seed=cfg.run.seed, pools=self.pools,
                                    init=None if self.train_side else False)
            if cfg.run.init and found is None:
                from earl_megatron.weights.convert import join_policy_load
                join_policy_load(cfg.run.init)
        self.model = model
        self.models = ModelPair(model, None) if self.train_side else None
        if self.sglang:
            self._sglang_side()
        if found is None:
            return 0, None, []
        state = found.state
        load_checkpoint(model if self.train_side else None, found.path)
        # the selector state is per pool layout and the pools may differ: lengths and profile
        self.planner.restore([], state["last_lengths"], state.get("profile"))
        self.history[:] = state["history"]
        self._saved = state["iteration"]
        if moved:
            return state["iteration"] + 1, state.get("pool"), []
        notes = [m for m in (found.message(),) if m is not None]
        return state["iteration"] + 1, state.get("pool"), notes + [
            f"resumed from {found.path} at iteration {state['iteration'] + 1}"]

    def _sglang_side(self) -> None:
        """engine=sglang: this rank's rollout, for its side of the current pools. The rollout
        pool's ranks drive the servers (started at the first handoff, on the pool's group); the
        train pool evaluates with the embedded engine, its devices holding no server."""
        if self.rollout is not None:
            self.rollout.close()   # a rank's servers of earlier pools stop
        if self.train_side:
            self.rollout = self.make_rollout("embedded")
        else:
            self.rollout = self.make_rollout("sglang",
                                             ranks=range(self.pools[0].world_size, self.world),
                                             ranks_group=groups.pool_group())

    def _run_split(self, start: int) -> None:
        j: Optional[int] = start
        while j is not None:
            j = self._segment(j, evaluate=j == start == 0)
        self._finish(self.models)

    def _segment(self, start: int, evaluate: bool) -> Optional[int]:
        """Iterations from ``start`` on the current pools, from a handoff of the weights the
        train pool holds; None when the run ends or stops, else the iteration to go on from
        after auto moved the pools."""
        cfg, n = self.cfg, self.cfg.run.iterations
        models = self.models
        if evaluate and self.train_side:
            self._evaluate_into("start", models)   # the rollout pool waits at the handoff
        self._hand_off(start)                        # the rollout pool's weights: v_start
        held = start
        """The version the rollout pool's weights are (train steps in them)."""
        batch = None
        """Train pool: (ids, episodes, rollout metrics) of the batch it trains next."""
        for j in range(start, n + 1):
            out, abandoned, seconds = None, False, 0.0
            if self.train_side:
                if batch is not None:
                    self._train_batch(j - 1, models, *batch)
                    last = j == n
                    if cfg.run.eval_every and j % cfg.run.eval_every == 0 and not last:
                        self._evaluate_into(f"iter{j}", models)
            elif j < n and not self.stop.stopping:
                t0 = time.perf_counter()
                try:
                    out = self.rollout.play_pool(
                        self.model, self.pool, j, version=held,
                        sample_seed=rollout_sample_seed(cfg.run.seed, j),
                        should_stop=self.stop.replica_should_stop, time_decode=True)
                except RolloutAbandoned:
                    abandoned = True
                seconds = time.perf_counter() - t0
                if self.sglang and out is not None:
                    out.metrics.update(self.rollout.metrics())  # the servers, their pushes
                self._audit_stage("rollout", j, t0, out)
            met = self._meet(j, start, out, abandoned, seconds)
            if met is None:
                return None
            if isinstance(met, SplitPlan):
                self._move(met)
                return j
            batch = met
            held = j
        return None

    # ------------------------------------------------------------------ the meeting
    def _meet(self, j: int, start: int, out, abandoned: bool, rollout_seconds: float):
        """Meeting j (module docstring), every rank of the world: the batch B_j on the train
        pool (([], [], metrics) on the rollout pool); None: the run ends here; a SplitPlan:
        auto moves the pools there (iteration j - 1 checkpointed, stage j to play again)."""
        cfg, (t, r) = self.cfg, self.pools
        n_t, n = t.world_size, cfg.run.iterations
        arrived = time.perf_counter()
        mine = {"stop": self.stop.local() or abandoned, "played": out is not None,
                "metrics": out.metrics if out is not None else {},
                "rollout_s": rollout_seconds}
        # the batch packed before the agreement, which carries its sizes: the transfer after it
        # needs no metadata exchange of its own (the meeting is on the rollout's critical path)
        packed: dict = {}
        try:
            packed = pack_block(out.ids, out.episodes) if out is not None else {}
        except ValueError as e:   # said at the agreement: every rank raises, none hangs
            mine["error"] = f"rank {self.rank}: {e}"
        mine["sizes"] = block_sizes(packed)
        if self.rank == 0 and self.auto and j > start:
            # auto's decision, made on rank 0 before the meeting (while it would wait) from the
            # step it just trained and the stage the meeting before measured; every rank
            # follows it
            try:
                mine["plan"] = self._replan(self._last_rollout)
            except SplitDoesNotFitError as e:   # keep the split that runs; say why
                mine["plan"] = self.split_plan
                self.recorder.view.message(f"auto kept its split: no other fits ({e})")
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, mine)
        wait = time.perf_counter() - arrived
        errors = [e["error"] for e in everyone if "error" in e]
        if errors:
            raise RuntimeError(f"split placement, meeting {j}: the batch cannot be handed over: "
                               + "; ".join(errors))
        stop = self.stop.agree(any(e["stop"] for e in everyone))
        played = everyone[n_t]["played"]
        self._last_rollout = everyone[n_t]
        if not self.train_side and played != (out is not None):
            raise RuntimeError(f"rank {self.rank}: rollout stage {j} played on some rollout "
                               "ranks only")
        done = j - 1
        every = cfg.run.checkpoint_every
        if j > start and (stop or j == n or (every and j % every == 0)) and self._saved != done:
            if not self.train_side and stop and played:
                self.pool.rewind()
            self._checkpoint_split(done, played and not stop)
        if stop:
            if not self.train_side and played and self._saved != done:
                self.pool.rewind()
            return None
        if j == n:
            return None
        if self.auto and j > start:
            plan = everyone[0]["plan"]
            if (plan.train.layout, plan.rollout.layout) != self.pools:
                if not self.train_side:
                    self.pool.rewind()        # stage j plays again on the new pools
                if self._saved != done:
                    self._checkpoint_split(done, played=False)
                return plan
            self.split_plan = plan
        with_timer = time.perf_counter()
        ids, episodes = transfer_episodes(t, r, packed, group_size=cfg.algorithm.group_size,
                                          sizes=[e["sizes"] for e in everyone])
        transfer_s = time.perf_counter() - with_timer
        self._audit_sent(j, out)
        handoff_s, handoff_bytes = self._hand_off(j) if j > start else (0.0, 0)
        split = {"rollout_s": everyone[n_t]["rollout_s"], "train_wait_s": wait,
                 "transfer_s": transfer_s, "handoff_s": handoff_s,
                 "handoff_bytes": handoff_bytes, "rollout_ranks": r.world_size}
        if self.split_plan is not None:
            split["plan"] = self.split_plan.reason
        return ids, episodes, {**everyone[n_t]["metrics"], "split": split}

    def _replan(self, rollout0: dict) -> SplitPlan:
        """auto, on rank 0 before meeting j: the split for the last batch's lengths and the
        seconds the two pools measured (step j-1's scoring and training, here; stage j-1's
        rollout, ``rollout0``: what the rollout pool's first rank said at meeting j-1)."""
        lengths, stage = self.planner.last_lengths, rollout0["rollout_s"]
        rates, env = None, 0.0
        if lengths and self._train_s > 0 and stage > 0:
            tokens = sum(lengths)
            rates = MeasuredRates(self.pools[1].world_size, stage, tokens, self._train_s,
                                  tokens)
            # what the stage did besides decoding: tools, games, the loop; more ranks keep it
            env = max(0.0, stage - rollout0["metrics"].get("rollout_decode_s", stage))
        return self._plan_split(lengths, rates, env)

    def _move(self, plan: SplitPlan) -> None:
        """auto moves the pools to ``plan``: every rank regroups, builds its new side's model
        and loads the checkpoint just written (dist_checkpointing reshards the train state onto
        the new train pool); the new rollout pool restores the episode pool from it."""
        old = self._describe()
        self._use(plan)
        _, pool_state, _ = self._start(moved=True)
        if not self.train_side:
            self.pool.restore(pool_state)
        self.recorder.view.message(f"moved from {old.split(' (')[0]} to {self._describe()}")

    def _hand_off(self, j: int) -> tuple[float, int]:
        """Weights v_j to the rollout pool (world); (seconds, bytes the busiest rank received).
        Every rank arrives first (a world barrier), then the handoff runs on its own group:
        ``HandoffFailed`` when it times out or fails here (module docstring)."""
        t, r = self.pools
        traffic = Traffic()
        if self.sglang and not self.train_side:
            self.rollout.ensure_servers(r)   # started (the first handoff) before the barrier
        dist.barrier()   # the handoff's timeout counts the handoff, not a peer's way to it
        t0 = time.perf_counter()
        try:
            fault_point("split.handoff", it=j, rank=self.rank)
            if self.sglang:
                # full buckets at the servers' leaders, kept there: the servers get them after
                # the meeting (``push_received``), so the handoff's bound never counts a
                # server, and a server's restart is the rollout pool's alone
                buckets = hand_off_full(
                    self.cfg.model, t, replica_leaders(r, range(t.world_size, self.world)),
                    plan_params(self.model)[1] if self.train_side else None,
                    bucket_bytes=int(self.cfg.rollout.sglang_bucket_mb * 2**20),
                    traffic=traffic, group=self.handoff_group,
                    device=None if self.train_side else groups.device())
                if self.train_side:
                    for _ in buckets:
                        pass
                else:
                    self.rollout.receive(buckets, traffic)
            else:
                hand_off(self.model, t, r, traffic=traffic, group=self.handoff_group)
            got = torch.tensor([traffic.bytes_received], dtype=torch.int64)
            try:
                dist.all_reduce(got, op=dist.ReduceOp.MAX, group=self.handoff_group)
            except RuntimeError as e:
                raise WeightPlanError(self.rank, "agreeing the bytes received", e) from e
        except WeightPlanError as e:
            raise HandoffFailed(self._handoff_failure(j, e, time.perf_counter() - t0)) from e
        seconds = time.perf_counter() - t0
        if self.sglang and not self.train_side:
            self.rollout.push_received()     # into the servers: the rollout pool's own time
        if self.audit is not None:
            self._audit_weights(j)
        return seconds, int(got.item())

    def _handoff_failure(self, j: int, e: WeightPlanError, seconds: float) -> str:
        """What ``HandoffFailed`` says: the handoff, the step and the limit, the checkpoint a
        rerun resumes from and what it does again, and the fix."""
        n_t, limit = self.pools[0].world_size, self.cfg.cluster.weight_sync_timeout_s
        timed_out = seconds >= 0.9 * limit or "timed out" in str(e).lower()
        what = (f"did not complete within cluster.weight_sync_timeout_s={limit:g} s"
                if timed_out else
                f"failed after {seconds:.1f} s (cluster.weight_sync_timeout_s={limit:g} s)")
        weights = "the start's weights" if j == 0 else f"the weights after iteration {j - 1}"
        saved = self._saved

        def its(first: int, last: int) -> str:
            return f"iteration {first}" if first == last else f"iterations {first}-{last}"

        if saved >= 0:
            again = (f"; it trains {its(saved + 1, j - 1)} again" if saved < j - 1
                     else "; nothing trained is lost")
            resume = (f"the last checkpoint is iteration {saved} "
                      f"({self.out / 'checkpoints' / f'iter_{saved:06d}'}): a rerun "
                      f"(run.resume=true) resumes there{again}")
        else:
            resume = ("no checkpoint was written yet: a rerun starts from iteration 0"
                      + (f" and trains {its(0, j - 1)} again" if j > 0 else ""))
        return (f"split placement: the weight handoff at meeting {j} ({weights}, train pool "
                f"{_ranks(0, n_t)} -> rollout pool {_ranks(n_t, self.world)}) {what}: "
                f"{e}. {resume[0].upper()}{resume[1:]}. Look for a stalled or dead rank (its "
                "log, the other ranks' errors), or raise cluster.weight_sync_timeout_s if the "
                "handoff is only slow (its usual seconds: split.handoff_s in metrics.jsonl)")

    def _checkpoint_split(self, done: int, played: bool) -> None:
        """Checkpoint iteration ``done`` at a meeting (world): the train pool's model and
        optimizer, the episode pool as it was before the stage just played (``played``; else
        as it is), sent by the rollout pool's first rank to rank 0."""
        t, r = self.pools
        n_t = t.world_size
        state = None
        if not self.train_side:
            state = self.pool.state_before() if played else self.pool.state()
        if self.rank == n_t:
            dist.send_object_list([state], dst=0)
        elif self.rank == 0:
            got = [None]
            dist.recv_object_list(got, src=n_t)
            state = got[0]
        loop = {"iteration": done, "layout": str(t), "world_size": self.world,
                "placement": {"train": str(t), "rollout": str(r)},
                "history": self.history, "last_lengths": self.planner.last_lengths,
                "ref_layout": None, "selector": self.planner.state_json(self.planner.state),
                "profile": self.planner.profile_json(), "pool": state}
        save_checkpoint(self.model if self.train_side else None, self.out / "checkpoints", done,
                        loop, keep_last=self.cfg.run.keep_last, tokenizer=self.tok,
                        hf_config=base_hf_config(self.cfg.run.init))
        self._saved = done

    # ------------------------------------------------------------------ the train pool
    def _train_batch(self, it: int, models: ModelPair, ids: list, episodes: list,
                     metrics: dict) -> dict:
        t, r = self.pools
        timer = StageTimer()
        t0 = time.perf_counter()
        # the iteration's seconds on the train pool: the meeting that brought the batch (its
        # wait for the rollout pool, the transfer, the handoff), then the training; their total
        # is the period (plan/split.py), as a colocated iteration's is rollout + training
        meet = metrics["split"]
        for name, key in (("meeting_wait", "train_wait_s"), ("transfer", "transfer_s"),
                          ("handoff", "handoff_s")):
            timer.seconds[name] = meet[key]
        timer.t0 -= meet["train_wait_s"] + meet["transfer_s"] + meet["handoff_s"]
        rec = self.score_and_train(it, models, models.policy, {"rollout": r, "train": t}, ids,
                                   episodes, metrics, timer, sync=False, train_layout=t)
        self._train_s = sum(rec["seconds"].get(k, 0.0) for k in ("old_logprob", "switch",
                                                                  "train"))
        self._audit_stage("train", it, t0, None, ids=ids, episodes=episodes)
        return rec

    def _finish(self, models: Optional[ModelPair]) -> None:
        cfg = self.cfg
        if self.stop.stopping:
            self.recorder.view.message(
                f"stopped at a safe point after iteration {self._saved}: checkpoint saved, "
                "evaluation skipped; rerun (or the requeued job) resumes there")
        elif cfg.run.iterations and self.train_side:
            self._evaluate_into("end", models)
        self.recorder.finish()
        if self.stop.stopping:
            self.stop.mark_stopped(self._saved)

    # ------------------------------------------------------------------ audit (tests)
    def _audit_write(self, row: dict) -> None:
        if self.audit is None:
            return
        self.audit.mkdir(parents=True, exist_ok=True)
        with open(self.audit / f"rank{self.rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def _audit_stage(self, side: str, it: int, t0: float, out, *, ids=(), episodes=()) -> None:
        if self.audit is None:
            return
        row = {"side": side, "it": it, "start": t0 + time.time() - time.perf_counter(),
               "end": time.time()}
        if side == "train" and self.model.coords.tp == 0 and self.model.coords.pp == 0:
            row["digests"] = sorted(_digest(e) for e in episodes)
            row["ids"] = list(ids)
        self._audit_write(row)

    def _audit_sent(self, j: int, out) -> None:
        if self.audit is None or out is None or not self.pool.leader:
            return
        self._audit_write({"side": "sent", "it": j, "keys": [list(k) for k in out.keys],
                           "digests": sorted(_digest(e) for e in out.episodes),
                           "dropped": out.metrics.get("pool_dropped", 0)})

    def _audit_weights(self, j: int) -> None:
        """Each pool's full weights, gathered inside the pool, hashed by its first rank. With
        SGLang the train pool hashes them under HF names and each server's leader hashes what
        its server holds, read back by name (/get_weights_by_name), as float32."""
        from earl_megatron.weights.gather import gather_full
        from earl_megatron.weights.hf_mapping import to_hf

        if self.sglang and not self.train_side:
            engine = self.rollout.engine
            if engine is not None:
                held = {name: torch.tensor(engine.weights_by_name(name, t.shape[0]),
                                           dtype=torch.float32)
                        for bucket in self.rollout.last_push for name, t in bucket}
                self._audit_write({"side": "weights", "it": j, "pool": "rollout",
                                   "sha256": _weights_digest(held), "names": len(held)})
            return
        full = gather_full(self.model.model, self.model.cfg, self.model.layout)
        if groups.pool_rank() == 0:
            if self.sglang:
                full = {name: t.float() for name, t in to_hf(self.cfg.model, full).items()}
            self._audit_write({"side": "weights", "it": j,
                               "pool": "train" if self.train_side else "rollout",
                               "sha256": _weights_digest(full), "names": len(full)})


def _weights_digest(named: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(named):
        h.update(name.encode())
        h.update(named[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _ranks(first: int, end: int) -> str:
    return f"rank {first}" if end - first == 1 else f"ranks {first}-{end - 1}"


def _digest(e) -> str:
    """An episode's identity for the audit: its tokens, mask, logprobs and versions."""
    return hashlib.sha256(repr((e.token_ids, e.loss_mask, e.logprobs, e.versions))
                          .encode()).hexdigest()[:20]
