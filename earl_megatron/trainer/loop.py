"""The one loop: every placement, every engine, synchronous or asynchronous.

    warm start (sft.steps), then the placement's start (the first weights on the rollout side)
    for j in start .. iterations - 1 (+ the placement's lag):
        out   = placement.play(j)          # the ranks that play: rollout stage j
        met   = placement.meet(j, out)     # where players and trainers meet: the batch, a stop,
                                           #   (auto) a move of the pools
        if this rank trains met's batch:
            placement.train(j, batch)      # score_and_train (trainer/runner.py): re-score,
                                           #   plan LOGPROB and TRAIN, advantages, train, record
        cadence: checkpoint (the placement's safe point), evaluation, stop
    finish: the stop's checkpoint and line, or the end's evaluation; the records closed

Synchronous RL is the episode pool with k = 0 (trainer/episode_pool.py). A placement says who
plays, who trains, where they meet and how new weights reach the rollout side:

    colocated (trainer/colocated.py)   every rank plays, then every rank trains; they "meet" at
                                       a world agreement on stopping; the rollout engine takes
                                       the trained weights from the policy (local) after TRAIN
    split (trainer/split.py)           a rollout pool plays stage j while a train pool trains
                                       batch j - 1; they meet once per iteration (the batch
                                       crosses, the weights are handed off); lag 1: one more
                                       meeting after the last stage saves the last iteration

Invariants (every placement):
- iteration j trains the batch of rollout stage j, exactly once; a stop abandons an untrained
  stage (its episode pool rewound), never a train step that began;
- a checkpoint of iteration d holds the weights after step d and the episode pool as it was
  before stage d + 1, through one writer (``Trainer.write_checkpoint``) and one loop state, so a
  resumed run replays stage d + 1 exactly;
- the evaluation cadence (start, every ``run.eval_every``, end) runs on the ranks that train.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Protocol


@dataclass
class Meeting:
    """What a meeting decided, the same on every rank."""

    batch: Optional[tuple] = None
    """This rank's part of batch j to train: (ids, episodes, metrics); None on a rank that
    does not train it (split's rollout pool) or when nothing is left to train."""
    stop: bool = False
    """The world agreed to stop (the last completed iteration is saved by then or at finish)."""
    move: Any = None
    """auto placement: the pools move to this plan; stage j plays again there."""
    end: bool = False
    """The run's iterations are done (split's last meeting)."""


class Placement(Protocol):
    lag: int
    """Meetings after the last rollout stage (split: 1, the meeting that saves the last step)."""

    def start(self) -> tuple[int, list[str]]: ...
    def warm_start(self) -> bool: ...
    def begin(self, j: int, evaluate: bool) -> None: ...
    def play(self, j: int) -> Any: ...
    def meet(self, j: int, played: Any) -> Meeting: ...
    def train(self, j: int, batch: tuple) -> dict: ...
    def after_train(self, j: int) -> bool: ...
    def release(self) -> None: ...
    def save_completed(self) -> None: ...
    @property
    def trains(self) -> bool: ...
    @property
    def models(self): ...


@dataclass
class LoopState:
    """What every checkpoint's loop state holds (runtime/checkpoint.py writes it beside the
    weights): the last completed iteration and what resuming it needs, whatever the placement."""

    iteration: int
    layout: str
    """The policy's layout (split: the train pool's)."""
    world_size: int
    history: list
    last_lengths: list
    selector: Any
    profile: Any
    pool: Optional[dict] = None
    """The episodes in flight before stage iteration + 1 (trainer/episode_pool.py)."""
    ref_layout: Optional[str] = None
    placement: Optional[dict] = None
    """split: {"train": layout, "rollout": layout}; None: colocated."""

    def to_json(self) -> dict:
        out = {"iteration": self.iteration, "layout": self.layout,
               "world_size": self.world_size, "history": self.history,
               "last_lengths": self.last_lengths, "ref_layout": self.ref_layout,
               "selector": self.selector, "profile": self.profile, "pool": self.pool}
        if self.placement is not None:
            out["placement"] = self.placement
        return out


def run_loop(trainer, place: Placement, start: int) -> None:
    """Iterations ``start`` .. ``run.iterations - 1`` of ``trainer`` under ``place`` (module
    docstring), inside the trainer's live view."""
    cfg, stop = trainer.cfg, trainer.stop
    n = cfg.run.iterations
    if start == 0 and cfg.sft.steps and not place.warm_start():
        stop.mark_stopped(-1)   # told to stop during the warm start: it checkpointed itself
        return
    place.begin(start, evaluate=start == 0)
    j = start
    while j < n + place.lag:
        t0 = time.perf_counter()
        met = place.meet(j, place.play(j) if j < n else None)
        if met.move is not None:            # auto: stage j plays again in the new placement
            place = trainer.placement = trainer.auto.move(place, met.move)
            place.begin(j, evaluate=False)
            # the move (its checkpoint, the new placement's build, a rewound stage) is part
            # of iteration j's seconds: its record counts it as "move"
            moved = time.perf_counter() - t0
            trainer.carried["move"] = trainer.auto.moved_s = moved
            continue
        if met.stop or met.end:
            break
        if met.batch is not None:
            place.train(j, met.batch)
        if place.after_train(j):            # the placement's safe point agreed a stop
            break
        last = j == n - 1
        if place.trains and cfg.run.eval_every and (j + 1) % cfg.run.eval_every == 0 \
                and not last:
            trainer.evaluate_into(f"iter{j + 1}", place.models)
        j += 1
    finish(trainer, place)


def finish(trainer, place: Placement) -> None:
    """The run's end: after a stop, the last completed iteration saved and a line saying so
    (evaluation skipped); otherwise the end's evaluation. The records are closed either way."""
    cfg, stop = trainer.cfg, trainer.stop
    if stop.stopping:
        place.save_completed()
        trainer.recorder.view.message(
            f"stopped at a safe point after iteration {trainer.saved}: checkpoint saved, "
            "evaluation skipped; rerun (or the requeued job) resumes there")
    elif cfg.run.iterations and place.trains:   # run.iterations=0: the start evaluation is all
        trainer.evaluate_into("end", place.models)
    trainer.recorder.finish()
    if stop.stopping:
        stop.mark_stopped(trainer.saved)
