"""The trainer's supervised phase (``sft.steps > 0``): the warm start runs before RL iteration 0.

    traces = sft.data (JSONL) | env.expert on sft.expert_episodes seeds of their own
    for step in warm-start steps:
        layout = planner.plan("train", this batch's lengths)   (selector, or the static layout)
        policy = models.policy_in(layout)                      (weights + Adam state, in memory)
        loss = sft_step(...)                                   (trainer/sft.py: dispatcher,
                                                                Megatron's train_step)
        every sft.log_every steps: a line in sft.jsonl and in the live view
        every step: progress(steps done, sft.steps) (the live view's bar and ETA)
        checkpoint every run.checkpoint_every steps and at the last (SIGTERM: now, then exit)
    optimizer back at algorithm.lr; RL iteration 0 starts from the warmed policy

Checkpoints of this phase are ``<output_dir>/checkpoints/sft/iter_<step>``, loop.json
``{"phase": "sft", "sft_step": step, "layout": ..., "sft_history": [...]}``. A run killed during
the warm start resumes at the next step with the same batches (trainer/sft.py: a step's batch is
a pure function of the step), and sft.jsonl is rewritten from the checkpoint's history, so it
never repeats a step; a run with an RL checkpoint has finished its warm start. One optimizer
throughout: the warm start's Adam state carries into RL, as in a run that never stopped.

What the warm start would refuse at its first step without a model, ``check_warm_start`` refuses
first (train.validate: every rank, and ``earl train`` before any rank starts), each problem one
ConfigError naming its key and the fix: an ``sft.data`` that is missing, unreadable, malformed or
holds fewer traces than ``sft.batch_size``; with ``sft.data=null``, an environment without a
scripted expert, or an expert whose first episode does not play to its end.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from earl_megatron.config.checks import ConfigError
from earl_megatron.config.sft import SFTConfig

if TYPE_CHECKING:
    from earl_megatron.trainer.stages import BatchShape


def sft_root(out: Path) -> Path:
    return Path(out) / "checkpoints" / "sft"


def warm_start_state(out: Path) -> Optional[dict]:
    """loop.json of the newest complete warm-start checkpoint, with its "path" and "notes" (a
    line when a damaged newer one was skipped); None: there is none."""
    from earl_megatron.runtime.checkpoint_files import find_checkpoint

    found = find_checkpoint(sft_root(out))
    if found is None:
        return None
    note = found.message()
    return {**found.state, "path": str(found.path), "notes": [note] if note else []}


@dataclass(frozen=True)
class TraceSource:
    """Where the expert's traces come from when sft.data is null."""

    env: str
    env_kwargs: dict
    seed: int
    """run.seed: the expert's episodes use seeds derived from it (earl_megatron/seeds.py expert_seeds)."""


def load_warmed(out: Path, steps: int, reference) -> None:
    """KL after a warm start of ``steps`` steps: the reference becomes the warmed policy (the
    newest warm-start checkpoint under ``out``, written at its last step), as a peer's reference
    is its SFT model. Collective over the world: ``reference`` None on a rank that holds none
    (split's rollout pool)."""
    from earl_megatron.runtime.checkpoint import load_checkpoint

    warm = warm_start_state(out)
    if warm is None or warm["sft_step"] != steps - 1:
        raise RuntimeError(f"the warm start's last checkpoint (step {steps - 1}) is missing "
                           f"under {out / 'checkpoints' / 'sft'}: the KL reference is the "
                           "warmed policy; rerun the warm start (a new run.output_dir)")
    load_checkpoint(reference, warm["path"])


def check_warm_start(scfg: SFTConfig, source: TraceSource) -> None:
    """The warm start's inputs, before any model exists (module doc); nothing when sft.steps=0.
    Reads sft.data in full (a bad line is named now, not after model setup) and plays the
    expert's first episode (the expert exists and finishes it). env.name=agent without sft.data
    is train._check_agent's refusal."""
    if not scfg.steps or (scfg.data is None and source.env == "agent"):
        return
    if scfg.data is not None:
        from earl_megatron.rollout.trajectories import read_jsonl
        data = Path(scfg.data)
        if not data.is_file():
            raise ConfigError(f"sft.data={scfg.data} is not a file; point sft.data at a JSONL "
                              "file of chat trajectories (rollout/trajectories.py) or set "
                              "sft.data=null to warm start on the environment's expert")
        try:
            traces = read_jsonl(data)
        except OSError as e:
            raise ConfigError(f"sft.data={scfg.data} cannot be read ({e.strerror}); fix its "
                              "permissions or copy it again") from None
        except ValueError as e:
            raise ConfigError(f"sft.data={scfg.data}: {e}") from None
        check_trace_count(scfg, len(traces))
        return
    from earl_megatron.envs import make_env
    from earl_megatron.rollout.trajectories import expert_trajectories
    from earl_megatron.seeds import expert_seeds
    first = expert_seeds(source.seed, scfg.expert_episodes)[:1]
    try:
        expert_trajectories(lambda: make_env(source.env, **source.env_kwargs), first)
    except NotImplementedError:   # Env.expert's default: no scripted teacher
        raise ConfigError(f"sft.steps={scfg.steps} with sft.data=null plays the environment's "
                          f"expert, but {source.env} has no scripted expert; give the warm "
                          "start a JSONL file of chat trajectories (sft.data=PATH, "
                          "docs/trainer.md) or set sft.steps=0") from None
    except RuntimeError as e:     # expert_trajectories: an expert that does not finish
        raise ConfigError(f"sft.data=null: {e}; give sft.data=PATH (chat trajectories) "
                          f"instead, or fix {source.env}'s expert") from None


