"""Split placement's plan: how many ranks roll out, how many train, and each pool's layouts.

Pure planning over the selector (plan/selector.py), the time and memory models and the weight
plan; nothing here imports torch.

Pools. A split of the world's N ranks is a train pool, ranks ``0 .. n_t - 1``, and a rollout pool,
ranks ``n_t .. N - 1`` (the train pool first: the weight plan reads source shards from ranks
``0 .. src.world_size - 1``). The pools run at once: the rollout pool plays the next batch while
the train pool scores (LOGPROB) and trains (TRAIN) this one, and after every train step the new
weights go to the rollout pool by the weight plan (``ShardsIn`` the rollout layout's ranks for the
embedded engine, ``FullAt`` every replica's leader for servers). Each pool's layouts are the
selector's choice on a cluster of the pool's size (``pool_cluster``: the same devices, fewer of
them). The rollout pool holds no optimizer state (no ``resident_bytes``).

Time of one iteration in steady state (asynchronous, k >= 1)::

    period = max(rollout_s, logprob_s + train_s) + handoff_s

with ``rollout_s`` the ROLLOUT stage's seconds plus ``SplitWorkload.env_seconds`` (tool and game
time that more ranks do not shorten) and ``handoff_s`` the weight plan's seconds on the link
model (``weight_plan.transfer_seconds``), counted once on the critical path (an upper bound: it
may overlap the next rollout). The colocated synchronous iteration on all N ranks is the sum of
its stages, switches included (a ``SplitPlan`` with ``rollout_ranks`` 0, "colocated"), so a split
can at best halve it, when the two sides balance.

Rates (``MeasuredRates``): the seconds each side took in the last iteration correct the model
per side: factor = measured / predicted for the split that ran, applied to every candidate's
prediction of that side (the profile table's idea, kept per run). The rates per rank
(tokens / s / rank) are what the reasons print.

Choosing (``plan_split``): colocated and every rollout-pool size in ``split_choices`` (whole
nodes when the cluster has several, else any count of one node's devices) whose two pools both
have a fitting layout; the least period wins, ties to the smaller rollout pool (colocated
first). Hysteresis: the current split (``current``) is kept unless the best period plus the
cost of moving ranks between pools (``move_seconds``, or the last move's measured seconds when
more), spread over the iterations left, is below the current period by more than
``hysteresis``; every plan carries its reason, as the selector's do.

A colocated first stage, before anything trains (trainer/auto.py), measures its rollout and a
scoring forward; ``scored_rates`` turns them into rates for both sides.

Invariants (tests/unit/test_split_plan.py): both pools together are exactly the world; every
layout is valid for its pool's size and fits its pool's budget; equal inputs give equal plans;
a fixed split returns that split or raises SplitDoesNotFitError naming the pool that does not
fit and what would (the selector's NoLayoutFitsError).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from earl_megatron.plan.critic_memory import beside_critic
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.memory_model import train_state_bytes
from earl_megatron.plan.selector import LayoutPlan, NoLayoutFitsError, Selector, SelectorState
from earl_megatron.plan.server_restart import restart_seconds, server_switch_seconds
from earl_megatron.plan.specs import ClusterSpec, Stage, StageWorkload
from earl_megatron.plan.weight_plan import FullAt, ShardsIn, plan_weights, transfer_seconds

class SplitDoesNotFitError(RuntimeError):
    """A pool of the split has no layout that fits; the message names the pool and carries the
    selector's NoLayoutFitsError (what would fit)."""


HANDOFF_BUCKET_BYTES = 512 * 2 ** 20
"""Bucket bound the handoff is planned with (its seconds barely depend on it)."""


@dataclass(frozen=True)
class SplitWorkload:
    """One iteration's work: the batch's rollout, scoring and training, and the time the
    environments add to the rollout (tool calls, game opponents) that more ranks do not cut."""

    rollout: StageWorkload
    logprob: StageWorkload
    train: StageWorkload
    env_seconds: float = 0.0
    critic: bool = False
    """ppo: a critic trains beside the policy where the policy trains (the train pool; the
    world when colocated), its train state counted in each candidate's memory
    (plan/critic_memory.py ``beside_critic``)."""

    def __post_init__(self):
        for name, stage in (("rollout", Stage.ROLLOUT), ("logprob", Stage.LOGPROB),
                            ("train", Stage.TRAIN)):
            if getattr(self, name).stage is not stage:
                raise ValueError(f"SplitWorkload.{name} is a {getattr(self, name).stage.value} "
                                 f"workload; give a {stage.value} one")
        if not self.env_seconds >= 0:
            raise ValueError(f"env_seconds must be >= 0, got {self.env_seconds}")


