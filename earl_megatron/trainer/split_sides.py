"""Split placement's two sides: each pool's models built (fresh, from run.init, from a checkpoint,
or after a warm start on the whole world), the KL reference and PPO's critic on the train pool,
and each side's rollout engine. trainer/split.py's ``Split`` calls these with itself as ``split``.

Invariants: every rank of the world calls each function with the same arguments (the model
builds and checkpoint reads are collective over the world; a rank of the other side joins
them); the train pool holds the policy with its optimizer, built in its TRAIN layout, and, KL
on, the frozen reference in its LOGPROB layout (the one stage that reads it), whose groups its
ranks make alone, and, under ppo, the critic in its TRAIN layout; the rollout pool holds a
copy without optimizer (embedded engine) or a seat only (SGLang: its servers hold the
weights).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from earl_megatron.config.train import ConfigError, TrainConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.rollout_rules import rollout_layout_problem
from earl_megatron.runtime import groups
from earl_megatron.runtime.build import ModelOnLayout, build_on_layout, seat_on_layout
from earl_megatron.runtime.checkpoint import load_checkpoint
from earl_megatron.runtime.checkpoint_files import find_checkpoint
from earl_megatron.trainer import segments
from earl_megatron.trainer.model_pair import ModelPair


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
    logprob = parse("logprob", cfg.layout.logprob, n_t)
    rollout = parse("rollout", cfg.layout.rollout, n_r)
    problem = rollout_layout_problem(rollout, cfg.rollout.engine)
    if problem:
        raise ConfigError(f"layout.rollout={rollout}: {problem}")
    for stage, lay in (("logprob", logprob), ("train", train)):
        if lay.cp > 1:
            raise ConfigError(f"layout.{stage}={lay}: the train pool holds each replica's "
                              "episodes whole, which cp > 1 does not yet; use tp, pp or dp "
                              "there")
    episodes, g = cfg.rollout.episodes_per_iteration, cfg.algorithm.group_size
    if episodes // g < max(train.dp, logprob.dp, rollout.dp):
        raise ConfigError(f"rollout.episodes_per_iteration={episodes} is {episodes // g} groups "
                          f"of {g}: fewer than the train pool's {max(train.dp, logprob.dp)} or "
                          f"the rollout pool's {rollout.dp} replicas; raise it")
    return train, rollout


def split_logprob_layout(cfg: TrainConfig, world: int) -> ParallelLayout:
    """A fixed split's LOGPROB layout on the train pool (``layout.logprob``; checked by
    ``split_pools``): where the batch arrives, is re-scored (and KL on, scored by the
    reference) before the policy switches to ``layout.train``."""
    train, _ = split_pools(cfg, world)
    return ParallelLayout.parse(cfg.layout.logprob, world_size=train.world_size, model=cfg.model)



def build_sides(split, *, moved: bool = False) -> tuple[int, Optional[dict], list[str]]:
    """Build each pool's model and load the newest checkpoint, if any: (first iteration, the
    episode pool it held, lines for the live view). auto plans the pools first (from the
    checkpoint's lengths); ``moved``: the pools were just re-planned and the checkpoint
    written, in this process."""
    cfg = split.tr.cfg
    if not cfg.run.resume and not moved:
        refused = segments.earlier_run(split.tr.out)
        if refused is not None:
            raise ConfigError(refused)
    found = find_checkpoint(split.tr.out / "checkpoints") if cfg.run.resume or moved else None
    if found is not None and (found.state.get("world_size") != split.tr.world or
                              not (found.state.get("placement") or split.auto)):
        raise ConfigError(
            f"{found.path} was written under placement "
            f"{found.state.get('placement') or 'colocated'} on "
            f"{found.state.get('world_size')} ranks: resume split placement on the same "
            "world size, or start a new run from it with run.init")
    t, r = split.pools
    placement = {"train": str(t), "rollout": str(r)}
    if found is not None and not split.auto and found.state["placement"] != placement:
        raise ConfigError(
            f"{found.path} was written with pools {found.state['placement']}, not "
            f"{placement}: resume with the pools it was written with (or "
            "rollout.placement=auto, which plans its own), or start a new run from it "
            "with run.init")
    lay = t if split.train_side else r
    spec = split.tr.optimizer if split.train_side else None
    split.model = split.models = None     # a move: the old pools' models go first
    if cfg.run.init and split.train_side and found is None:
        from earl_megatron.weights.convert import load_policy
        model = load_policy(cfg.run.init, lay, ddp=True, optimizer=spec,
                            seed=cfg.run.seed, pools=split.pools)
    elif split.sglang and not split.train_side:   # the servers hold the weights
        model = seat_on_layout(cfg.model, lay, seed=cfg.run.seed, pools=split.pools)
        if cfg.run.init and found is None:
            from earl_megatron.weights.convert import join_policy_load
            join_policy_load(cfg.run.init)
    else:   # the rollout pool's weights come from the train pool at the first handoff
        model = build_on_layout(cfg.model, lay, ddp=split.train_side, optimizer=spec,
                                seed=cfg.run.seed, pools=split.pools,
                                init=None if split.train_side else False)
        if cfg.run.init and found is None:
            from earl_megatron.weights.convert import join_policy_load
            join_policy_load(cfg.run.init)
    split.model = model
    ref = reference_on(split)
    split.models = ModelPair(model, ref, pools=split.pools,
                             live="policy" if ref is None else "reference") \
        if split.train_side else None
    # ppo on a fresh run with a warm start: the critic comes from the warmed policy
    # (warm_start_before_split); a critic.init's trunk is the init's either way
    critic = not (found is None and cfg.sft.steps and not cfg.algorithm.critic.init) and \
        critic_on(split, resuming=found is not None)
    if split.models is not None:
        split.model = split.models.policy_in(t)   # the policy's groups current again
    if split.sglang:
        sglang_side(split)
    if found is None:
        return 0, None, []
    state = found.state
    load_checkpoint(split.model if split.train_side else None, found.path)
    if critic:
        from earl_megatron.trainer.critic import load_critic
        models = split.models
        load_critic(models.critic_in(t) if models is not None else None, found.path)
        if models is not None:
            split.model = models.policy_in(t)
    # the selector state is per pool layout and the pools may differ: lengths and profile
    split.tr.planner.restore([], state["last_lengths"], state.get("profile"))
    split.tr.history[:] = state["history"]
    split.tr.saved = state["iteration"]
    if cfg.sft.steps and split.tr.kl_on:   # an RL checkpoint: the warm start ran before it
        warmed_reference(split)
    if moved:
        return state["iteration"] + 1, state.get("pool"), []
    notes = [m for m in (found.message(),) if m is not None]
    return state["iteration"] + 1, state.get("pool"), notes + [
        f"resumed from {found.path} at iteration {state['iteration'] + 1}"]


def reference_on(split) -> Optional[ModelOnLayout]:
    """KL on: the frozen reference on the train pool, in its LOGPROB layout (the initial
    policy: run.init or the seed's init, as under colocated placement; never checkpointed),
    its groups made by the pool's ranks alone; the rollout pool joins the collective read of a
    checkpoint. None otherwise."""
    cfg = split.tr.cfg
    if not split.tr.kl_on:
        return None
    if not split.train_side:
        if cfg.run.init:
            from earl_megatron.weights.convert import join_policy_load
            join_policy_load(cfg.run.init)
        return None
    lay = split.logprob
    pools = (lay, split.pools[1])
    groups.build_pool_groups(pools, cfg.model, local=True)   # then a cache hit in the build
    if cfg.run.init:
        from earl_megatron.weights.convert import load_policy
        return load_policy(cfg.run.init, lay, ddp=False, seed=cfg.run.seed, pools=pools)
    return build_on_layout(cfg.model, lay, ddp=False, seed=cfg.run.seed, pools=pools,
                           local=True)


def critic_on(split, resuming: bool = False) -> bool:
    """ppo: the critic on the train pool, in its TRAIN layout (the pools' first; the stage
    planner counts it there), from the policy just built or algorithm.critic.init; the rollout
    pool joins the collective read of a converted init; ``resuming``: built to be loaded from
    the checkpoint (build_critic). False: no critic (another estimator)."""
    from earl_megatron.trainer.critic import build_critic

    tr = split.tr
    if tr.cfg.algorithm.name != "ppo":
        return False
    t = split.pools[0]
    models = split.models
    critic = build_critic(tr.cfg, models.policy_in(t) if models is not None else None, t,
                          pools=split.pools, resuming=resuming)
    if models is not None:
        tr.planner.critic_layout = t
        models.add_critic(critic)
    return True


def sglang_side(split) -> None:
    """engine=sglang: this rank's rollout, for its side of the current pools. The rollout
    pool's ranks drive the servers (started at the first handoff, on the pool's group); the
    train pool evaluates with the embedded engine, its devices holding no server."""
    if split.tr.rollout is not None:
        split.tr.rollout.close()   # a rank's servers of earlier pools stop
    if split.train_side:
        split.tr.rollout = split.tr.make_rollout("embedded")
    else:
        split.tr.rollout = split.tr.make_rollout(
            "sglang", ranks=range(split.pools[0].world_size, split.tr.world),
            ranks_group=groups.pool_group(), weights="handoff")

def warm_start_before_split(split) -> bool:
    """The warm start before the pools split: the world's policy, laid out by the selector
    over the whole world (trainer/warm_start.py, resumed from its own checkpoint), then its
    last checkpoint (weights and Adam state) loaded into the train pool's policy, resharded
    by dist_checkpointing; KL on: into the reference too; ppo: the critic built from it. The
    rollout pool's weights come at the first handoff, as always. False: told to stop (the
    warm start checkpointed)."""
    from earl_megatron.trainer.model_pair import build_model_pair
    from earl_megatron.trainer.sft import set_lr
    from earl_megatron.trainer.warm_start import warm_start_state

    tr, cfg = split.tr, split.tr.cfg
    planner = tr.make_planner(tr.world, servers_here=False,
                              layout=replace(cfg.layout, mode="auto"))
    warm = warm_start_state(tr.out) if cfg.run.resume else None
    if warm is not None:   # killed during the warm start: it goes on from its checkpoint
        lay = ParallelLayout.parse(warm["layout"], world_size=tr.world, model=cfg.model)
    else:
        lay = planner.plan("rollout", planner.rollout_lengths(), None)
    world = build_model_pair(cfg.model, lay, None, optimizer=tr.optimizer,
                             seed=cfg.run.seed, init=cfg.run.init)
    if warm is not None:
        load_checkpoint(world.policy, warm["path"])
        tr.sft_start, tr.sft_history = warm["sft_step"] + 1, warm["sft_history"]
    done = tr.warm_start(world, planner)
    del world
    groups.build_pool_groups(split.pools, cfg.model)   # the pools' groups current again
    if not done:
        return False
    path = warm_start_state(tr.out)["path"]
    load_checkpoint(split.model if split.train_side else None, path)
    if split.train_side:
        set_lr(split.model.optimizer, cfg.algorithm.lr)
    if not cfg.algorithm.critic.init and critic_on(split) and split.models is not None:
        split.model = split.models.policy_in(split.pools[0])   # ppo: from the warmed policy
    if tr.kl_on:
        warmed_reference(split)
    return True


def warmed_reference(split) -> None:
    """KL after a warm start: the train pool's reference loads the warmed policy in its LOGPROB
    layout (the rollout pool joins the collective read), then the policy's groups are current
    again."""
    models = split.models
    split.tr.warmed_reference(models.reference_in(split.logprob) if models else None)
    if models is not None:
        split.model = models.policy_in(split.pools[0])

