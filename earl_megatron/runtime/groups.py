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

Split placement (``build_pool_groups(pools)``): the world is consecutive rank ranges, each a
pool with its own layout (train ranks first, then rollout: plan/split.py). Each pool's
``initialize_model_parallel`` runs on every rank with parallel_state seeing the pool as the
world (``_pool_as_world``: its own ``torch`` name redirected, nothing else), so every rank
creates every pool's groups in the same order and keeps only its own pool's globals, rank lists
in global ranks. A pool's Megatron code then runs as if its pool were the world, at the same
time as the other pool's; ``pool_world`` redirects what Megatron still sends to the world
(optimizer setup), ``pool_group`` / ``pool_rank`` serve the project's own pool-wide calls.
``build_groups(layout)`` is the one-pool case.

    build_pool_groups((DP2, TP2))   ranks 0-1: DP2 groups [0, 1]; ranks 2-3: TP2 groups [2, 3]

Invariants:
- All ranks call ``build_groups`` / ``build_pool_groups`` (and ``set_group_cache_size``) with
  the same sequence of layouts, pools and options. Cache hits, misses and evictions are a function of that sequence only, so
  every rank creates the same groups in the same order (torch's ``new_group`` requires it) and no
  collective is needed to agree on them.
- At most one layout is active. While one is active, parallel_state's globals are exactly those
  its ``initialize_model_parallel`` set (plus a fresh ``GlobalMemoryBuffer``); deactivating it
  sets every parallel_state data global back to its import-time None, including those
  ``destroy_model_parallel()`` forgets (``*_GLOBAL_RANKS``, ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP
  _WITH_CP``, which still holds the old dp-cp group) and never destroys a group.
- A cache key is (pool's first rank, layout, world size, timeout, backend): a pool is cached
  alone, a plain layout is the pool at rank 0 of the whole world. Two keys never share group
  objects (each initialisation creates its own), so destroying one layout's groups never
  touches another; a rank's entry for a pool it is not in holds none.
  A group is deregistered and released exactly once: when its layout is evicted (the least
  recently used inactive one, when a miss would exceed the bound) or by ``destroy_groups()``.
  The active layout is never evicted. ``max_cached_layouts`` <= 1 is the uncached behaviour:
  every regroup destroys the old layout's groups before creating the new ones.
- Each cached layout keeps its groups' resources (~20 fds, ~10 threads a rank on 4 gloo ranks).
- Group timeouts are short (``set_group_timeout``, ``cluster.group_timeout_s``, default 600 s,
  below the world's ``cluster.collective_timeout_s``): a mismatched collective fails in minutes.
- Every group inherits the world's device-mapped backend (runtime/dist.py): on a host with GPUs
  a layout's groups carry CUDA tensors over NCCL and CPU tensors over gloo.
- Evicted groups are deregistered at once and freed (gloo's destructor sleeps ~30 ms a group)
  on helper threads, at most two batches in flight; ``wait_released()`` joins them.
- The layout is checked against the world size (pools: each against its size, their sum against
  the world's) before anything changes.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from earl_megatron.config.model import ModelConfig
from earl_megatron.config.cluster import ClusterConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.runtime.dist import gloo_only

DEFAULT_MAX_CACHED_LAYOUTS = ClusterConfig.group_cache_layouts   # one default: the config's
"""Layouts whose groups stay alive (the active one included); <= 1 disables the cache. Cheap on
gloo since a layout holds one group per distinct rank list (2-4 a rank on 4 ranks: ~5 threads
and ~20 fds; 4 cached layouts cost a compute-bound job 1-2% more CPU time, measured by
benchmarks/group_cache.py, against 8-24% with Megatron's 17 groups a rank)."""


@dataclass(frozen=True)
class _LayoutGroups:
    """One layout's Megatron state on this rank: the parallel_state globals its initialisation
    set (``_global_process_group_list`` included)."""

    state: dict[str, Any]
    pool: Optional[Pool]
    """None: a pool this rank is not in (kept so every rank's cache decides alike)."""

    @property
    def pgs(self) -> list:
        """The distinct groups of this layout that this rank belongs to, each once (several
        globals alias one group; Megatron's list holds None for the default group)."""
        return _distinct(self.state.get("_global_process_group_list"))


_CacheKey = tuple   # (pool's first rank, layout, world_size, timeout_s, backend)
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


def cached_layouts() -> list:
    """Layouts whose groups are cached on this rank, least recently used first; a pool that is
    not the whole world as (its first rank, its layout)."""
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
"""The cache keys of the pools made current last (every rank's alike): never evicted."""


def build_pool_groups(pools: Sequence[ParallelLayout], model: Optional[ModelConfig] = None, *,
                      timeout_s: Optional[float] = None, seed: Optional[int] = None,
                      max_cached_layouts: Optional[int] = None) -> Pool:
    """Split placement: the world is ``pools``, consecutive rank ranges (the first pool's ranks
    first), each with its own layout; make this rank's pool's Megatron-Core groups current and
    return its ``Pool``. One pool is ``build_groups``.

    Every rank calls it with the same ``pools``. Each (pool ranks, layout) is cached on its own,
    so one pool changing its layout leaves the other pool's groups (and its models) alone. A
    pool not cached yet is initialised on every rank, in pool order, with parallel_state seeing
    the pool as the world (``_pool_as_world``): every rank creates every group in the same order,
    as torch's ``new_group`` requires, non-members only counting it (their cache entry for the
    pool holds no group, so every rank's cache decides alike). This rank keeps its own pool's
    parallel_state globals, rank lists in global ranks. Megatron code then runs per pool as if
    its pool were the world; what still speaks to the world (Megatron's optimizer setup:
    ``pool_world``) is redirected to the pool."""
    from megatron.core import parallel_state as ps
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
        _evict(keep=0)   # no cache: every regroup, even to the same layout, starts afresh
    for k in keys:       # the pools asked for now are the most recently used
        if k in _CACHE:
            _CACHE.move_to_end(k)
    missing = [i for i, k in enumerate(keys) if k not in _CACHE]
    if missing:
        _evict(keep=bound - len(missing), spare=keys)  # room first: old groups go first
    for i in missing:
        offset, lay = offsets[i], pools[i]
        with _one_group_per_rank_list(ps, enabled=gloo), \
                _pool_as_world(ps, offset, lay.world_size, len(pools) > 1):
            ps.initialize_model_parallel(
                tensor_model_parallel_size=lay.tp,
                pipeline_model_parallel_size=lay.pp,
                context_parallel_size=lay.cp,
                expert_model_parallel_size=lay.ep,
                expert_tensor_parallel_size=lay.expert_tp,
                distributed_timeout_minutes=timeout_s / 60.0,
                order="tp-cp-ep-dp-pp",
                # On a CPU-only world the regular groups are gloo already; Megatron's extra
                # gloo groups would only double the fds and threads. With GPUs its regular
                # groups carry CPU tensors too (runtime/dist.py), and Megatron's own gloo
                # side groups (distributed optimizer, checkpoints) are made as it expects.
                create_gloo_process_groups=not gloo,
            )
        state = {n: getattr(ps, n) for n in _state_names(ps)
                 if n not in _FRESH and getattr(ps, n) is not None}
        for n in _state_names(ps):
            setattr(ps, n, None)
        group = None
        if len(pools) > 1:      # the pool's ranks as one group: every rank creates it
            group = dist.new_group(list(range(offset, offset + lay.world_size)),
                                   timeout=timedelta(seconds=timeout_s))
        if i == index:
            if group is not None:
                state["_global_process_group_list"] = \
                    list(state.get("_global_process_group_list") or [None]) + [group]
            _CACHE[keys[i]] = _LayoutGroups(state=state, pool=Pool(i, offset, lay, group))
        else:                   # not a member: nothing of it lives on this rank
            _CACHE[keys[i]] = _LayoutGroups(state={}, pool=None)
    key = keys[index]
    entry = _CACHE[key]
    for n, v in entry.state.items():
        setattr(ps, n, v)
    if hasattr(ps, "_set_global_memory_buffer"):
        ps._set_global_memory_buffer()
    for k in keys:      # in pool order: every rank's cache keeps the same order
        _CACHE.move_to_end(k)
    _ACTIVE, _ACTIVE_KEY, _POOL = entry.pool.layout, key, entry.pool
    _IN_USE[:] = keys
    _evict(keep=bound)   # a per-call bound may be below the number cached
    if seed is not None:
        model_parallel_cuda_manual_seed(seed)
    return entry.pool


_RANK_LISTS = ("_EMBEDDING_GLOBAL_RANKS", "_POSITION_EMBEDDING_GLOBAL_RANKS",
               "_PIPELINE_GLOBAL_RANKS", "_DATA_PARALLEL_GLOBAL_RANKS",
               "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS", "_MODEL_PARALLEL_GLOBAL_RANKS",
               "_CONTEXT_PARALLEL_GLOBAL_RANKS", "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP",
               "_EXPERT_MODEL_PARALLEL_RANKS")
"""parallel_state's globals that hold rank lists (global ranks once initialised)."""


class _Redirected:
    """A module seen through: ``overrides`` first, then the module's own attributes."""

    def __init__(self, base, **overrides):
        self._base = base
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._base, name)


@contextlib.contextmanager
def _pool_as_world(ps, offset: int, size: int, enabled: bool):
    """While Megatron initialises one pool's layout, parallel_state (and only it: its own
    ``torch`` name is swapped) sees ranks ``offset .. offset + size - 1`` as the world: world
    size ``size``, this rank's rank minus ``offset`` (out of range off the pool: Megatron then
    sets nothing, but still creates every group, as every rank must), and the rank lists it
    creates groups from shifted by ``offset``. Afterwards its rank lists are shifted back to
    global ranks."""
    if not enabled:
        yield
        return
    real = ps.torch
    d = real.distributed

    def get_world_size(group=None):
        return size if group is None else d.get_world_size(group)

    def get_rank(group=None):
        if group is not None:
            return d.get_rank(group)
        r = d.get_rank() - offset
        return r if 0 <= r < size else -1

    def new_group(ranks=None, **kw):
        ranks = range(size) if ranks is None else ranks
        return d.new_group(ranks=[r + offset for r in ranks], **kw)

    ps.torch = _Redirected(real, distributed=_Redirected(
        d, get_world_size=get_world_size, get_rank=get_rank, new_group=new_group))
    try:
        yield
    finally:
        ps.torch = real
    for n in _RANK_LISTS:
        v = getattr(ps, n, None)
        if v is not None:
            setattr(ps, n, [r + offset for r in v])


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


@contextlib.contextmanager
def pool_world():
    """torch.distributed's world queries and ``all_gather_object`` without a group act on the
    active pool inside (nothing changes when the pool is the world). For Megatron code that
    speaks to the world with no group to pass: 0.16's ``get_megatron_optimizer`` gathers every
    rank's parameter groups over the world (``_get_param_groups``)."""
    group = pool_group()
    if group is None:
        yield
        return
    gws, ago = dist.get_world_size, dist.all_gather_object
    dist.get_world_size = lambda group=None: gws(group if group is not None else pool_group())
    dist.all_gather_object = lambda out, obj, group=None: ago(
        out, obj, group=group if group is not None else pool_group())
    try:
        yield
    finally:
        dist.get_world_size, dist.all_gather_object = gws, ago


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


def _key(offset: int, layout: ParallelLayout, timeout_s: float) -> _CacheKey:
    return (offset, layout, dist.get_world_size(), float(timeout_s), dist.get_backend())


def activate(layout: ParallelLayout, *, timeout_s: Optional[float] = None) -> bool:
    """Make ``layout``'s cached groups current again (no collective); False if they are not
    cached (evicted, or never built with these options), in which case nothing changes. Models
    built under ``layout`` earlier are usable again after True."""
    timeout_s = group_timeout_s() if timeout_s is None else timeout_s
    key = _key(0, layout, timeout_s)
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

    global _ACTIVE, _ACTIVE_KEY, _POOL
    # a list while nothing is active: groups made outside build_groups (we reset it to None)
    untracked = _distinct(ps._global_process_group_list) if _ACTIVE_KEY is None else []
    for n in _state_names(ps):
        setattr(ps, n, None)
    _clear_megatron_caches()
    _ACTIVE, _ACTIVE_KEY, _POOL = None, None, None
    _IN_USE.clear()
    if untracked:
        _deregister(untracked)
        _release_later(untracked)


def _evict(keep: int, spare: Sequence = ()) -> None:
    """Destroy the least recently used inactive layouts (pools) until at most ``keep`` remain,
    never one of ``spare`` (the pools being built) or of the pools in use (the same on every
    rank: the active key alone is each pool's own)."""
    victims = [k for k in _CACHE if k not in _IN_USE and k not in spare][
        :max(0, len(_CACHE) - max(keep, 0))]
    # one list holds the last references: the popped entries die here, the groups on release
    pgs = [g for k in victims for g in _CACHE.pop(k).pgs]
    if victims:     # on every rank alike, even where the victims held no group (a pool's
        _deregister(pgs)    # non-member)
        _release_later(pgs)


def _distinct(pgs: Optional[list]) -> list:
    return list({id(g): g for g in pgs or [] if g is not None}.values())


def _deregister(pgs: list) -> None:
    # Every rank must have finished connecting these groups before any rank closes them: gloo's
    # connectFullMesh returns on the active side of a pair once it wrote its handshake, and a
    # close (a reset) before the passive peer accepted it fails that peer with "Gloo
    # connectFullMesh failed ... Connection closed by peer" (seen under CPU load, 3 runs in 4
    # with two busy loops beside the 100-rebuild test). Every rank deregisters at the same
    # point of the call sequence (the cache invariant: every rank evicts the same keys, a
    # pool's non-members too, whose entry holds no group), so this barrier on the world, never
    # destroyed here, is matched on every rank.
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


def is_pipeline_last_stage() -> bool:
    from megatron.core import parallel_state as ps
    return ps.is_pipeline_last_stage()


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