def check_trace_count(scfg: SFTConfig, traces: int) -> None:
    """A step draws sft.batch_size distinct traces (trainer/sft.py step_batch)."""
    if scfg.batch_size > traces:
        raise ConfigError(f"sft.batch_size={scfg.batch_size} but "
                          f"{scfg.data or 'the expert'} holds {traces} trajectories; lower "
                          "sft.batch_size")


class WarmStart:
    def __init__(self, scfg: SFTConfig, source: TraceSource, tokenizer, *, batch: BatchShape,
                 rl_lr: float, max_tokens: int, out: Path, checkpoint_every: int, rank: int,
                 log: Callable[[str], None], start_step: int = 0,
                 history: Optional[list] = None, keep_last: Optional[int] = None,
                 progress: Optional[Callable[[int, int], None]] = None):
        self.scfg, self.source, self.tok, self.batch = scfg, source, tokenizer, batch
        self.steps, self.batch_size, self.log_every = scfg.steps, scfg.batch_size, scfg.log_every
        self.data = scfg.data
        self.lr = scfg.lr if scfg.lr is not None else rl_lr
        self.rl_lr, self.max_tokens = rl_lr, max_tokens
        self.out, self.every, self.rank, self.log = Path(out), checkpoint_every, rank, log
        self.keep_last = keep_last
        """Warm-start checkpoints kept (run.keep_last; None: all)."""
        self.start = start_step
        self.progress = progress or (lambda done, total: None)
        """Called with (steps done, sft.steps) before the first step and after each (rank 0's
        live view: trainer/live.py ``progress``); local, no collective."""
        self.history: list[dict] = list(history or [])

    def run(self, models, planner, stop: Callable[[], bool]) -> bool:
        """All remaining steps; False when a stop was agreed (checkpointed: resume later)."""
        # here, not at the top: train.validate's check_warm_start runs in `earl train` before
        # any rank starts, and trainer/sft imports Megatron-Core (7-10 s of a core)
        from earl_megatron.trainer.sft import (load_traces, set_lr, sft_step, step_batch,
                                               tokenize_traces)
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "sft.jsonl").write_text(
                "".join(json.dumps(h) + "\n" for h in self.history))
        if self.start >= self.steps:  # finished before a restart: only RL's rate to restore
            set_lr(models.policy.optimizer, self.rl_lr)
            return True
        t0 = time.perf_counter()
        traces = load_traces(self.scfg, self.source.env, self.source.env_kwargs, self.source.seed)
        samples = tokenize_traces(traces, self.tok, self.max_tokens)
        check_trace_count(self.scfg, len(samples))
        self.log(f"warm start: {len(samples)} traces "
                 f"({'expert' if self.data is None else self.data}), steps {self.start}.."
                 f"{self.steps - 1}, batch {self.batch_size}, lr {self.lr:g}")
        self.progress(self.start, self.steps)
        for step in range(self.start, self.steps):
            t1 = time.perf_counter()
            batch = step_batch(len(samples), self.batch_size, self.source.seed, step)
            lengths = [len(samples[i][0]) for i in batch]
            policy = models.policy
            lay = planner.plan("train", lengths, policy.layout)
            policy = models.trainee(lay, planner.recompute["train"])
            res, moved = sft_step(policy, samples, batch, lr=self.lr,
                                  pad_id=self.tok.pad_token_id, shape=self.batch)
            last = step == self.steps - 1
            if step % self.log_every == 0 or last:
                rec = {"step": step, "loss": res.loss, "agent_tokens": res.num_tokens,
                       "grad_norm": res.grad_norm, "layout": str(lay),
                       "seconds": time.perf_counter() - t1, "dispatch_bytes": moved}
                self.history.append(rec)
                if self.rank == 0:
                    with open(self.out / "sft.jsonl", "a") as f:
                        f.write(json.dumps(rec) + "\n")
                self.log(f"warm start step {step}: loss {res.loss:.3f} per agent token, "
                         f"{lay}, {time.perf_counter() - t0:.0f} s")
            self.progress(step + 1, self.steps)
            stopping = stop()
            if stopping or last or (self.every and (step + 1) % self.every == 0):
                self.checkpoint(policy, step)
            if stopping:
                return False
        set_lr(models.policy.optimizer, self.rl_lr)
        return True

    def checkpoint(self, policy, step: int) -> None:
        from earl_megatron.runtime.checkpoint import save_checkpoint

        state = {"phase": "sft", "sft_step": step, "layout": str(policy.layout),
                 "sft_history": self.history}
        save_checkpoint(policy, sft_root(self.out), step, state, keep_last=self.keep_last)
