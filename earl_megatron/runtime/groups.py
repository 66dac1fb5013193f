"""The one bridge to Megatron-Core's process groups: build, cache and tear down groups per layout.

Every other module receives a ``ParallelLayout`` (and, where it needs communicators, a
``ProcessGroupCollection`` from ``current_pg_collection()``); none imports parallel_state.

Split placement (``build_pool_groups(pools)``): the world is consecutive rank ranges, each a
pool with its own layout (train ranks first, then rollout: plan/split.py). Each pool's groups
are laid out by Megatron-Core's ``HyperCommGrid`` with the pool's first rank as its rank offset
(runtime/pool_grid.py), every rank creating every pool's groups in the same order; this rank's
pool's groups are then installed where the pinned Megatron-Core still reads parallel_state
globals (runtime/megatron_globals.py, the one shim) and handed to GPTModel and DDP as a
``ProcessGroupCollection`` (runtime/build.py). A pool's Megatron code runs as if its pool were
the world, at the same time as the other pool's; ``pool_group`` / ``pool_rank`` serve the
project's own pool-wide calls. ``build_groups(layout)`` is the one-pool case.

A pool switching layouts alone (split's train pool, LOGPROB <-> TRAIN while the rollout pool
plays) calls ``build_pool_groups(pools, local=True)``: groups made by their members alone
(pool_grid ``local``), nothing on the world (no world barrier, no world-made group destroyed).

    build_pool_groups((DP2, TP2))   ranks 0-1: DP2 groups [0, 1]; ranks 2-3: TP2 groups [2, 3]

RL regroups between the same few layouts every iteration (rollout / logprob / train), and
creating a layout's groups is most of a regroup's fixed cost, so the groups of the
``max_cached_layouts`` most recently used layouts (pools) are kept (LRU, default 4). On gloo a
layout gets one group per distinct rank list (pool_grid's ``alias``): 2-4 a rank on 4 ranks.

    build_groups(A)  miss: A's groups created, installed
    build_groups(B)  A deactivated (globals reset, groups kept); miss for B
    build_groups(A)  B deactivated; hit: A's groups installed again, none created

Invariants:
- All ranks call ``build_groups`` / ``build_pool_groups`` (and ``set_group_cache_size``) with
  the same sequence of layouts, pools and options. Cache hits, misses and evictions are a
  function of that sequence only, so every rank creates the same groups in the same order
  (torch's ``new_group`` requires it) and no collective is needed to agree on them.
- At most one layout (a pool's) is active on a rank; parallel_state's globals are then exactly
  its groups (megatron_globals.install); deactivating resets them and never destroys a group.
- A cache key is (pool's first rank, layout, world size, timeout, backend): a pool is cached
  alone, a plain layout is the pool at rank 0 of the whole world. Two keys never share a group,
  so destroying one layout's groups never touches another; a rank's entry for a pool it is not
  in holds none. A group is destroyed exactly once: when its layout is evicted (the least
  recently used not in use, when a miss would exceed the bound) or by ``destroy_groups()``.
  ``max_cached_layouts`` <= 1 is the uncached behaviour: every regroup destroys the old groups
  before creating the new ones. Each cached layout keeps its groups' resources (~20 fds, ~10
  threads a rank on 4 gloo ranks).
- ``local=True`` calls follow the sequence rule within the pool; their entries hold no group
  the cache destroys (pool_grid keeps them), and a local call evicts only such entries. The
  world's entries are evicted by their own order (``_SHARED``), which local calls never move,
  so what a pool made alone never makes two ranks evict differently; a world call for a key a
  pool made alone makes that key's groups anew.
- Group timeouts are short (``set_group_timeout``, ``cluster.group_timeout_s``, default 600 s,
  below the world's ``cluster.collective_timeout_s``): a mismatched collective fails in minutes.
- Every group inherits the world's device-mapped backend (runtime/dist.py); beside NCCL groups
  Megatron's gloo side groups are made too.
- Evicted groups are destroyed at once and freed (gloo's destructor sleeps ~30 ms a group) on
  helper threads, at most two batches in flight; ``wait_released()`` joins them.
- The layout is checked against the world size (pools: each against its size, their sum against
  the world's) before anything changes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from earl_megatron.config.model import ModelConfig
from earl_megatron.config.cluster import ClusterConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.runtime import megatron_globals
from earl_megatron.runtime.dist import gloo_only
from earl_megatron.runtime.group_release import (  # noqa: F401 (public: wait_released)
    deregister as _deregister, release_later as _release_later, wait_released)
from earl_megatron.runtime.pool_grid import PoolGroups, build_pool

DEFAULT_MAX_CACHED_LAYOUTS = ClusterConfig.group_cache_layouts   # one default: the config's
"""Layouts whose groups stay alive (the active one included); <= 1 disables the cache. 4 cost a
compute-bound job 1-2% more CPU on gloo (benchmarks/group_cache.py)."""


@dataclass(frozen=True)
class _LayoutGroups:
    """One pool's (layout's) groups on this rank."""

    groups: PoolGroups
    pool: Optional[Pool]
    """None: a pool this rank is not in (kept so every rank's cache decides alike)."""
    local: bool = False   # made by the pool's ranks alone (build_pool_groups(local=True))

    @property
    def pgs(self) -> list:
        """The distinct groups of this pool that this rank belongs to, each once."""
        return list(self.groups.created)


_CacheKey = tuple   # (pool's first rank, layout, world_size, timeout_s, backend)
_CACHE: "OrderedDict[_CacheKey, _LayoutGroups]" = OrderedDict()   # least recently used first
_ACTIVE: Optional[ParallelLayout] = None
_ACTIVE_KEY: Optional[_CacheKey] = None
_MAX_CACHED: Optional[int] = None      # None: DEFAULT_MAX_CACHED_LAYOUTS
DEFAULT_GROUP_TIMEOUT_S = ClusterConfig.group_timeout_s   # one default: the config's
_GROUP_TIMEOUT_S: Optional[float] = None   # None: DEFAULT_GROUP_TIMEOUT_S


def set_group_cache_size(n: Optional[int]) -> None:
    """Keep the groups of at most ``n`` layouts (the active one included; <= 1: none; None: the
    default); inactive ones beyond it are destroyed now. Call it on every rank alike."""
    global _MAX_CACHED
    if n is not None and (not isinstance(n, int) or n < 0):
        raise ValueError(f"max_cached_layouts must be an integer >= 0 or None, got {n!r}")
    _MAX_CACHED = n
    if dist.is_initialized():
        _evict(keep=group_cache_size())


def set_group_timeout(seconds: Optional[float]) -> None:
    """Timeout of groups built from now on (None: 600 s); a cache key part: every rank alike."""
    global _GROUP_TIMEOUT_S
    if seconds is not None and not seconds > 0:
        raise ValueError(f"group timeout must be > 0 seconds or None, got {seconds!r}")
    _GROUP_TIMEOUT_S = seconds


def group_timeout_s() -> float:
    return DEFAULT_GROUP_TIMEOUT_S if _GROUP_TIMEOUT_S is None else _GROUP_TIMEOUT_S


def group_cache_size() -> int:
    """The bound in force: the one set, or the default."""
    return DEFAULT_MAX_CACHED_LAYOUTS if _MAX_CACHED is None else _MAX_CACHED


def cached_layouts() -> list:
    """Layouts cached on this rank, least recently used first; a pool as (first rank, layout)."""
    return [lay if off == 0 and lay.world_size == world else (off, lay)
            for off, lay, world, *_ in _CACHE]


def build_groups(layout: ParallelLayout, model: Optional[ModelConfig] = None, *,
                 timeout_s: Optional[float] = None, seed: Optional[int] = None,
                 max_cached_layouts: Optional[int] = None) -> ParallelLayout:
    """Make Megatron-Core's process groups for ``layout`` current (collective over the world
    when they are created; a cache hit communicates nothing). ``max_cached_layouts`` overrides
    the module's bound (``set_group_cache_size``) for this call."""
    return build_pool_groups((layout,), model, timeout_s=timeout_s, seed=seed,
                             max_cached_layouts=max_cached_layouts).layout


@dataclass(frozen=True)
class Pool:
    """This rank's pool: ranks ``offset .. offset + layout.world_size - 1`` of the world run
    ``layout`` (rank ``offset + i`` is the layout's rank i); ``index`` among the world's pools."""

    index: int
    offset: int
    layout: ParallelLayout
    group: Any = None
    """The pool's ranks as one group (None: the pool is the world)."""

    @property
    def ranks(self) -> range:
        return range(self.offset, self.offset + self.layout.world_size)


_POOL: Optional[Pool] = None
_IN_USE: list = []
"""The cache keys of the pools made current last: never evicted."""
_SHARED: list = []
"""The keys of the entries the world made (not ``local``), least recently used first, moved
only by the calls every rank makes: every rank evicts them alike whatever its pool made alone."""


def build_pool_groups(pools: Sequence[ParallelLayout], model: Optional[ModelConfig] = None, *,
                      timeout_s: Optional[float] = None, seed: Optional[int] = None,
                      max_cached_layouts: Optional[int] = None, local: bool = False) -> Pool:
    """Split placement: the world is ``pools``, consecutive rank ranges (the first pool's ranks
    first), each with its own layout; make this rank's pool's Megatron-Core groups current and
    return its ``Pool``. One pool is ``build_groups``.

    Every rank calls it with the same ``pools``. Each (pool ranks, layout) is cached on its own,
    so one pool changing its layout leaves the other pool's groups (and its models) alone. A
    pool not cached yet is created on every rank, in pool order (pool_grid.build_pool), as
    torch's ``new_group`` requires; a non-member's cache entry holds no group, so every rank's
    cache decides alike.

    ``local``: only this rank's pool's ranks call (module docstring); the other pools' groups
    are neither made nor needed."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    global _ACTIVE, _ACTIVE_KEY, _POOL
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call "
                           "earl_megatron.runtime.dist.init_distributed() (or run under torchrun) "
                           "before building groups")
    pools = tuple(pools)
    world, me = dist.get_world_size(), dist.get_rank()
    if len(pools) > 1:
        if sum(p.world_size for p in pools) != world:
            raise ValueError(f"pools {[str(p) for p in pools]} hold "
                             f"{sum(p.world_size for p in pools)} ranks; the world has {world}")
        for p in pools:
            p.check(p.world_size, model)
    else:
        pools[0].check(world, model)
    bound = group_cache_size() if max_cached_layouts is None else max_cached_layouts
    gloo = gloo_only()
    timeout_s = group_timeout_s() if timeout_s is None else timeout_s
    offsets = [sum(p.world_size for p in pools[:i]) for i in range(len(pools))]
    keys = [_key(o, p, timeout_s) for o, p in zip(offsets, pools)]
    index = next(i for i, o in enumerate(offsets) if o <= me < o + pools[i].world_size)
    _deactivate()
    if bound <= 1:
        _evict(keep=0, local=local)   # no cache: every regroup starts afresh
    for k in keys:       # the pools asked for now are the most recently used
        if k in _CACHE and _CACHE[k].local and not local:
            _CACHE.pop(k)    # a pool's own groups: the world makes its own for this key
        if k in _CACHE:
            _CACHE.move_to_end(k)
    missing = [i for i, k in enumerate(keys) if k not in _CACHE and (not local or i == index)]
    if missing:
        _evict(keep=bound - len(missing), spare=keys, local=local)  # room first
    for i in missing:
        made = build_pool(pools[i], offsets[i], timeout_s=timeout_s, alias=gloo,
                          # gloo world: gloo already; GPUs: Megatron's gloo side groups too
                          gloo_side=not gloo, pool_group=len(pools) > 1, local=local)
        _CACHE[keys[i]] = _LayoutGroups(
            made, Pool(i, offsets[i], pools[i], made.pool) if made.member else None, local)
    key = keys[index]
    entry = _CACHE[key]
    megatron_globals.install(megatron_globals.state_of(entry.groups))
    for k in keys:      # in pool order: every rank's cache keeps the same order
        if k in _CACHE:
            _CACHE.move_to_end(k)
        if not local and k in _CACHE:
            _SHARED[:] = [x for x in _SHARED if x != k] + [k]
    _ACTIVE, _ACTIVE_KEY, _POOL = entry.pool.layout, key, entry.pool
    _IN_USE[:] = keys
    _evict(keep=bound, local=local)   # a per-call bound may be below the number cached
    if seed is not None:
        model_parallel_cuda_manual_seed(seed)
    return entry.pool


def current_pool() -> Pool:
    """This rank's pool under the active groups (the whole world when there is one pool)."""
    if _POOL is None:
        raise RuntimeError("no layout is active: call build_groups(layout) first")
    return _POOL


def pool_group():
    """The active pool's ranks as one group; None (the world) when the pool is the world or
    no groups are active."""
    return None if _POOL is None else _POOL.group


def pool_span() -> tuple[int, int]:
    """(first rank, number of ranks) of the active pool (no groups active: the world's)."""
    if _POOL is None:
        return 0, dist.get_world_size()
    return _POOL.offset, _POOL.layout.world_size


def pool_rank() -> int:
    """This rank's rank in its pool, i.e. in the pool's layout (no groups active: the world's)."""
    return dist.get_rank() - (0 if _POOL is None else _POOL.offset)


def pool_world():
    """Inside, on this thread only, world size and ``all_gather_object`` without a group act on
    the active pool (megatron_globals.world_is): for Megatron-Core 0.16.1's one world call with
    no group to pass, ``get_megatron_optimizer``'s ``_get_param_groups``."""
    return megatron_globals.world_is(pool_group())


def _key(offset: int, layout: ParallelLayout, timeout_s: float) -> _CacheKey:
    return (offset, layout, dist.get_world_size(), float(timeout_s), dist.get_backend())


def activate_pool(pools: Sequence[ParallelLayout]) -> bool:
    """This rank's pool of ``pools`` current again from the cache, locally; False: not cached."""
    me, at = dist.get_rank(), [sum(p.world_size for p in pools[:i]) for i in range(len(pools))]
    i = next(i for i, o in enumerate(at) if o <= me < o + pools[i].world_size)
    key = _key(at[i], pools[i], group_timeout_s())
    if key in _CACHE and _ACTIVE_KEY != key:
        build_pool_groups(pools, local=True)
    return key in _CACHE


def activate(layout: ParallelLayout, *, timeout_s: Optional[float] = None) -> bool:
    """Make ``layout``'s cached groups current again (no collective), and models built under it
    usable; False, changing nothing: not cached (evicted, or built with other options)."""
    timeout_s = group_timeout_s() if timeout_s is None else timeout_s
    key = _key(0, layout, timeout_s)
    if key not in _CACHE:
        return False
    if _ACTIVE_KEY != key:
        build_groups(layout, timeout_s=timeout_s)
    return True


def destroy_groups(*, background: bool = False) -> None:
    """Reset Megatron's globals and destroy every group of every cached layout. ``background``:
    deregistered (unusable) at once, the last references dropped on a helper thread (gloo's
    destructor sleeps ~30 ms a group; runtime/group_release.py); else waits for all."""
    _deactivate()
    _evict(keep=0)
    if not background:
        wait_released()


def _deactivate() -> None:
    """Make no layout current: reset Megatron's globals, keep the active layout's groups cached;
    groups Megatron holds that this module did not create (initialize_model_parallel) die."""
    global _ACTIVE, _ACTIVE_KEY, _POOL
    untracked = _distinct(megatron_globals.untracked_groups())
    megatron_globals.reset()
    _ACTIVE, _ACTIVE_KEY, _POOL = None, None, None
    _IN_USE.clear()
    if untracked:
        _deregister(untracked)
        _release_later(untracked)


def _evict(keep: int, spare: Sequence = (), local: bool = False) -> None:
    """Down to ``keep`` layouts: drop the least recently used local entries (nothing destroyed),
    then, unless ``local``, destroy world-made ones beyond ``keep`` of them by ``_SHARED``'s
    order (every rank alike); never one of ``spare`` (being built) or in use."""
    mine = [k for k in _CACHE if _CACHE[k].local and k not in _IN_USE and k not in spare]
    for k in mine[:max(0, len(_CACHE) - max(keep, 0))]:
        _CACHE.pop(k)
    if local:
        return
    shared = [k for k in _SHARED if k in _CACHE]
    victims = [k for k in shared if k not in _IN_USE and k not in spare
               ][:max(0, len(shared) - max(keep, 0))]
    _SHARED[:] = [k for k in shared if k not in victims]
    # one list holds the last references: the popped entries die here, the groups on release
    pgs = [g for k in victims for g in _CACHE.pop(k).pgs]
    if victims:     # on every rank alike, even where the victims held no group (a pool's
        _deregister(pgs)    # non-member)
        _release_later(pgs)


def _distinct(pgs: Optional[list]) -> list:
    return list({id(g): g for g in pgs or [] if g is not None}.values())


def has_gloo_side_groups() -> bool:
    """Whether Megatron's extra gloo groups exist (only with a non-gloo default backend)."""
    return not gloo_only()


def current_pg_collection():
    """Megatron-Core's ProcessGroupCollection of the active pool's groups on this rank."""
    if _ACTIVE_KEY is None:
        raise RuntimeError("no layout is active: call build_groups(layout) first")
    return _CACHE[_ACTIVE_KEY].groups.collection()


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


def is_pipeline_last_stage() -> bool:
    from megatron.core import parallel_state as ps
    return ps.is_pipeline_last_stage()


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
