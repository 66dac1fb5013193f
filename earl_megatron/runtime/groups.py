"""The one bridge to ``megatron.core.parallel_state``: build, cache and tear down groups per layout.

Every other module receives a ``ParallelLayout`` (and, where it needs communicators, a
``ProcessGroupCollection`` from ``current_pg_collection()``); none imports parallel_state.

``build_groups(layout)`` makes Megatron-Core's groups for the layout current on the already
initialised default process group. RL regroups between the same few layouts every iteration
(rollout / logprob / train), and creating a layout's 40-odd groups is most of a regroup's fixed
cost, so the groups of the ``max_cached_layouts`` most recently used layouts are kept (LRU,
default 4). On gloo a layout gets one group per distinct rank list (``_one_group_per_rank_list``):
Megatron asks for 41-50 groups a layout, 17 of them on each of 4 ranks, for 2-4 distinct lists.

    build_groups(A)  miss: initialize_model_parallel, snapshot the parallel_state globals it set
    build_groups(B)  A deactivated (globals reset, groups kept); miss for B
    build_groups(A)  B deactivated; hit: A's snapshot restored, no group created

``destroy_groups()`` destroys every cached layout's groups (``parallel_state.
_global_process_group_list``) as well as resetting Megatron's globals, because resetting the
globals alone (``destroy_model_parallel()``) leaks the groups' fds and threads on gloo.

Invariants:
- All ranks call ``build_groups`` (and ``set_group_cache_size``) with the same sequence of
  layouts and options. Cache hits, misses and evictions are a function of that sequence only, so
  every rank creates the same groups in the same order (torch's ``new_group`` requires it) and no
  collective is needed to agree on them.
- At most one layout is active. While one is active, parallel_state's globals are exactly those
  its ``initialize_model_parallel`` set (plus a fresh ``GlobalMemoryBuffer``); deactivating it
  sets every parallel_state data global back to its import-time None, including those
  ``destroy_model_parallel()`` forgets (``*_GLOBAL_RANKS``, ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP
  _WITH_CP``, which still holds the old dp-cp group) and never destroys a group.
- A cache key is (layout, world size, timeout, backend). Two layouts never share group objects
  (each initialisation creates its own), so destroying one layout's groups never touches another.
  A group is deregistered and released exactly once: when its layout is evicted (the least
  recently used inactive one, when a miss would exceed the bound) or by ``destroy_groups()``.
  The active layout is never evicted. ``max_cached_layouts`` <= 1 is the uncached behaviour:
  every regroup destroys the old layout's groups before creating the new ones.
- Each cached layout keeps its groups' resources (on 4 gloo ranks ~20 fds and ~10 threads a
  rank, and the device loops' 10 ms polls); the bound caps them.
- Group timeouts are short (``set_group_timeout``, ``cluster.group_timeout_s``, default 600 s,
  below the world's ``cluster.collective_timeout_s``): a mismatched collective fails in minutes.
- Every group inherits the world's device-mapped backend (runtime/dist.py): on a host with GPUs
  a layout's groups carry CUDA tensors over NCCL and CPU tensors over gloo.
- Evicted groups are deregistered at once and freed (gloo's destructor sleeps ~30 ms a group)
  on helper threads, at most two batches in flight; ``wait_released()`` joins them.
- The layout is checked against the world size before anything changes.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from earl_megatron.config.model import ModelConfig
from earl_megatron.config.cluster import ClusterConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.runtime.dist import gloo_only

DEFAULT_MAX_CACHED_LAYOUTS = 4
"""Layouts whose groups stay alive (the active one included); <= 1 disables the cache. Cheap on
gloo since a layout holds one group per distinct rank list (2-4 a rank on 4 ranks: ~5 threads
and ~20 fds; 4 cached layouts cost a compute-bound job 1-2% more CPU time, measured by
benchmarks/group_cache.py, against 8-24% with Megatron's 17 groups a rank)."""


@dataclass(frozen=True)
class _LayoutGroups:
    """One layout's Megatron state on this rank: the parallel_state globals its initialisation
    set (``_global_process_group_list`` included)."""

    state: dict[str, Any]

    @property
    def pgs(self) -> list:
        """The distinct groups of this layout that this rank belongs to, each once (several
        globals alias one group; Megatron's list holds None for the default group)."""
        return _distinct(self.state.get("_global_process_group_list"))


_CacheKey = tuple   # (layout, world_size, timeout_s, backend)
_CACHE: "OrderedDict[_CacheKey, _LayoutGroups]" = OrderedDict()   # least recently used first
_ACTIVE: Optional[ParallelLayout] = None
_ACTIVE_KEY: Optional[_CacheKey] = None
_MAX_CACHED: Optional[int] = None      # None: DEFAULT_MAX_CACHED_LAYOUTS
_FRESH = ("_GLOBAL_MEMORY_BUFFER",)      # a new one per activation, not kept per layout
DEFAULT_GROUP_TIMEOUT_S = ClusterConfig.group_timeout_s   # one default: the config's
_GROUP_TIMEOUT_S: Optional[float] = None   # None: DEFAULT_GROUP_TIMEOUT_S


def set_group_cache_size(n: Optional[int]) -> None:
    """Keep the groups of at most ``n`` layouts (the active one included); <= 1: no cache;
    None: the default (``DEFAULT_MAX_CACHED_LAYOUTS``). Inactive layouts beyond the new
    bound are destroyed now. Call it on every rank alike."""
    global _MAX_CACHED
    if n is not None and (not isinstance(n, int) or n < 0):
        raise ValueError(f"max_cached_layouts must be an integer >= 0 or None, got {n!r}")
    _MAX_CACHED = n
    if dist.is_initialized():
        _evict(keep=group_cache_size())


def set_group_timeout(seconds: Optional[float]) -> None:
    """Collective timeout of the groups built from now on (None: the default, 600 s); part of
    the cache key, so call it on every rank alike, before the first ``build_groups``."""
    global _GROUP_TIMEOUT_S
    if seconds is not None and not seconds > 0:
        raise ValueError(f"group timeout must be > 0 seconds or None, got {seconds!r}")
    _GROUP_TIMEOUT_S = seconds


def group_timeout_s() -> float:
    return DEFAULT_GROUP_TIMEOUT_S if _GROUP_TIMEOUT_S is None else _GROUP_TIMEOUT_S


def group_cache_size() -> int:
    """The bound in force: the one set, or the default."""
    return DEFAULT_MAX_CACHED_LAYOUTS if _MAX_CACHED is None else _MAX_CACHED


def cached_layouts() -> list[ParallelLayout]:
    """Layouts whose groups are alive on this rank, least recently used first."""
    return [key[0] for key in _CACHE]


def build_groups(layout: ParallelLayout, model: Optional[ModelConfig] = None, *,
                 timeout_s: Optional[float] = None, seed: Optional[int] = None,
                 max_cached_layouts: Optional[int] = None) -> ParallelLayout:
    """Make Megatron-Core's process groups for ``layout`` current (collective over the world
    when they are created; a cache hit communicates nothing). ``max_cached_layouts`` overrides
    the module's bound (``set_group_cache_size``) for this call."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    global _ACTIVE, _ACTIVE_KEY
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call "
                           "earl_megatron.runtime.dist.init_distributed() (or run under torchrun) "
                           "before building groups")
    layout.check(dist.get_world_size(), model)
    bound = group_cache_size() if max_cached_layouts is None else max_cached_layouts
    gloo = gloo_only()
    timeout_s = group_timeout_s() if timeout_s is None else timeout_s
    key = _key(layout, timeout_s)
    _deactivate()
    if bound <= 1:
        _evict(keep=0)   # no cache: every regroup, even to the same layout, starts afresh
    entry = _CACHE.get(key)
    if entry is None:
        _evict(keep=bound - 1)   # room first: old groups go before new ones are created
        before = {n: getattr(ps, n) for n in _state_names(ps)}
        with _one_group_per_rank_list(ps, enabled=gloo):
            ps.initialize_model_parallel(
                tensor_model_parallel_size=layout.tp,
                pipeline_model_parallel_size=layout.pp,
                context_parallel_size=layout.cp,
                expert_model_parallel_size=layout.ep,
                expert_tensor_parallel_size=layout.expert_tp,
                distributed_timeout_minutes=timeout_s / 60.0,
                order="tp-cp-ep-dp-pp",
                # On a CPU-only world the regular groups are gloo already; Megatron's extra
                # gloo groups would only double the fds and threads. With GPUs its regular
                # groups carry CPU tensors too (runtime/dist.py), and Megatron's own gloo side
                # groups (distributed optimizer, checkpoints) are made as it expects.
                create_gloo_process_groups=not gloo,
            )
        _CACHE[key] = _LayoutGroups(state={n: getattr(ps, n) for n, v in before.items()
                                           if n not in _FRESH and getattr(ps, n) is not v})
    else:
        for n, v in entry.state.items():
            setattr(ps, n, v)
        if hasattr(ps, "_set_global_memory_buffer"):
            ps._set_global_memory_buffer()
    _CACHE.move_to_end(key)
    _ACTIVE, _ACTIVE_KEY = layout, key
    _evict(keep=bound)   # a per-call bound may be below the number cached
    if seed is not None:
        model_parallel_cuda_manual_seed(seed)
    return layout


@contextlib.contextmanager
def _one_group_per_rank_list(ps, enabled: bool):
    """While Megatron initialises a layout, hand out one group per distinct rank list (and
    options) instead of one per logical group (gloo only).

    Megatron 0.16 creates 41-50 groups per layout on 4 ranks, 17 of them on each rank, but only
    2-4 distinct rank lists per rank (the world group 9 times, each singleton 8 times, ...).
    Every gloo group runs its own device loop (threads, fds, a 10 ms poll), so aliasing logical
    groups with identical members cuts a layout's groups, creation time and idle cost 4-8x.
    Safe on gloo: members of identical rank lists issue their collectives in the same program
    order on every rank, and point-to-point ops use tags apart from collectives. Not applied to
    NCCL, where operations on one communicator share a stream and Megatron overlaps
    communication of distinct groups. Every rank sees the same sequence of calls, so every rank
    takes the same aliasing decisions."""
    if not enabled:
        yield
        return
    original, made = ps.create_group, {}

    def create_group(ranks=None, timeout=None, backend=None, pg_options=None,
                     use_local_synchronization=False, group_desc=None):
        key = (tuple(ranks) if ranks is not None else None, timeout, backend,
               repr(pg_options), use_local_synchronization)
        if key not in made:
            made[key] = original(ranks=ranks, timeout=timeout, backend=backend,
                                 pg_options=pg_options,
                                 use_local_synchronization=use_local_synchronization,
                                 group_desc=group_desc)
        return made[key]

    ps.create_group = create_group
    try:
        yield
    finally:
        ps.create_group = original


def _key(layout: ParallelLayout, timeout_s: float) -> _CacheKey:
    return (layout, dist.get_world_size(), float(timeout_s), dist.get_backend())


def activate(layout: ParallelLayout, *, timeout_s: Optional[float] = None) -> bool:
    """Make ``layout``'s cached groups current again (no collective); False if they are not
    cached (evicted, or never built with these options), in which case nothing changes. Models
    built under ``layout`` earlier are usable again after True."""
    timeout_s = group_timeout_s() if timeout_s is None else timeout_s
    key = _key(layout, timeout_s)
    if key not in _CACHE:
        return False
    if _ACTIVE_KEY != key:
        build_groups(layout, timeout_s=timeout_s)
    return True


def destroy_groups(*, background: bool = False) -> None:
    """Reset Megatron's globals and destroy every group of every cached layout.

    ``background``: the groups are deregistered (unusable) at once, but the last references are
    dropped on a helper thread. Gloo's ProcessGroup destructor sleeps, with the GIL released:
    each connection's close waits for its device loop's next 10 ms epoll tick, ~30 ms per group
    of 4 (2-4 groups a rank per layout on gloo, one per distinct rank list). At most two batches are in flight (a third waits for the
    oldest), and a plain ``destroy_groups()`` waits for everything (``wait_released``)."""
    _deactivate()
    _evict(keep=0)
    if not background:
        wait_released()


def _state_names(ps) -> tuple[str, ...]:
    """parallel_state's globals that are None at import, read once from its source: the state
    that initialize_model_parallel and Megatron's setters fill in (constants are left alone;
    so is ``_HYBRID_DP_CP_GROUPS``, a dict filled only with hybrid CP, never enabled here)."""
    global _STATE_NAMES
    if _STATE_NAMES is None:
        import ast
        import inspect

        _STATE_NAMES = tuple(
            t.id for node in ast.parse(inspect.getsource(ps)).body
            if isinstance(node, (ast.Assign, ast.AnnAssign))
            and isinstance(node.value, ast.Constant) and node.value.value is None
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Name))
    return _STATE_NAMES


_STATE_NAMES: Optional[tuple[str, ...]] = None


def _deactivate() -> None:
    """Make no layout current: reset Megatron's globals, keep the active layout's groups cached.
    Groups that Megatron holds but this module did not create (someone called
    initialize_model_parallel directly) are destroyed, as ``destroy_model_parallel`` would not."""
    from megatron.core import parallel_state as ps

    global _ACTIVE, _ACTIVE_KEY
    # a list while nothing is active: groups made outside build_groups (we reset it to None)
    untracked = _distinct(ps._global_process_group_list) if _ACTIVE_KEY is None else []
    for n in _state_names(ps):
        setattr(ps, n, None)
    _clear_megatron_caches()
    _ACTIVE, _ACTIVE_KEY = None, None
    if untracked:
        _deregister(untracked)
        _release_later(untracked)


def _evict(keep: int) -> None:
    """Destroy the least recently used inactive layouts until at most ``keep`` remain."""
    victims = [k for k in _CACHE if k != _ACTIVE_KEY][:max(0, len(_CACHE) - max(keep, 0))]
    # one list holds the last references: the popped entries die here, the groups on release
    pgs = [g for k in victims for g in _CACHE.pop(k).pgs]
    if pgs:
        _deregister(pgs)
        _release_later(pgs)


def _distinct(pgs: Optional[list]) -> list:
    return list({id(g): g for g in pgs or [] if g is not None}.values())


def _deregister(pgs: list) -> None:
    # Every rank must have finished connecting these groups before any rank closes them: gloo's
    # connectFullMesh returns on the active side of a pair once it wrote its handshake, and a
    # close (a reset) before the passive peer accepted it fails that peer with "Gloo
    # connectFullMesh failed ... Connection closed by peer" (seen under CPU load, 3 runs in 4
    # with two busy loops beside the 100-rebuild test). Every rank deregisters at the same
    # point of the call sequence (the cache invariant; each rank is in at least one group of
    # every layout, so ``pgs`` is never empty on some ranks only), so this barrier on the
    # world, never destroyed here, is matched on every rank.
    dist.barrier()
    for g in pgs:
        if g in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(g)


_RELEASING: list[threading.Thread] = []
_MAX_RELEASING = 2


def _release_later(pgs: list) -> None:
    """Drop ``pgs`` (the caller's last references to these groups) on a helper thread."""
    _RELEASING[:] = [t for t in _RELEASING if t.is_alive()]
    while len(_RELEASING) >= _MAX_RELEASING:   # bound the fds and threads in flight
        _RELEASING.pop(0).join()
    # not a daemon: interpreter exit joins it rather than freezing it inside a destructor
    t = threading.Thread(target=pgs.clear, name="earl-release-groups")
    t.start()
    _RELEASING.append(t)


def wait_released() -> None:
    """Block until groups handed to helper threads are destroyed (fds and threads freed)."""
    while _RELEASING:
        _RELEASING.pop(0).join()


def _clear_megatron_caches() -> None:
    """Caches keyed on the old groups' sizes that must not survive a regroup."""
    from megatron.core import parallel_state as ps

    if hasattr(ps, "_GLOBAL_MEMORY_BUFFER"):
        ps._GLOBAL_MEMORY_BUFFER = None


def has_gloo_side_groups() -> bool:
    """Whether Megatron's extra gloo groups exist (only with a non-gloo default backend)."""
    return not gloo_only()


def current_pg_collection():
    """Megatron-Core's ProcessGroupCollection for the active layout."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    if _ACTIVE is None:
        raise RuntimeError("no layout is active: call build_groups(layout) first")
    return ProcessGroupCollection.use_mpu_process_groups()


def coords_of_this_rank():
    """This rank's (tp, cp, pp, dp) coordinates under the active layout, as Megatron sees them."""
    from megatron.core import parallel_state as ps

    return dict(tp=ps.get_tensor_model_parallel_rank(), cp=ps.get_context_parallel_rank(),
                pp=ps.get_pipeline_model_parallel_rank(),
                dp=ps.get_data_parallel_rank(with_context_parallel=False))


def tp_group():
    from megatron.core import parallel_state as ps
    return ps.get_tensor_model_parallel_group()


def cp_group():
    from megatron.core import parallel_state as ps
    return ps.get_context_parallel_group()


def pp_group():
    from megatron.core import parallel_state as ps
    return ps.get_pipeline_model_parallel_group()


def dp_group(with_context_parallel: bool = False):
    from megatron.core import parallel_state as ps
    return ps.get_data_parallel_group(with_context_parallel=with_context_parallel)


def is_pipeline_first_stage() -> bool:
    from megatron.core import parallel_state as ps
    return ps.is_pipeline_first_stage()


def is_pipeline_last_stage() -> bool:
    from megatron.core import parallel_state as ps
    return ps.is_pipeline_last_stage()


def timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
