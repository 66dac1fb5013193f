"""Training checkpoints: Megatron-Core dist_checkpointing for model and optimizer, JSON for the loop.

A checkpoint is a directory ``<root>/iter_000012/`` holding Megatron's sharded checkpoint of
``{"model": GPTModel.sharded_state_dict(), "optimizer": optimizer.sharded_state_dict(...)}`` and
``loop.json`` (iteration, selector state, metrics so far: whatever the trainer passes) and
``earl_model_config.json`` (so tools/convert_mcore_to_hf.py exports it to HF). It loads
under ANY layout: dist_checkpointing reshards on load, and the distributed optimizer is saved in
its ``fully_reshardable`` form (the default ``fully_sharded_model_space`` form relies on
flattened ShardedTensors that 0.16's torch_dist writer refuses).

Invariants:
- Atomic: everything is written to ``iter_N.tmp`` and renamed, then ``<root>/latest`` is
  rewritten; a run killed at any moment leaves the previous checkpoint loadable.
- ``load`` restores weights and optimizer state exactly (Adam moments, step): training resumed
  from a checkpoint follows the same trajectory as one that never stopped (tested).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from earl_megatron.runtime.io_errors import CheckpointError, reading

_OPT_META = {"distrib_optim_sharding_type": "fully_reshardable"}
CONFIG_JSON = "earl_model_config.json"
"""The ModelConfig beside the weights, in training checkpoints and converted ones alike."""

__all__ = ["CheckpointError", "checkpoint_dir", "latest_checkpoint", "save_checkpoint",
           "load_checkpoint"]


def checkpoint_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:06d}"


def latest_checkpoint(root: str | Path) -> Optional[Path]:
    """The directory ``<root>/latest`` names, or None when the run has no checkpoint yet."""
    marker = Path(root) / "latest"
    if not marker.exists():
        return None
    path = Path(root) / marker.read_text().strip()
    if not (path / "loop.json").exists():
        raise CheckpointError(f"{marker} names {path}, which has no loop.json: the checkpoint is "
                              f"incomplete or was moved; delete {marker} to start over")
    return path


def save_checkpoint(mol, root: str | Path, iteration: int, loop_state: dict[str, Any]) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory."""
    from megatron.core import dist_checkpointing

    final = checkpoint_dir(root, iteration)
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    msd = mol.module().sharded_state_dict()
    state = {"model": msd}
    if mol.optimizer is not None:
        state["optimizer"] = mol.optimizer.sharded_state_dict(msd, metadata=_OPT_META)
    dist_checkpointing.save(state, str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp / "loop.json").write_text(json.dumps(loop_state, indent=1, sort_keys=True))
        # the model config beside the weights: tools/convert_mcore_to_hf.py exports the policy
        # and run.init= starts a new run from it (the same keys as a converted checkpoint)
        (tmp / CONFIG_JSON).write_text(json.dumps(dataclasses.asdict(mol.cfg), indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        marker_tmp = Path(root) / "latest.tmp"
        marker_tmp.write_text(final.name)
        os.replace(marker_tmp, Path(root) / "latest")
    dist.barrier()
    return final


def load_checkpoint(mol, path: str | Path) -> dict[str, Any]:
    """Collective: load weights (and optimizer state when mol has an optimizer) from ``path``."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not (path / "loop.json").exists():
        raise CheckpointError(f"{path} is not a complete earl_megatron checkpoint (no loop.json)")
    msd = mol.module().sharded_state_dict()
    state = {"model": msd}
    if mol.optimizer is not None:
        _ensure_optimizer_state(mol.optimizer)
        state["optimizer"] = mol.optimizer.sharded_state_dict(msd, is_loading=True,
                                                              metadata=_OPT_META)
    # a truncated or missing file: one line (torch's CheckpointException is a BaseException)
    with reading(path, "training checkpoint"):
        try:
            loaded = dist_checkpointing.load(state, str(path))
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"cannot load {path}: {' '.join(str(e).split())[:300]}. Was "
                                  "it written for another model config? Its config is in "
                                  f"{path}/earl_model_config.json") from None
    mol.module().load_state_dict(loaded["model"])
    if mol.optimizer is not None:
        _load_optimizer(mol.optimizer, loaded["optimizer"])
    return json.loads((path / "loop.json").read_text())


def _load_optimizer(optimizer, state: dict) -> None:
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(subs) != 1 or "param_state" not in state:
        optimizer.load_state_dict(state)
        return
    # Megatron 0.16's DistributedOptimizer, without apex/TE, keeps torch Adam's per-parameter
    # "step" in its state, and load_parameter_state_from_fully_reshardable then copies into a
    # "step" the checkpoint does not carry (KeyError). Load in Megatron's own two phases and hold
    # "step" aside during the second.
    opt = subs[0]
    opt.load_state_dict({k: v for k, v in state.items() if k != "param_state"})
    inner = opt.optimizer.state
    steps = {p: st.pop("step") for p, st in inner.items() if "step" in st}
    try:
        if state["param_state_sharding_type"] != "fully_reshardable":
            raise CheckpointError(f"optimizer state saved as {state['param_state_sharding_type']}"
                                  "; this loader reads 'fully_reshardable'")
        opt.load_parameter_state_from_fully_reshardable(state["param_state"])
    finally:
        # Megatron's first phase gives every parameter the SAME step tensor; Adam increments
        # steps in place, so a shared tensor would advance once per parameter: clone it.
        for p, step in steps.items():
            inner[p]["step"] = step.clone()


def _ensure_optimizer_state(optimizer) -> None:
    """Megatron's distributed optimizer (without apex/TE) needs Adam state to exist before its
    load-time sharded_state_dict can be built; Megatron's own helper creates it with a zero-grad
    step, and the load then overwrites every value."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
        inner = getattr(opt, "optimizer", None)
        if init is not None and inner is not None and not inner.state:
            init()
