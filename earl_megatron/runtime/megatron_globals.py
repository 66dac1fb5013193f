"""The one shim: a pool's groups installed where the pinned Megatron-Core (0.16.1) reads globals.

GPTModel and DDP take a ``ProcessGroupCollection`` (runtime/pool_grid.py builds it), but 0.16.1
still reads ``megatron.core.parallel_state``'s globals in code that is given no groups: the
tensor-parallel layers' and the RNG tracker's helpers, the pipeline schedules, the optimizer's
``setup_process_groups_for_optimizer`` (its pg_collection path refuses gloo side groups), MoE
token dispatch, and this project's own getters (runtime/groups.py). ``install(pool)`` sets those
globals to this rank's pool's groups, as ``initialize_model_parallel`` would have had the pool
been the world; ``reset()`` sets every one back to its import-time None.

Invariants:
- ``SET`` names every parallel_state global this shim sets; ``UNUSED`` every other global that
  is None at import, with why it stays None here. Together they are exactly parallel_state's
  import-time None globals: tests/unit/test_megatron_globals.py fails when Megatron-Core grows
  one this module does not name (it would silently keep a stale or world-wide value).
- ``reset()`` clears ``SET`` and ``UNUSED`` alike (a direct ``initialize_model_parallel`` may
  have set the latter) and never destroys a group: the groups belong to their pool's cache entry.
- ``_GLOBAL_MEMORY_BUFFER`` is fresh for each install: buffers sized for an old layout never
  survive a regroup.
- ``world_is(group)``: where 0.16.1 speaks to the world with no group to pass (one call: the
  optimizer's parameter-group gather), the calling thread alone sees its pool as the world; any
  other thread (the agent endpoint's) sees the world throughout. It goes when the pinned
  Megatron-Core gathers over a group it is given.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from earl_megatron.runtime.pool_grid import PoolGroups

_FROM_GROUPS = {   # parallel_state global -> this rank's pool axis (pool_grid.PoolGroups.groups)
    "_TENSOR_MODEL_PARALLEL_GROUP": "tp", "_PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "_MODEL_PARALLEL_GROUP": "mp", "_EMBEDDING_GROUP": "embd",
    "_POSITION_EMBEDDING_GROUP": "pos_embd", "_DATA_PARALLEL_GROUP": "dp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP": "tp_dp", "_EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "_EXPERT_TENSOR_PARALLEL_GROUP": "expt_tp", "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp_ep",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "tp_ep_pp",
    "_EXPERT_DATA_PARALLEL_GROUP": "expt_dp", "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "expt_dp",
    "_CONTEXT_PARALLEL_GROUP": "cp", "_DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp_cp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp_dp_cp",
    "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": "intra_dist_opt",
}
_FROM_RANKS = {    # parallel_state global -> this rank's pool axis (PoolGroups.ranks)
    "_EMBEDDING_GLOBAL_RANKS": "embd", "_POSITION_EMBEDDING_GLOBAL_RANKS": "pos_embd",
    "_PIPELINE_GLOBAL_RANKS": "pp", "_DATA_PARALLEL_GLOBAL_RANKS": "dp",
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp", "_EXPERT_MODEL_PARALLEL_RANKS": "ep",
    "_MODEL_PARALLEL_GLOBAL_RANKS": "mp", "_CONTEXT_PARALLEL_GLOBAL_RANKS": "cp",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "dp_cp",
}
_FROM_GLOO = {     # parallel_state global -> PoolGroups.gloo (a non-gloo world only)
    "_DATA_PARALLEL_GROUP_GLOO": "dp", "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "dp_cp",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "dp_cp",
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO": "expt_dp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": "expt_dp",
}
SET = frozenset(_FROM_GROUPS) | frozenset(_FROM_RANKS) | frozenset(_FROM_GLOO)
"""The globals ``install`` sets (a stage without embeddings keeps its embedding ones None)."""

UNUSED = {
    "_DATA_PARALLEL_GROUP_WITH_CP_AG": "only with a separate all-gather group (not created)",
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "only with several optimizer instances (one)",
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": "only with hierarchical context parallelism",
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK": "no virtual pipeline stages in any layout",
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": "no virtual pipeline stages in any layout",
    "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE": "a setter's override of the group's size: unset",
    "_MPU_EXPERT_MODEL_PARALLEL_RANK": "a setter's override of the group's rank: unset",
    "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE": "a setter's override of the group's size: unset",
    "_MPU_EXPERT_TENSOR_PARALLEL_RANK": "a setter's override of the group's rank: unset",
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": "a setter's override of the group's size: unset",
    "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": "a setter's override of the group's size: unset",
    "_MPU_DATA_PARALLEL_WORLD_SIZE": "a setter's override of the group's size: unset",
    "_MPU_DATA_PARALLEL_RANK": "a setter's override of the group's rank: unset",
    "_MPU_TENSOR_MODEL_PARALLEL_RANK": "a setter's override of the group's rank: unset",
    "_MPU_PIPELINE_MODEL_PARALLEL_RANK": "a setter's override of the group's rank: unset",
    "_GLOBAL_MEMORY_BUFFER": "made fresh by each install (Megatron's own setter)",
    "_GLOBAL_SYMMETRIC_MEMORY_BUFFER": "NVLS symmetric memory, made on demand by Megatron",
    "_global_process_group_list": "the groups initialize_model_parallel made: none here",
}
"""parallel_state's other import-time None globals, and why they stay None (``reset``)."""


