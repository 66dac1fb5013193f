"""Training checkpoints: Megatron-Core dist_checkpointing for model and optimizer, JSON for the loop.

A checkpoint is a directory ``<root>/iter_000012/`` holding Megatron's sharded checkpoint of
``{"model": GPTModel.sharded_state_dict(), "optimizer": optimizer.sharded_state_dict(...)}`` and
``loop.json`` (iteration, selector state, metrics so far: whatever the trainer passes) and
``earl_model_config.json`` (so tools/convert_mcore_to_hf.py exports it to HF). It loads
under ANY layout: dist_checkpointing reshards on load, and the distributed optimizer is saved in
its ``fully_reshardable`` form (the default ``fully_sharded_model_space`` form relies on
flattened ShardedTensors that 0.16's torch_dist writer refuses). How the directory is published,
found, judged complete and retired is runtime/checkpoint_files.py's.

Invariant: ``load`` restores weights and optimizer state exactly (Adam moments, step): training
resumed from a checkpoint follows the same trajectory as one that never stopped (tested), across
ep sizes too with the distributed optimizer (``_per_optimizer``; the plain optimizer's state is
refused across the ep = 1 / ep > 1 boundary, where Megatron's chaining of it changes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import queue
import shutil
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from earl_megatron.runtime.checkpoint_files import (_publish, _write_synced, checkpoint_dir,
                                                    read_loop_state)
from earl_megatron.runtime.io_errors import CheckpointError, reading

# chained_optim_avoid_prefix: an MoE model with ep > 1 has two optimizers (dense and expert
# parameters; Megatron chains them), with ep = 1 one; without a "chained_<i>." prefix the
# per-parameter keys are the same either way, so a checkpoint moves between ep sizes
_OPT_META = {"distrib_optim_sharding_type": "fully_reshardable",
             "chained_optim_avoid_prefix": True}
CONFIG_JSON = "earl_model_config.json"
"""The ModelConfig beside the weights, in training checkpoints and converted ones alike."""
HF_SUBDIR = "hf"
"""A checkpoint's HF side files: the tokenizer and the HF config.json it was made from."""
CRITIC_DIR = "critic"
"""A PPO checkpoint's critic (its own DCP directory beside the policy's, value_head.* included)."""


def save_sharded(state: dict, path: str | Path, **kwargs) -> None:
    """Collective: ``dist_checkpointing.save(state, path, **kwargs)``, every save of the package's.

    The one global of Megatron-Core's checkpointing this package sets. Its torch_dist writer
    hands the write results to the saving rank through a module-level queue that it builds, on
    a process's first save, from a spawn-context ``Manager``: a server process per rank that
    imports torch to unpickle them (about 6 CPU-seconds a rank on the 2-core CI host, a quarter
    of a 3-iteration test run's CPU). Every save here is synchronous (Megatron runs the writer in
    this process and reads the results back before ``save`` returns), so an in-process queue
    carries them; an asynchronous save (Megatron's ``AsyncCallsQueue``) would need the Manager's
    queue back. tests/distributed/test_checkpoint.py fails when the pinned Megatron-Core no
    longer reads this global (a save would then start that server again)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(state, str(path), **kwargs)


def save_checkpoint(on_layout, root: str | Path, iteration: int, loop_state: dict[str, Any],
                    keep_last: Optional[int] = None, *, tokenizer=None,
                    hf_config: Optional[Path] = None, also=None) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory. ``keep_last``: keep
    that many complete checkpoints (this one included) and delete older ones; None keeps all.
    ``tokenizer`` (saved with ``save_pretrained``) and ``hf_config`` (the HF config.json the run
    started from) go to ``hf/``, as in a converted checkpoint: ``run.init=`` this checkpoint
    then gets the run's tokenizer, and tools/convert_mcore_to_hf.py exports a complete HF
    directory from it. ``on_layout`` None: this rank holds no state of the run's model (split
    placement's rollout pool, whose weights are the train pool's) and joins with nothing;
    rank 0 must hold it. ``also(directory)``: a collective call that writes more into the
    directory before it is published (PPO's critic, trainer/critic.py)."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1 (None keeps every checkpoint)")
    final = checkpoint_dir(root, iteration)
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = _sharded_state(on_layout) if on_layout is not None else {}
    # a rank without the model's state has no common state either (the optimizer's param
    # groups): Megatron's check that every rank's equals rank 0's would warn for nothing
    with _quiet("megatron.core.dist_checkpointing.validation", on_layout is None):
        save_sharded(state, tmp)
    dist.barrier()
    if also is not None:
        also(tmp)
    if dist.get_rank() == 0:
        _write_synced(tmp / "loop.json", json.dumps(loop_state, indent=1, sort_keys=True))
        # the model config beside the weights: tools/convert_mcore_to_hf.py exports the policy
        # and run.init= starts a new run from it (the same keys as a converted checkpoint)
        _write_synced(tmp / CONFIG_JSON,
                      json.dumps(dataclasses.asdict(on_layout.cfg), indent=2) + "\n")
        if tokenizer is not None or hf_config is not None:
            (tmp / HF_SUBDIR).mkdir()
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp / HF_SUBDIR))
            if hf_config is not None:
                shutil.copy2(hf_config, tmp / HF_SUBDIR / "config.json")
        _publish(tmp, final, keep_last, iteration)
    dist.barrier()
    return final


def _sharded_state(on_layout, is_loading: bool = False) -> dict:
    """{"model": the sharded state dict, "optimizer": its optimizer's (when it has one)}."""
    msd = on_layout.module().sharded_state_dict()
    state = {"model": msd}
    if on_layout.optimizer is not None:
        if is_loading:
            _ensure_optimizer_state(on_layout.optimizer)
        state["optimizer"] = on_layout.optimizer.sharded_state_dict(
            msd, metadata=_OPT_META, **({"is_loading": True} if is_loading else {}))
    return state


def save_model_state(on_layout, path: Path) -> None:
    """Collective: one more model's weights and optimizer state into ``path`` (a new
    subdirectory of a checkpoint directory being written: ``save_checkpoint``'s ``also``).
    ``on_layout`` None: this rank holds none of that model and joins with nothing."""
    if dist.get_rank() == 0:
        path.mkdir(parents=True)
    dist.barrier()
    with _quiet("megatron.core.dist_checkpointing.validation", on_layout is None):
        save_sharded(_sharded_state(on_layout) if on_layout is not None else {}, path)
    dist.barrier()


@contextlib.contextmanager
def _quiet(logger: str, enabled: bool):
    log = logging.getLogger(logger)
    level = log.level
    if enabled:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


# ------------------------------------------------------------------ loading
def base_hf_config(init: Optional[str]) -> Optional[Path]:
    """The HF config.json a run started from ``init`` carries into its checkpoints: the HF
    directory's own, or a converted / trainer checkpoint's ``hf/config.json``; None if neither."""
    if not init:
        return None
    p = Path(init)
    for f in (p / HF_SUBDIR / "config.json", p / "config.json"):
        if f.is_file():
            return f
    return None


def load_checkpoint(on_layout, path: str | Path) -> dict[str, Any]:
    """Collective: load weights (and optimizer state when on_layout has an optimizer) from
    ``path``. ``on_layout`` None: this rank loads nothing and only joins (``save_checkpoint``)."""
    loop = read_loop_state(Path(path))
    load_model_state(on_layout, Path(path))
    return loop


def load_model_state(on_layout, path: Path) -> None:
    """Collective: weights (and optimizer state when ``on_layout`` has an optimizer) from the
    dist_checkpointing directory ``path``, exactly. ``on_layout`` None: this rank loads nothing
    and only joins."""
    from megatron.core import dist_checkpointing

    if on_layout is None:
        with reading(path, "training checkpoint"):
            dist_checkpointing.load({}, str(path))
        return
    state = _sharded_state(on_layout, is_loading=True)
    # a truncated or missing file: one line (torch's CheckpointException is a BaseException)
    with reading(path, "training checkpoint"):
        try:
            loaded = dist_checkpointing.load(state, str(path))
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"cannot load {path}: {' '.join(str(e).split())[:300]}. Was "
                                  "it written for another model config? Its config is in "
                                  f"{path}/earl_model_config.json") from None
    on_layout.module().load_state_dict(loaded["model"])
    if on_layout.optimizer is not None:
        _load_optimizer(on_layout.optimizer, loaded["optimizer"])


