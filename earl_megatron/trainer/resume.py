"""Where a run starts: the newest complete checkpoint (RL, else the warm start's), or fresh.

    run.resume and an RL checkpoint     its weights, optimizer, selector state and history;
                                        iteration i's seeds depend only on (run.seed, i), so the
                                        resumed run replays what one that never stopped played
        ... of another world size       layouts planned anew (auto) or the config's (static), the
                                        selector state reset (trainer/segments.py); the
                                        checkpoint reshards on load
    run.resume and a warm-start one     the warm start continues at its next step
    otherwise                           a fresh policy in the first ROLLOUT plan's layout
                                        (run.resume=false refuses a folder holding a run)

A damaged newer checkpoint is skipped with a line saying so (runtime/checkpoint_files.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from earl_megatron.config.train import ConfigError, TrainConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.runtime.build import OptimizerSpec
from earl_megatron.runtime.checkpoint import load_checkpoint
from earl_megatron.runtime.checkpoint_files import find_checkpoint
from earl_megatron.trainer import segments
from earl_megatron.trainer.model_pair import ModelPair, build_model_pair
from earl_megatron.trainer.planner import StagePlanner


@dataclass
class Start:
    """What the trainer starts from."""

    iteration: int
    """The first RL iteration to run."""
    models: ModelPair
    messages: list[str]
    """Lines for the live view (resumed from..., skipped a damaged checkpoint...)."""
    history: list[dict] = field(default_factory=list)
    """The records of the iterations already run."""
    saved: int = -1
    """The iteration of the checkpoint resumed from (-1: none)."""
    sft_step: int = 0
    """The warm start's next step."""
    sft_history: list = field(default_factory=list)
    """The warm start's records so far."""
    pool: Optional[dict] = None
    """Asynchronous RL: the episodes in flight the checkpoint held (trainer/episode_pool.py)."""
    checkpoint: Optional[Path] = None
    """The RL checkpoint resumed from (ppo loads its critic from it); None: none."""


def start(cfg: TrainConfig, planner: StagePlanner, out: Path, world: int,
          optimizer: OptimizerSpec, kl_on: bool, *, any_placement: bool = False) -> Start:
    """The run's start (module docstring); restores ``planner``'s state from a checkpoint.
    ``any_placement``: rollout.placement=auto, which resumes a split's checkpoint too (its
    layout is the train pool's: planned anew here)."""
    def parse(text: str) -> ParallelLayout:
        return ParallelLayout.parse(text, world_size=world, model=cfg.model)

    def models_in(lay: ParallelLayout, ref_lay: Optional[ParallelLayout]) -> ModelPair:
        return build_model_pair(cfg.model, lay, ref_lay, optimizer=optimizer, seed=cfg.run.seed,
                                init=cfg.run.init)

    if not cfg.run.resume:
        refused = segments.earlier_run(out)
        if refused is not None:
            raise ConfigError(refused)
    found = find_checkpoint(out / "checkpoints") if cfg.run.resume else None
    if found is not None:
        ckpt, state = found.path, found.state
        if state.get("placement") and any_placement:
            planner.restore([], state["last_lengths"], state.get("profile"))
            lay = planner.plan("rollout", planner.rollout_lengths(), None)
            models = models_in(lay, lay if kl_on else None)
            load_checkpoint(models.policy, ckpt)
            return Start(state["iteration"] + 1, models, [
                f"resumed from {ckpt} (written by split placement) at iteration "
                f"{state['iteration'] + 1}"], history=list(state["history"]),
                saved=state["iteration"], pool=state.get("pool"), checkpoint=ckpt)
        if state.get("placement"):
            raise ConfigError(
                f"{ckpt} was written under rollout.placement=split (pools "
                f"{state['placement']}): resume with rollout.placement=split and the same "
                "pools, or start a new run from it with run.init")
        elastic = segments.resume_message(state, world, planner.auto)
        if elastic is None:
            planner.restore(state.get("selector"), state["last_lengths"], state.get("profile"))
            lay = parse(state["layout"])
            ref_lay = parse(state["ref_layout"] or state["layout"])
        else:
            # another world: the old layouts do not exist here; plan (auto) or take the
            # config's (static) as a fresh run would, from the last episode lengths
            planner.restore([], state["last_lengths"], state.get("profile"))
            lay = ref_lay = planner.plan("rollout", planner.rollout_lengths(), None)
        models = models_in(lay, ref_lay if kl_on else None)
        load_checkpoint(models.policy, ckpt)
        notes = [m for m in (found.message(), elastic) if m is not None]
        return Start(state["iteration"] + 1, models, notes + [
            f"resumed from {ckpt} at iteration {state['iteration'] + 1}"],
            history=list(state["history"]), saved=state["iteration"], pool=state.get("pool"),
            checkpoint=ckpt)
    if cfg.sft.steps and cfg.run.resume:
        from earl_megatron.trainer.warm_start import warm_start_state
        warm = warm_start_state(out)
        if warm is not None:  # killed during (or right after) the warm start
            lay = parse(warm["layout"])
            models = models_in(lay, lay if kl_on else None)
            load_checkpoint(models.policy, warm["path"])
            step = warm["sft_step"] + 1
            return Start(0, models, warm["notes"] + [
                f"resumed the warm start from {warm['path']} at step {step}"],
                sft_step=step, sft_history=warm["sft_history"])
    # run.init's architecture and its match with cfg.model: checked in train.validate
    first = planner.plan("rollout", planner.rollout_lengths(), None)
    return Start(0, models_in(first, first if kl_on else None), [])