@dataclass(frozen=True)
class MeasuredRates:
    """What the last iteration measured under the split that ran (``rollout_ranks`` of them
    rolling out): each side's seconds and the tokens it processed."""

    rollout_ranks: int
    """0: colocated."""
    rollout_seconds: float
    rollout_tokens: int
    train_seconds: float
    """LOGPROB + TRAIN."""
    train_tokens: int

    def __post_init__(self):
        if self.rollout_ranks < 0 or not (self.rollout_seconds > 0 and self.train_seconds > 0):
            raise ValueError(f"measured rates need rollout_ranks >= 0 and seconds > 0, "
                             f"got {self}")

    def per_rank(self, world: int) -> tuple[float, float]:
        """(rollout, train) tokens / s / rank (colocated: every rank does both)."""
        return (self.rollout_tokens / self.rollout_seconds / (self.rollout_ranks or world),
                self.train_tokens / self.train_seconds / (world - self.rollout_ranks))


def env_seconds(stage_seconds: float, metrics: dict) -> float:
    """What a rollout stage of ``stage_seconds`` spent besides decoding (its tools, games and
    loop: ``metrics["rollout_decode_s"]`` is the decoding), which more ranks do not shorten."""
    return max(0.0, stage_seconds - metrics.get("rollout_decode_s", stage_seconds))


@dataclass(frozen=True)
class SplitPlan:
    rollout_ranks: int
    train_ranks: int
    rollout: LayoutPlan
    logprob: LayoutPlan
    train: LayoutPlan
    rollout_s: float
    """ROLLOUT seconds plus the environments', times the measured factor."""
    train_s: float
    """LOGPROB + TRAIN seconds (switch between them included), times the measured factor."""
    handoff_s: float
    reason: str = ""

    @property
    def colocated(self) -> bool:
        """No split: every rank rolls out, then scores, then trains (rollout_ranks 0)."""
        return self.rollout_ranks == 0

    @property
    def period_s(self) -> float:
        if self.colocated:
            return self.rollout_s + self.train_s
        return max(self.rollout_s, self.train_s) + self.handoff_s

    @property
    def bound_by(self) -> str:
        return "rollout" if self.rollout_s >= self.train_s else "train"

    def describe(self) -> str:
        if self.colocated:
            return (f"colocated on {self.train_ranks} ranks ({self.rollout.layout} -> "
                    f"{self.logprob.layout} -> {self.train.layout}): {self.period_s:.3g} s "
                    f"(rollout {self.rollout_s:.3g} s, train {self.train_s:.3g} s)")
        return (f"{self.rollout_ranks} rollout ({self.rollout.layout}) + {self.train_ranks} "
                f"train ({self.logprob.layout} -> {self.train.layout}): {self.period_s:.3g} s "
                f"(rollout {self.rollout_s:.3g} s, train {self.train_s:.3g} s, handoff "
                f"{self.handoff_s:.3g} s)")