def state_of(pool: PoolGroups) -> dict[str, Any]:
    """The parallel_state globals of this rank's pool (none where it is not in the pool)."""
    if not pool.member:
        return {}
    state = {n: pool.groups.get(a) for n, a in _FROM_GROUPS.items()}
    state.update({n: pool.ranks.get(a) for n, a in _FROM_RANKS.items()})
    state.update({n: pool.gloo.get(a) for n, a in _FROM_GLOO.items()})
    return state


def install(state: dict[str, Any]) -> None:
    """Make ``state`` (``state_of``) Megatron's current groups, everything else unset."""
    from megatron.core import parallel_state as ps

    reset()
    for n, v in state.items():
        setattr(ps, n, v)
    ps._set_global_memory_buffer()


def reset() -> None:
    """Every global of ``SET`` and ``UNUSED`` back to None; groups are left alone."""
    from megatron.core import parallel_state as ps

    for n in SET | set(UNUSED):
        setattr(ps, n, None)


def untracked_groups() -> list:
    """Groups a direct ``initialize_model_parallel`` made (its ``_global_process_group_list``,
    which holds None for the world): the caller destroys them, as Megatron's own
    ``destroy_model_parallel`` does not."""
    from megatron.core import parallel_state as ps

    return [g for g in ps._global_process_group_list or [] if g is not None]


# -- the world: 0.16.1's get_megatron_optimizer gathers parameter-group keys over the default
# group (megatron/core/optimizer/__init__.py:180-181, ``_get_param_groups``), whatever
# pg_collection it is given; a pool's ranks must gather among themselves only.

_LOCAL = threading.local()
_LOCK = threading.Lock()
_ORIGINAL: dict[str, Any] = {}
_USERS = 0


def _pool_group_of_this_thread():
    return getattr(_LOCAL, "group", None)


def _get_world_size(group=None):
    g = group if group is not None else _pool_group_of_this_thread()
    return _ORIGINAL["get_world_size"](g)


def _all_gather_object(object_list, obj, group=None):
    g = group if group is not None else _pool_group_of_this_thread()
    return _ORIGINAL["all_gather_object"](object_list, obj, group=g)


@contextlib.contextmanager
def world_is(group):
    """Inside, on the calling thread only, ``torch.distributed.get_world_size()`` and
    ``all_gather_object`` without a group act on ``group`` (None: nothing changes). Other
    threads keep the world: the wrappers read the group from a thread-local, installed while any
    thread is inside (counted under a lock) and removed when the last one leaves."""
    global _USERS
    if group is None:
        yield
        return
    import torch.distributed as dist

    with _LOCK:
        if _USERS == 0:
            _ORIGINAL.update(get_world_size=dist.get_world_size,
                             all_gather_object=dist.all_gather_object)
            dist.get_world_size, dist.all_gather_object = _get_world_size, _all_gather_object
        _USERS += 1
    outer, _LOCAL.group = _pool_group_of_this_thread(), group
    try:
        yield
    finally:
        _LOCAL.group = outer
        with _LOCK:
            _USERS -= 1
            if _USERS == 0:
                dist.get_world_size = _ORIGINAL["get_world_size"]
                dist.all_gather_object = _ORIGINAL["all_gather_object"]
