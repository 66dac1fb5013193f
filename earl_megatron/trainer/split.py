"""Split placement (``rollout.placement=split|auto``): a rollout pool plays while a train pool
trains.

The world is two pools (plan/split.py, runtime/groups.py ``build_pool_groups``): the train pool,
ranks ``0 .. n_t - 1``, scoring in ``layout.logprob`` and training in ``layout.train``, holds
the policy and its optimizer; the rollout
pool, the last ``rollout.pool_ranks`` ranks in ``layout.rollout``, holds a copy of the weights
without an optimizer and plays the episode pool (trainer/episode_pool.py). Each pool is SPMD
inside itself, on its own Megatron-Core groups, and the two touch only at one meeting per
iteration, where every rank of the world calls the same collectives in the same order:

    ROLLOUT POOL                                   TRAIN POOL
    stage j: play under the weights it holds       train B_{j-1}: switch to LOGPROB, re-score
      (version v_j-1 after the first meeting)        [reference], advantages, switch to TRAIN,
                                                     one optimizer step -> v_j; record it
    ============================ meeting j (the world) ==============================
      1 agree       one all_gather_object: stop? (a signal, the stop file, an abandoned
                    stage), the stage's metrics and seconds, the packed batch's sizes
      2 checkpoint  when due (periodic, the last, a stop): iteration j-1, weights v_j, the
                    episode pool as it was before stage j (its leader sends it to rank 0)
      3 episodes    B_j, rollout replicas -> the train pool's LOGPROB replicas, point to
                    point, one dispatch
                    (runtime/episode_transfer.py; its metadata came with the agreement)
      4 weights     v_j, train pool (its TRAIN shards) -> rollout pool, point to point by
                    the weight plan (runtime/weight_transfer.py ``hand_off``)
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

The loop is trainer/loop.py's (lag 1: meeting ``iterations`` saves the last step); the handoff,
on a group of its own bounded by ``cluster.weight_sync_timeout_s``, is trainer/handoff.py's.

Planned splits (``rollout.placement=auto``, or ``split`` with ``layout.mode=auto``): the pools'
sizes and layouts are the selector's (trainer/auto.py; auto weighs the colocated placement
too), planned at the start and, before every meeting, by rank 0 from the step it just trained
and the stage the meeting before measured (decoding apart from the environments' time); the
others follow its plan. A move rewinds the stage just played, checkpoints iteration j-1 and has
every rank build its side of the new placement from that checkpoint (dist_checkpointing
reshards the train state); the loop goes on from stage j. tests/distributed/
test_split_trainer.py forces moves (split to split, split to colocated and back) and checks
exactly once.

The train pool's two layouts (as the colocated loop's stages, trainer/stages.py): its policy
switches TRAIN -> LOGPROB -> TRAIN every iteration in memory (runtime/switcher.py, weights and
Adam state), on the pool alone while the rollout pool plays: a layout's groups are made by the
pool's ranks (``use_local_synchronization``, runtime/groups.py ``local``) and cached, so a
switch needs no other rank. Fixed: ``layout.logprob`` / ``layout.train``; planned: the plan's
``logprob`` / ``train`` (the logprob one may change at any meeting without a move). Records:
``layouts`` rollout / logprob / train; ``seconds`` ``plan+switch`` (to LOGPROB) and ``switch``
(to TRAIN). tests/distributed/test_split_layout_switch.py: the numbers equal a run that scores
in TRAIN's layout (1e-5).

KL on: the train pool holds the frozen reference in its LOGPROB layout, the one stage that reads
it (the initial policy, or the warmed one after a warm start). A warm start (``sft.steps``) runs
on the whole world before the pools split, and its last checkpoint is loaded into the train
pool (trainer/split_sides.py). tests/distributed/test_split_compose.py.

``rollout.engine=sglang``: the rollout pool holds no model (``PoolSeat``); each of its replicas
leads one SGLang server (trainer/sglang_rollout.py with ``ranks=`` the pool). Step 4 then
assembles full buckets at the leaders from the train pool's shards (``hand_off_full``), which
push them into their servers after the meeting, outside the handoff's bound: a server's death
or restart is the rollout pool's time, within the engine's restart budget.
tests/sglang/test_split_sglang.py.

Under a planned placement a move restarts the servers on the new rollout pool (trainer/auto.py).
Not here yet (docs/async.md): moves in memory rather than through a checkpoint.
"""