def pool_cluster(cluster: ClusterSpec, ranks: int) -> ClusterSpec:
    """The cluster a pool of ``ranks`` devices plans on: the same devices, fewer of them (whole
    nodes, or part of one)."""
    dpn = cluster.devices_per_node
    if 0 < ranks < dpn and cluster.nodes >= 1:
        return cluster.with_(nodes=1, devices_per_node=ranks)
    if ranks <= 0 or ranks % dpn or ranks > cluster.world_size:
        raise ValueError(f"a pool of {ranks} ranks on {cluster.name}: give part of one node "
                         f"(< {dpn}) or whole nodes (a multiple of {dpn}) below "
                         f"{cluster.world_size}")
    return cluster.with_(nodes=ranks // dpn)


def split_choices(cluster: ClusterSpec) -> tuple[int, ...]:
    """Rollout-pool sizes worth weighing: whole nodes on a multi-node cluster, else every count
    of one node's devices; each leaves the train pool at least one."""
    dpn = cluster.devices_per_node
    if cluster.nodes > 1:
        return tuple(dpn * n for n in range(1, cluster.nodes))
    return tuple(range(1, dpn))


def handoff_seconds(selector: Selector, train: ParallelLayout, rollout: ParallelLayout) -> float:
    """The weight plan's seconds from the train pool's shards (ranks 0 .. n_t - 1) to the
    rollout pool (ranks n_t ..): each replica's leader for servers, each rank's shard else."""
    n_t = train.world_size
    if selector.cluster.decode_engine.servers:
        dests = [FullAt(n_t + r * rollout.tp) for r in range(rollout.dp)]
    else:
        dests = [ShardsIn(rollout, tuple(range(n_t, n_t + rollout.world_size)))]
    plan = plan_weights(selector.model, train, dests, bucket_bytes=HANDOFF_BUCKET_BYTES,
                        world_size=n_t + rollout.world_size,
                        element_bytes=selector.train_opts.param_bytes(selector.model),
                        devices_per_node=selector.cluster.devices_per_node)
    return transfer_seconds(plan, selector.cluster)


def _pools(selector: Selector, workload: SplitWorkload, rollout_ranks: int,
           factors: tuple[float, float], previous: Optional["SplitPlan"]) -> SplitPlan:
    world = selector.cluster.world_size
    n_t = world - rollout_ranks
    state = SelectorState()
    if previous is not None and previous.rollout_ranks == rollout_ranks:
        state = state.with_choice(Stage.ROLLOUT, previous.rollout.layout) \
            .with_choice(Stage.TRAIN, previous.train.layout)
    if rollout_ranks == 0:      # colocated: one pool, the stages in turn, switches counted
        on_rollout = on_train = selector
    else:
        c = pool_cluster(selector.cluster, rollout_ranks)
        if c.decode_engine.servers:     # servers alone on the rollout pool's devices
            c = c.with_(decode_engine=replace(c.decode_engine, beside_trainer=False))
        on_rollout = replace(selector, cluster=c)
        on_train = replace(selector, cluster=pool_cluster(selector.cluster, n_t))
    if workload.critic:
        on_train = beside_critic(on_train)
        on_rollout = on_train if rollout_ranks == 0 else on_rollout
    try:
        rollout, _ = on_rollout.plan(workload.rollout, state=state,
                                     current=state.previous(Stage.ROLLOUT))
    except NoLayoutFitsError as e:
        where = "colocated" if rollout_ranks == 0 else f"the rollout pool of {rollout_ranks} ranks"
        raise SplitDoesNotFitError(f"{where}: {e}") from e
    try:
        # the train pool's live layout at an iteration's start: last iteration's TRAIN one,
        # colocated: this iteration's ROLLOUT one
        live = rollout.layout if rollout_ranks == 0 else state.previous(Stage.TRAIN)
        (logprob, train), _ = on_train.plan_iteration(
            [workload.logprob, workload.train], current=live, state=state)
    except NoLayoutFitsError as e:
        where = "colocated" if rollout_ranks == 0 else f"the train pool of {n_t} ranks"
        raise SplitDoesNotFitError(f"{where}: {e}") from e
    # the period is the steady state: fresh servers' start (no ROLLOUT choice to stay in) is
    # paid once, by the move that starts them (move_seconds), not every iteration
    fresh = server_switch_seconds(selector.model, on_rollout.cluster, None, rollout.layout,
                                  selector.profile, selector.config.server_restart_s,
                                  selector.train_opts) \
        if on_rollout.cluster.decode_engine.servers and \
        state.previous(Stage.ROLLOUT) is None else 0.0
    rollout_s = (rollout.chosen.cost - fresh + workload.env_seconds) * factors[0]
    train_s = (logprob.chosen.cost + train.chosen.cost) * factors[1]
    handoff = 0.0 if rollout_ranks == 0 else handoff_seconds(selector, train.layout,
                                                             rollout.layout)
    return SplitPlan(rollout_ranks, n_t, rollout, logprob, train, rollout_s, train_s, handoff)


def move_seconds(selector: Selector, src: SplitPlan, dst: SplitPlan) -> float:
    """Seconds to move ranks between pools: the train pool's state (weights, grads, optimizer
    shard) re-sharded over its new ranks, each rank receiving its whole new shard at worst over
    its share of the node's network; servers restart on the new rollout ranks, which every move
    changes (the one push into them is small beside a start: plan/server_restart.py). 0 when
    the split is unchanged."""
    if src.rollout_ranks == dst.rollout_ranks:
        return 0.0
    c, m, opts = selector.cluster, selector.model, selector.train_opts
    layout = dst.train.layout
    state = dst.train.chosen.memory.weights + train_state_bytes(m, layout, opts)
    bw = c.inter_node_bandwidth / c.devices_per_node if c.nodes > 1 else c.intra_node_bandwidth
    seconds = c.regroup_seconds + state / bw
    if c.decode_engine.servers:
        seconds += restart_seconds(m, dst.rollout.layout.tp, selector.profile,
                                   selector.config.server_restart_s)
    return seconds


def _factors(selector: Selector, workload: SplitWorkload,
             rates: Optional[MeasuredRates]) -> tuple[float, float]:
    if rates is None:
        return 1.0, 1.0
    ran = _pools(selector, workload, rates.rollout_ranks, (1.0, 1.0), None)
    return rates.rollout_seconds / ran.rollout_s, rates.train_seconds / ran.train_s


def plan_split(selector: Selector, workload: SplitWorkload, *,
               rollout_ranks: Optional[int] = None, rates: Optional[MeasuredRates] = None,
               current: Optional[SplitPlan] = None, hysteresis: Optional[float] = None,
               colocated: bool = True, moved_s: float = 0.0, horizon: int = 1) -> SplitPlan:
    """The split for ``workload``: ``rollout_ranks`` fixed (split placement with the user's
    pool), or the fastest of ``split_choices`` (auto; and colocated unless ``colocated`` is
    False: a run under rollout.placement=auto, whose loop is the split one), kept at
    ``current`` under ``hysteresis`` (default: the selector's). ``rates`` scale each side's
    predictions. A move leaves ``current`` when its seconds (the model's, or ``moved_s``, what
    the last move measured, whichever is more), spread over the ``horizon`` iterations left,
    still leave the best period below the current one by more than the hysteresis."""
    if horizon < 1 or moved_s < 0:
        raise ValueError(f"plan_split needs horizon >= 1 and moved_s >= 0, got {horizon} and "
                         f"{moved_s}")
    factors = _factors(selector, workload, rates)
    if rollout_ranks is not None:
        plan = _pools(selector, workload, rollout_ranks, factors, current)
        what = "colocated" if plan.colocated else "fixed split"
        return replace(plan, reason=f"{what}: {plan.describe()}")
    found, skipped, first = [], [], None
    for n_r in ((0,) if colocated else ()) + split_choices(selector.cluster):
        try:
            found.append(_pools(selector, workload, n_r, factors, current))
        except SplitDoesNotFitError as e:
            skipped.append(n_r)
            first = first or e
    if not found:
        raise SplitDoesNotFitError(f"no split of {selector.cluster.world_size} ranks fits "
                                   f"(rollout pools of {skipped} weighed); the first: "
                                   f"{first}") from first
    ranked = sorted(found, key=lambda p: (p.period_s, p.rollout_ranks))
    best = ranked[0]
    measured = ""
    if rates is not None:
        r, t = rates.per_rank(selector.cluster.world_size)
        measured = (f"; measured {r:.4g} rollout / {t:.4g} train tokens/s/rank (model x "
                    f"{factors[0]:.2f} / x {factors[1]:.2f})")
    h = selector.config.hysteresis if hysteresis is None else hysteresis
    incumbent = next((p for p in found if current is not None
                      and p.rollout_ranks == current.rollout_ranks), None)
    if incumbent is not None and incumbent is not best:
        move = max(move_seconds(selector, incumbent, best), moved_s)
        if best.period_s + move / horizon >= incumbent.period_s * (1 - h):
            return replace(incumbent, reason=(
                f"kept {incumbent.rollout_ranks}/{incumbent.train_ranks}: the best split "
                f"{best.rollout_ranks}/{best.train_ranks} ({best.period_s:.3g} s + move "
                f"{move:.3g} s over {horizon} iterations) is not {100 * h:.0f}% faster than "
                f"{incumbent.period_s:.3g} s" + measured))
    runner = f"; next {ranked[1].rollout_ranks}/{ranked[1].train_ranks} " \
        f"{ranked[1].period_s:.3g} s" if len(ranked) > 1 else ""
    why = (f"{best.rollout_ranks} rollout / {best.train_ranks} train ranks: fastest of "
           f"{len(found)} splits, {best.bound_by}-bound: {best.describe()}{runner}")
    if skipped:
        why += f"; no fit with {skipped} rollout ranks"
    return replace(best, reason=why + measured)


def scored_rates(selector: Selector, workload: SplitWorkload, rollout_seconds: float,
                 scoring_seconds: float, tokens: int) -> MeasuredRates:
    """What a colocated first stage measured before anything trained: its rollout's seconds
    and a scoring forward over its batch (LOGPROB's work, timed). The train side's seconds are
    the model's colocated LOGPROB + TRAIN scaled by measured / predicted LOGPROB: a train
    step's forward and backward are the same matmuls as scoring's forward, so the hardware's
    offset from the model is the same."""
    ran = _pools(selector, workload, 0, (1.0, 1.0), None)
    predicted = ran.logprob.chosen.cost
    if not (predicted > 0 and scoring_seconds > 0):
        raise ValueError(f"scored rates need a predicted and a measured scoring time > 0, got "
                         f"{predicted} and {scoring_seconds}")
    return MeasuredRates(0, rollout_seconds, tokens, ran.train_s * scoring_seconds / predicted,
                         tokens)

