"""A run in segments: what a resumed job (requeued, preempted, on another world size) carries
over from the segments before it, and what it starts anew.

A run's output folder outlives its jobs. Each job is a segment: it starts at the iteration after
the newest checkpoint and ends at run.iterations or when stopped. Across segments:

- metrics.jsonl is the checkpoint's history (rewritten at the start of a segment, so a line of
  an iteration the checkpoint does not know is dropped; never a repeated iteration);
- eval.json is merged: the earlier segments' evaluations stay; the "end" of a segment that
  ended at run.iterations=N (a later segment runs further) becomes "iterN"; it is rewritten
  after every evaluation, so a preempted segment's evaluations are not lost;
- TensorBoard events after the checkpoint are purged (SummaryWriter's purge_step);
- a new run (run.resume=false) never overwrites an earlier one: a folder that holds a run's
  records or checkpoints is refused (``earlier_run``), as Hugging Face's Trainer refuses a
  non-empty output_dir; retention and resume would otherwise mix the two runs' checkpoints;
- layouts: on the world the checkpoint was written on, the checkpoint's layouts and selector
  state; on another world size (elastic resume), layouts planned anew for the new world
  (layout=auto) or taken from the config (layout=static), and the selector state reset (its
  hysteresis refers to layouts of the old world) with a message saying so. Megatron's
  checkpoint loads under any layout (dist_checkpointing reshards), so nothing else differs.

Pure functions over JSON-like values and small files of the output folder (no
torch.distributed), tested in one process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from earl_megatron.plan.layout import ParallelLayout

EVAL_JSON = "eval.json"


def saved_world(state: dict[str, Any]) -> int:
    """The world size a checkpoint's loop state was written on."""
    if "world_size" in state:
        return int(state["world_size"])
    return ParallelLayout.parse(state["layout"]).world_size


def resume_message(state: dict[str, Any], world: int, auto: bool) -> Optional[str]:
    """None on the same world; else the line that says what an elastic resume changes."""
    old = saved_world(state)
    if old == world:
        return None
    how = "layouts planned anew (layout=auto)" if auto else \
        "layouts taken from the config (layout=static)"
    return (f"checkpoint of {old} ranks resumed on {world}: {how}, selector state reset, "
            "weights and optimizer state resharded on load")


def merge_evals(previous: dict[str, Any], start: int, current: dict[str, Any]) -> dict[str, Any]:
    """Evaluations of the earlier segments (``previous``) and of this one, which began at
    iteration ``start``; an earlier "end" (taken at iteration ``start``) becomes "iter<start>"."""
    merged = dict(previous)
    if "end" in merged and start > 0:
        merged.setdefault(f"iter{start}", merged.pop("end"))
    merged.update(current)
    return merged


def read_evals(out_dir: str | Path) -> dict[str, Any]:
    f = Path(out_dir) / EVAL_JSON
    if not f.exists():
        return {}
    try:
        data = json.loads(f.read_text())
    except ValueError:
        return {}  # a file cut by a kill mid-write: its evaluations are lost, not the run
    return data if isinstance(data, dict) else {}


def write_evals(out_dir: str | Path, evals: dict[str, Any]) -> None:
    """Atomic: a kill mid-write leaves the previous file."""
    f = Path(out_dir) / EVAL_JSON
    tmp = f.with_name(f.name + ".tmp")
    tmp.write_text(json.dumps(evals, indent=1))
    tmp.replace(f)


RUN_RECORDS = ("metrics.jsonl", "sft.jsonl", EVAL_JSON)
"""What a run writes as it goes (the checkpoints besides): a folder holding any of them, not
empty, or any checkpoint, holds an earlier run."""


def earlier_run(out_dir: str | Path) -> Optional[str]:
    """None when ``out_dir`` may start a new run (run.resume=false); else the line refusing
    it, naming what the folder holds and the fixes."""
    out = Path(out_dir)
    held = [name for name in RUN_RECORDS
            if (out / name).is_file() and (out / name).stat().st_size > 0]
    ckpts = out / "checkpoints"
    if ckpts.is_dir() and any(ckpts.iterdir()):
        held.append("checkpoints/")
    if not held:
        return None
    return (f"run.output_dir={out} already holds a run ({', '.join(held)}) and run.resume=false "
            "would overwrite it: set run.resume=true to continue that run, choose a new "
            f"run.output_dir, or delete {out} to start over")