from __future__ import annotations

import time
from typing import Optional

import torch.distributed as dist

from earl_megatron.config.train import ConfigError
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.rollout_rules import rollout_layout_problem
from earl_megatron.plan.split import MeasuredRates, SplitPlan, env_seconds
from earl_megatron.rollout.agent_loop import RolloutAbandoned
from earl_megatron.runtime.build import ModelOnLayout
from earl_megatron.runtime.episode_transfer import block_sizes, pack_block, \
    transfer_episodes
from earl_megatron.seeds import rollout_sample_seed
from earl_megatron.trainer.audit import RunAudit
from earl_megatron.trainer.critic import critic_saver
from earl_megatron.trainer.handoff import Handoff, HandoffFailed, ranks_text
from earl_megatron.trainer.loop import LoopState, Meeting
from earl_megatron.trainer.model_pair import ModelPair
from earl_megatron.trainer.record import StageTimer
from earl_megatron.trainer.split_sides import (build_sides, split_logprob_layout, split_pools,
                                              warm_start_before_split)

__all__ = ["HandoffFailed", "Split", "split_pools"]


class Split:
    """Split placement of ``trainer`` (module docstring): the rollout pool plays, the train pool
    runs ``Trainer.score_and_train`` on the batch before, unchanged; they meet once per
    iteration (``meet``)."""

    lag = 1

    def __init__(self, trainer, auto=None):
        self.tr = tr = trainer
        cfg = tr.cfg
        self.auto = auto
        """rollout.placement=auto (trainer/auto.py): its plan is this split's; None: fixed."""
        self.sglang = cfg.rollout.engine == "sglang"
        """The rollout pool runs SGLang servers (each replica's first rank leads one) and
        holds no model; the train pool evaluates with the embedded engine."""
        self.pools: Optional[tuple[ParallelLayout, ParallelLayout]] = \
            None if self.auto else split_pools(cfg, tr.world)
        self.train_side = self.pools is not None and tr.rank < self.pools[0].world_size
        self.logprob: Optional[ParallelLayout] = \
            None if self.auto else split_logprob_layout(cfg, tr.world)
        """The train pool's LOGPROB layout (its TRAIN one is ``pools[0]``): where the batch
        arrives and is scored; the policy switches to it and back every iteration."""
        if self.auto is not None:
            self._use(self.auto.plan)
        self.model: Optional[ModelOnLayout] = None
        """This rank's model: the policy with its optimizer (train pool), or the rollout copy."""
        self.models: Optional[ModelPair] = None
        self._train_s = 0.0
        """Train pool: the seconds its last step took (scoring and training), for auto's rates."""
        self._last_rollout: dict = {"rollout_s": 0.0, "metrics": {}}
        """What the rollout pool's first rank said at the last meeting (auto's rates)."""
        self.seg_start = 0
        """The iteration the current pools started from (their first handoff)."""
        self.held = 0
        """The version the rollout pool's weights are (train steps in them)."""
        if auto is not None and auto.handoff is None:
            auto.handoff = Handoff(tr.rank, tr.world, cfg.cluster.weight_sync_timeout_s)
        self.handoff = auto.handoff if auto is not None else \
            Handoff(tr.rank, tr.world, cfg.cluster.weight_sync_timeout_s)
        self.audit = RunAudit.from_env(tr.rank)

    @property
    def trains(self) -> bool:
        return self.train_side

    @property
    def split_plan(self) -> Optional[SplitPlan]:
        """auto: the split in force and why (plan/split.py); None: a fixed split."""
        return self.auto.plan if self.auto is not None else None

    def planned_world(self) -> int:
        """Ranks the stage planner lays out: the train pool's (auto: the world's)."""
        return self.tr.world if self.pools is None else self.pools[0].world_size

    # ------------------------------------------------------------------ the pools
    def _use(self, plan: SplitPlan) -> None:
        """Take ``plan``'s pools (auto): this rank's side and its pool's stage planner."""
        train, rollout = plan.train.layout, plan.rollout.layout
        for lay in (plan.logprob.layout, train):
            if lay.cp > 1:
                raise ConfigError(f"the split's train pool layout {lay} has cp > 1, which the "
                                  "train pool does not run yet (it holds each replica's "
                                  "episodes whole); set layout.max_cp=1")
        problem = rollout_layout_problem(rollout, self.tr.cfg.rollout.engine)
        if problem:
            raise ConfigError(f"the split's rollout layout {rollout}: {problem}")
        self.pools, self.logprob = (train, rollout), plan.logprob.layout
        self.train_side = self.tr.rank < train.world_size
        self.tr.planner = self.tr.make_planner(train.world_size, servers_here=False)

    # ------------------------------------------------------------------ the run
    def start(self) -> tuple[int, list[str]]:
        """Each pool's model, from the newest checkpoint if any (``_start``)."""
        start, pool_state, messages = self._start()
        if pool_state and not self.train_side:
            self.tr.pool.restore(pool_state)
        return start, messages + [self.describe()]

    def describe(self) -> str:
        t, r = self.pools
        lays = f"{t}" if self.logprob == t else f"{self.logprob} (logprob) -> {t} (train)"
        line = (f"split placement: train pool {ranks_text(0, t.world_size)} in {lays}, rollout "
                f"pool {ranks_text(t.world_size, self.tr.world)} in {r}")
        return line + (f" ({self.split_plan.reason})" if self.split_plan else "")

    def _start(self, *, moved: bool = False) -> tuple[int, Optional[dict], list[str]]:
        return build_sides(self, moved=moved)

    def warm_start(self) -> bool:
        return warm_start_before_split(self)

    def begin(self, j: int, evaluate: bool) -> None:
        """The current pools start at iteration ``j``: the start's evaluation on the train
        pool (the rollout pool waits at the handoff), then the weights the train pool holds
        handed to the rollout pool (version ``j``)."""
        if self.tr.pool is not None:     # the run's bound (auto's colocated plan runs at 0)
            self.tr.pool.k = self.tr.cfg.algorithm.max_staleness
        if evaluate and self.train_side:
            self.tr.evaluate_into("start", self.models)
        self.handoff.run(self, j, first=True)
        self.seg_start = self.held = j

    def play(self, j: int):
        """Rollout pool: stage j under the weights it holds; (outcome or None, abandoned,
        seconds); the train pool plays nothing."""
        tr = self.tr
        out, abandoned, seconds = None, False, 0.0
        if self.train_side or tr.stop.stopping:
            return out, abandoned, seconds
        t0 = time.perf_counter()
        try:
            out = tr.rollout.play_pool(
                self.model, tr.pool, j, version=self.held,
                sample_seed=rollout_sample_seed(tr.cfg.run.seed, j),
                should_stop=tr.stop.replica_should_stop, time_decode=True)
        except RolloutAbandoned:
            abandoned = True
        seconds = time.perf_counter() - t0
        if self.sglang and out is not None:
            out.metrics.update(tr.rollout.metrics())  # the servers, their pushes
        self.audit.stage(self.model, "rollout", j, t0)
        return out, abandoned, seconds

    def after_train(self, j: int) -> bool:
        return False   # the pools agree on stopping and checkpoint at their meetings

    def save_completed(self) -> None:
        pass           # a stop is agreed at a meeting, which saved the last trained step

    # ------------------------------------------------------------------ the meeting
    def meet(self, j: int, played) -> Meeting:
        """Meeting j (module docstring), every rank of the world: the batch B_j on the train
        pool; a stop or the run's end; a move (auto: iteration j - 1 checkpointed, stage j to
        play again on the new pools)."""
        out, abandoned, rollout_seconds = played if played is not None else (None, False, 0.0)
        start = self.seg_start
        cfg, (t, r) = self.tr.cfg, self.pools
        n_t, n = t.world_size, cfg.run.iterations
        arrived = time.perf_counter()
        mine = {"stop": self.tr.stop.local() or abandoned, "played": out is not None,
                "metrics": out.metrics if out is not None else {},
                "rollout_s": rollout_seconds}
        # the batch packed before the agreement, which carries its sizes: the transfer after it
        # needs no metadata exchange of its own (the meeting is on the rollout's critical path)
        packed: dict = {}
        try:
            packed = pack_block(out.ids, out.episodes) if out is not None else {}
        except ValueError as e:   # said at the agreement: every rank raises, none hangs
            mine["error"] = f"rank {self.tr.rank}: {e}"
        mine["sizes"] = block_sizes(packed)
        if self.tr.rank == 0 and self.auto and j > start:
            # auto's decision, made on rank 0 before the meeting (while it would wait) from the
            # step it just trained and the stage the meeting before measured; every rank
            # follows it
            mine["plan"] = self.auto.replan_or_keep(lambda: self._replan(self._last_rollout))
        everyone: list = [None] * self.tr.world
        dist.all_gather_object(everyone, mine)
        wait = time.perf_counter() - arrived
        errors = [e["error"] for e in everyone if "error" in e]
        if errors:
            raise RuntimeError(f"split placement, meeting {j}: the batch cannot be handed over: "
                               + "; ".join(errors))
        stop = self.tr.stop.agree(any(e["stop"] for e in everyone))
        played = everyone[n_t]["played"]
        self._last_rollout = everyone[n_t]
        if not self.train_side and played != (out is not None):
            raise RuntimeError(f"rank {self.tr.rank}: rollout stage {j} played on some rollout "
                               "ranks only")
        done = j - 1
        if j > start and self.tr.checkpoint_due(done, stop):
            if not self.train_side and stop and played:
                self.tr.pool.rewind()
            self._checkpoint_split(done, played and not stop)
        if stop:
            if not self.train_side and played and self.tr.saved != done:
                self.tr.pool.rewind()
            return Meeting(stop=True)
        if j == n:
            return Meeting(end=True)
        if self.auto and j > start:
            plan = everyone[0]["plan"]
            if plan.colocated or (plan.train.layout, plan.rollout.layout) != self.pools:
                if not self.train_side:
                    self.tr.pool.rewind()        # stage j plays again on the new pools
                if self.tr.saved != done:
                    self._checkpoint_split(done, played=False)
                return Meeting(move=plan)
            self.auto.plan, self.logprob = plan, plan.logprob.layout   # the plan's LOGPROB
        with_timer = time.perf_counter()
        # to the layout of the stage that reads them first: LOGPROB (the policy is in TRAIN's
        # until the handoff below has read its shards)
        ids, episodes = transfer_episodes(self.logprob, r, packed,
                                          group_size=cfg.algorithm.group_size,
                                          sizes=[e["sizes"] for e in everyone])
        transfer_s = time.perf_counter() - with_timer
        self.audit.sent(self.tr.pool, j, out)
        handoff_s, handoff_bytes = self.handoff.run(self, j) if j > start else (0.0, 0)
        self.held = j
        split = {"rollout_s": everyone[n_t]["rollout_s"], "train_wait_s": wait,
                 "transfer_s": transfer_s, "handoff_s": handoff_s,
                 "handoff_bytes": handoff_bytes, "rollout_ranks": r.world_size}
        if self.split_plan is not None:
            split["plan"] = self.split_plan.reason
        if not self.train_side:
            return Meeting()
        return Meeting(batch=(ids, episodes, {**everyone[n_t]["metrics"], "split": split}))

    def _replan(self, rollout0: dict) -> SplitPlan:
        """auto, on rank 0 before meeting j: the split for the last batch's lengths and the
        seconds the two pools measured (step j-1's scoring and training, here; stage j-1's
        rollout, ``rollout0``: what the rollout pool's first rank said at meeting j-1)."""
        lengths, stage = self.tr.planner.last_lengths, rollout0["rollout_s"]
        rates, env = None, 0.0
        if lengths and self._train_s > 0 and stage > 0:
            tokens = sum(lengths)
            rates = MeasuredRates(self.pools[1].world_size, stage, tokens, self._train_s,
                                  tokens)
            env = env_seconds(stage, rollout0["metrics"])
        return self.auto.propose(lengths, rates, env)

    def moved_in(self) -> None:
        """auto moved the run here: every rank builds its side's model and loads the checkpoint
        just written (dist_checkpointing reshards the train state onto the train pool); the
        rollout pool restores the episode pool from it."""
        _, pool_state, _ = self._start(moved=True)
        if pool_state and not self.train_side:
            self.tr.pool.restore(pool_state)

    def release(self) -> None:
        """auto leaves these pools: their models go before the next placement's are built."""
        self.model = self.models = None

    def _checkpoint_split(self, done: int, played: bool) -> None:
        """Checkpoint iteration ``done`` at a meeting (world): the train pool's model and
        optimizer, the episode pool as it was before the stage just played (``played``; else
        as it is), sent by the rollout pool's first rank to rank 0."""
        t, r = self.pools
        n_t = t.world_size
        state = None
        if not self.train_side:
            state = self.tr.pool.state_before() if played else self.tr.pool.state()
        if self.tr.rank == n_t:
            dist.send_object_list([state], dst=0)
        elif self.tr.rank == 0:
            got = [None]
            dist.recv_object_list(got, src=n_t)
            state = got[0]
        self.tr.write_checkpoint(self.model if self.train_side else None, LoopState(
            iteration=done, layout=str(t), world_size=self.tr.world, history=self.tr.history,
            last_lengths=self.tr.planner.last_lengths,
            selector=self.tr.planner.state_json(self.tr.planner.state),
            profile=self.tr.planner.profile_json(), pool=state,
            placement={"train": str(t), "rollout": str(r)}),
            also=critic_saver(self.models, joins=self.tr.cfg.algorithm.name == "ppo"))

    # ------------------------------------------------------------------ the train pool
    def train(self, it: int, batch: tuple) -> dict:
        """Train pool: batch ``it`` (ids, episodes, the meeting's metrics; held by LOGPROB's
        replicas), scored in the pool's LOGPROB layout and trained in its TRAIN one, the policy
        switched from TRAIN to LOGPROB first ("plan+switch", as a colocated iteration's move to
        the layout its batch arrives in) and back ("switch"); its record."""
        ids, episodes, metrics = batch
        models = self.models
        t, r = self.pools
        timer = StageTimer(self.tr.carried)
        t0 = time.perf_counter()
        # the iteration's seconds on the train pool: the meeting that brought the batch (its
        # wait for the rollout pool, the transfer, the handoff), then the training; their total
        # is the period (plan/split.py), as a colocated iteration's is rollout + training
        meet = metrics["split"]
        for name, key in (("meeting_wait", "train_wait_s"), ("transfer", "transfer_s"),
                          ("handoff", "handoff_s")):
            timer.seconds[name] = meet[key]
        timer.t0 -= meet["train_wait_s"] + meet["transfer_s"] + meet["handoff_s"]
        with timer("plan+switch"):   # inside the pool, while the rollout pool plays
            policy = models.policy_in(self.logprob)
        rec = self.tr.score_and_train(it, models, policy,
                                      {"rollout": r, "logprob": self.logprob, "train": t}, ids,
                                      episodes, metrics, timer, sync=False, train_layout=t,
                                      logprob_layout=self.logprob)
        self.model = models.policy_in(t)   # TRAIN's groups current: the handoff reads its
        # shards (ppo's critic step ran last, in the same layout)
        self._train_s = sum(rec["seconds"].get(k, 0.0) for k in (
            "plan+switch", "old_logprob", "logprob", "switch", "train"))
        # the replica that received the block (LOGPROB's) is the one that trained it
        self.audit.stage(policy, "train", it, t0, ids=ids, episodes=episodes)
        return rec