def _per_optimizer(state: dict, n: int) -> list[dict]:
    """The loaded optimizer state as one dict per target sub-optimizer (``n`` of them).

    The per-parameter tensors (``param_state``) arrive where the target's own sharded state dict
    asked for them (``state[i]`` when chained); the rest comes from the saved common state, whose
    chaining may differ (EP checkpoint loaded at ep = 1 or back). Param groups are matched by
    Megatron's identifier keys, so every target gets every saved group, and each also as the
    other side of ``is_expert_parallel`` (the same hyperparameters on both sides)."""
    saved = [state[k] for k in sorted(k for k in state if isinstance(k, int))
             if "optimizer" in state[k]] or [state]
    groups, seen = [], set()
    for sub in saved:
        for g in sub["optimizer"]["param_groups"]:
            for flip in (False, True):
                h = dict(g, is_expert_parallel=g.get("is_expert_parallel", False) ^ flip)
                key = tuple(h.get(k) for k in ("wd_mult", "lr_mult", "is_expert_parallel",
                                               "is_decoupled_lr"))
                if key not in seen and (not flip or "is_expert_parallel" in g):
                    seen.add(key)
                    groups.append(h)
    out = []
    for i in range(n):
        own = state if n == 1 else state[i]
        common = {k: v for k, v in saved[min(i, len(saved) - 1)].items()
                  if not isinstance(k, int) and k != "param_state"}
        common["optimizer"] = dict(common["optimizer"], param_groups=groups)
        out.append(dict(common, param_state=own["param_state"]))
    return out


def _load_optimizer(optimizer, state: dict) -> None:
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    distributed = "param_state" in state or any(
        isinstance(v, dict) and "param_state" in v for v in state.values())
    if not distributed:
        # Megatron's plain optimizer state holds param groups by position in each of the chained
        # optimizers: it loads only where the chaining is the one saved
        if (len(subs) == 1) == any(isinstance(k, int) for k in state) or (
                len(subs) > 1 and any(not isinstance(k, int) for k in state)):
            raise CheckpointError(
                "the optimizer state was saved with a different number of chained optimizers "
                "(expert and dense parameters get their own when ep > 1): resume at the saved "
                "ep = 1 / ep > 1 side, or train with use_distributed_optimizer=true, whose "
                "state moves between ep sizes")
        optimizer.load_state_dict(state)
        return
    for opt, sub in zip(subs, _per_optimizer(state, len(subs))):
        _load_distributed(opt, sub)
    if len(subs) > 1:   # as ChainedOptimizer.load_state_dict ends
        optimizer._synchronize_steps()


def _load_distributed(opt, state: dict) -> None:
    # Megatron 0.16's DistributedOptimizer, without apex/TE, keeps torch Adam's per-parameter
    # "step" in its state, and load_parameter_state_from_fully_reshardable then copies into a
    # "step" the checkpoint does not carry (KeyError). Load in Megatron's own two phases and hold
    # "step" aside during the second.
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
