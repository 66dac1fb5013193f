"""The trainer's supervised phase (``sft.steps > 0``): the warm start runs before RL iteration 0.

    traces = sft.data (JSONL) | env.expert on sft.expert_episodes seeds of their own
    for step in sft steps:
        layout = plan TRAIN for this batch's lengths     (selector, or the static train layout)
        mol = switch(mol, layout)                        (weights + Adam state, in memory)
        loss = sft_step(...)                             (trainer/sft.py: dispatcher, Megatron)
        every sft.log_every steps: a line in sft.jsonl and in the live view
        checkpoint every run.checkpoint_every steps (and the last; SIGTERM: now, then exit)
    optimizer back at algorithm.lr; RL starts from the warmed policy

Checkpoints of this phase live in ``<output_dir>/checkpoints/sft/iter_<step>`` with ``loop.json``
``{"phase": "sft", "sft_step": step, "layout": ..., "sft_history": [...]}``: a run killed during
the warm start resumes at the next step with the same batches (trainer/sft.py: batches are a
pure function of the step), and a run with any RL checkpoint has finished its warm start. The
warm start's Adam state carries into RL (one optimizer throughout, as a run that never stopped).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from earl_megatron.config.train import TrainConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.trainer.sft import (load_traces, set_lr, sft_step, step_batch,
                                       tokenize_traces)


def sft_root(out: Path) -> Path:
    return Path(out) / "checkpoints" / "sft"


def warm_start_state(cfg: TrainConfig, out: Path) -> Optional[dict]:
    """loop.json of the newest warm-start checkpoint (None: none, or the warm start is off)."""
    from earl_megatron.runtime.checkpoint import latest_checkpoint

    if not cfg.sft.steps or not cfg.run.resume:
        return None
    ckpt = latest_checkpoint(sft_root(out))
    if ckpt is None:
        return None
    state = json.loads((ckpt / "loop.json").read_text())
    state["path"] = str(ckpt)
    return state


class WarmStart:
    """Runs the supervised phase on a Runner (its planner, switcher, view and stop flag)."""

    def __init__(self, runner, start_step: int = 0, history: Optional[list] = None):
        self.r = runner
        self.cfg: TrainConfig = runner.cfg
        self.start = start_step
        self.history: list[dict] = list(history or [])

    def run(self, mol):
        cfg, r = self.cfg, self.r
        s = cfg.sft
        if self.start >= s.steps:
            return mol
        t0 = time.perf_counter()
        traces = load_traces(s, cfg.env.name, dict(cfg.env.kwargs), cfg.run.seed)
        samples = tokenize_traces(traces, r.tok, cfg.model.max_position_embeddings)
        if s.batch_size > len(samples):
            from earl_megatron.config.train import ConfigError
            raise ConfigError(f"sft.batch_size={s.batch_size} but {s.data} holds "
                              f"{len(samples)} trajectories; lower sft.batch_size")
        lr = s.lr if s.lr is not None else cfg.algorithm.lr
        a = cfg.algorithm
        r._log_line(f"warm start: {len(samples)} traces "
                    f"({'expert' if s.data is None else s.data}), steps {self.start}.."
                    f"{s.steps - 1}, batch {s.batch_size}, lr {lr:g}")
        for step in range(self.start, s.steps):
            t1 = time.perf_counter()
            batch = step_batch(len(samples), s.batch_size, cfg.run.seed, step)
            lengths = [len(samples[i][0]) for i in batch]
            lay = r.plan_stage("train", lengths, mol.layout)
            mol = r._switch(mol, lay)
            res, moved = sft_step(mol, samples, batch, lr=lr, pad_id=r.tok.pad_token_id,
                                  micro_batch_size=a.micro_batch_size,
                                  micro_batch_tokens=a.micro_batch_tokens)
            last = step == s.steps - 1
            if step % s.log_every == 0 or last:
                rec = {"step": step, "loss": res.loss, "agent_tokens": res.num_tokens,
                       "grad_norm": res.grad_norm, "layout": str(lay),
                       "seconds": time.perf_counter() - t1, "dispatch_bytes": moved}
                self.history.append(rec)
                if r.rank == 0:
                    with open(r.out / "sft.jsonl", "a") as f:
                        f.write(json.dumps(rec) + "\n")
                r._log_line(f"warm start step {step}: loss {res.loss:.3f} per agent token, "
                            f"{lay}, {time.perf_counter() - t0:.0f} s")
            flag = torch.tensor([int(r._stop)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            r._stop = bool(flag.item())
            every = cfg.run.checkpoint_every
            if r._stop or last or (every and (step + 1) % every == 0):
                self.checkpoint(mol, step)
            if r._stop:
                return mol
        set_lr(mol.optimizer, cfg.algorithm.lr)
        return mol

    def checkpoint(self, mol, step: int) -> None:
        from earl_megatron.runtime.checkpoint import save_checkpoint

        state = {"phase": "sft", "sft_step": step, "layout": str(mol.layout),
                 "sft_history": self.history}
        save_checkpoint(mol, sft_root(self.r.out), step, state)


def resume_layout(state: dict, world: int, cfg: TrainConfig) -> ParallelLayout:
    return ParallelLayout.parse(state["layout"], world_size=world, model=cfg.model.shape)
