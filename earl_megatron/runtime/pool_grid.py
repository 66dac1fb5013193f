"""One pool's Megatron-Core process groups, laid out by Megatron's ``HyperCommGrid``.

A pool is a consecutive rank range ``offset .. offset + layout.world_size - 1`` of the world
running one ``ParallelLayout`` (split placement: the train pool first, then the rollout pool; a
plain layout is the pool at offset 0 that spans the world). ``build_pool(layout, offset, ...)``
enumerates the pool's rank lists with ``megatron.core.hyper_comm_grid.HyperCommGrid`` (its
``rank_offset`` is the pool's first rank), creates one torch group per list and returns this
rank's ``PoolGroups``: its group and rank list for every axis Megatron-Core uses, and the
``ProcessGroupCollection`` that GPTModel and DDP take. Nothing here touches parallel_state;
runtime/megatron_globals.py installs a pool's groups where the pinned Megatron-Core still reads
globals.

Axes, as ``initialize_model_parallel(order="tp-cp-ep-dp-pp")`` makes them: dense axes on a
[tp, cp, dp, pp] grid, expert axes on an [etp, ep, edp, pp] grid (Megatron's expert rank
generator), embedding groups from each pp list (first and last stage; position: first), the
distributed optimizer instance group from ``edp`` consecutive tp-ep-pp lists.

Invariants:
- Every rank calls ``build_pool`` for every pool, in the same order, with the same arguments:
  torch's ``new_group`` is collective over the world, so a rank creates the groups of a pool it
  is not in too, and keeps none of them (``PoolGroups.member`` False).
- Rank lists are global ranks; a group holds exactly its list.
- ``alias`` (a gloo-only world): one group per distinct (rank list, backend) in the pool, shared
  by every axis with those members. Megatron asks for 41-50 groups a layout on 4 ranks (17 on
  each rank) but they hold 2-4 distinct lists a rank, and every gloo group runs its own device
  loop (threads, fds, a 10 ms poll), so aliasing cuts a layout's groups and idle cost 4-8x. Safe
  on gloo: members of identical lists issue their collectives in the same program order on every
  rank, and point-to-point ops are tagged apart from collectives. Not done on NCCL, where one
  communicator's operations share a stream and Megatron overlaps distinct groups' communication.
  Groups are never shared between two ``build_pool`` calls, so destroying one pool's groups never
  touches another's.
- ``gloo_side``: the gloo copies Megatron keeps beside NCCL groups (dp, dp-cp, expert dp: its
  distributed optimizer and checkpoints) are made too, on gloo.
- ``local`` (split placement's train pool switching layouts while the rollout pool plays): only
  the pool's ranks call ``build_pool``, and each list is made by its members alone
  (``new_group(use_local_synchronization=True)``). Such a group is one per distinct (rank list,
  backend, timeout) for the whole process (``_LOCAL``), shared by every local layout of the
  pool and never destroyed: torch names a locally made group by a hash of its ranks and the
  number of groups the rank holds, so a list made again after a destroy can take a dead
  group's name, whose rendezvous keys are still in the store, and hang (measured: the second
  ``new_group([0, 1], use_local_synchronization=True)`` after a destroy never returned). A
  process holds at most one such group per distinct list of its pool's layouts (a handful).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from earl_megatron.plan.layout import ParallelLayout

DENSE_AXES = ("tp", "cp", "dp", "pp")
"""Megatron's dense order tp-cp-dp-pp (ep is 1 there), fastest varying first."""
EXPERT_AXES = ("tp", "ep", "dp", "pp")
"""Megatron's expert order, on sizes (etp, ep, edp, pp)."""

# this rank's axis name -> (grid, dims): one torch group per list of the enumeration
_DENSE = (("dp_cp", ("cp", "dp")), ("dp", "dp"), ("cp", "cp"), ("mp", ("tp", "pp")),
          ("tp", "tp"), ("pp", "pp"))     # Megatron's creation order
_DENSE_LATE = (("tp_dp_cp", ("tp", "cp", "dp")), ("tp_dp", ("tp", "dp")), ("tp_cp", ("tp", "cp")))
_EXPERT = (("ep", "ep"), ("expt_tp", "tp"), ("tp_ep", ("tp", "ep")),
           ("tp_ep_pp", ("tp", "ep", "pp")), ("expt_dp", "dp"))


@dataclass(frozen=True)
class PoolGroups:
    """This rank's groups of one pool (empty where the rank is not in it)."""

    layout: ParallelLayout
    offset: int
    member: bool
    groups: dict[str, Any] = field(default_factory=dict)
    """axis -> this rank's group: the ``ProcessGroupCollection`` names (tp, pp, mp, embd,
    pos_embd, cp, tp_cp, ep, expt_tp, tp_ep, tp_ep_pp, tp_dp_cp, tp_dp, dp, dp_cp, expt_dp,
    intra_dist_opt); embd / pos_embd only on the stages that hold embeddings."""
    ranks: dict[str, list[int]] = field(default_factory=dict)
    """axis -> this rank's group's global ranks (the same names)."""
    gloo: dict[str, Any] = field(default_factory=dict)
    """dp, dp_cp, expt_dp -> gloo side group (``gloo_side`` only)."""
    pool: Any = None
    """The pool's ranks as one group (``pool_group``; None: not asked for)."""
    created: tuple = ()
    """Every distinct group this rank holds of the pool, each once: what destroying it frees."""

    def collection(self):
        """Megatron-Core's ``ProcessGroupCollection`` of this rank's pool groups."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        if not self.member:
            raise RuntimeError(f"rank {dist.get_rank()} is not in the pool of ranks "
                               f"{self.offset}..{self.offset + self.layout.world_size - 1}")
        pgc = ProcessGroupCollection()
        for name in ("tp", "pp", "mp", "cp", "tp_cp", "ep", "expt_tp", "tp_ep", "tp_ep_pp",
                     "tp_dp_cp", "dp", "dp_cp", "expt_dp", "intra_dist_opt"):
            setattr(pgc, name, self.groups[name])
        # a stage without embeddings has none (Megatron's getters return None there too)
        pgc.embd, pgc.pos_embd = self.groups.get("embd"), self.groups.get("pos_embd")
        pgc.intra_dp_cp, pgc.intra_expt_dp = self.groups["dp_cp"], self.groups["expt_dp"]
        pgc.inter_dist_opt = None      # one distributed optimizer instance
        pgc.hcp = None                 # no hierarchical context parallelism
        return pgc


_LOCAL: dict = {}
"""(rank list, backend, timeout) -> the group its members made alone (``local``): never
destroyed, never made twice in a process (module docstring)."""


class _Factory:
    """Creates the pool's groups, every rank alike; with ``alias`` one per distinct list;
    ``local``: by each list's members alone, from the process's ``_LOCAL`` groups."""

    def __init__(self, timeout_s: float, alias: bool, local: bool = False):
        self.timeout, self.alias, self.made = timedelta(seconds=timeout_s), alias, {}
        self.created: list = []
        self.local = local

    def __call__(self, ranks: list[int], backend: Optional[str] = None):
        key = (tuple(ranks), backend)
        if self.local:
            if dist.get_rank() not in ranks:
                return None     # made by its members only
            key = key + (self.timeout,)
            if key not in _LOCAL:
                _LOCAL[key] = dist.new_group(list(ranks), timeout=self.timeout,
                                             backend=backend, use_local_synchronization=True)
            return _LOCAL[key]   # not in ``created``: the cache never destroys it
        if self.alias and key in self.made:
            return self.made[key]
        g = dist.new_group(list(ranks), timeout=self.timeout, backend=backend)
        self.made[key] = g
        if dist.get_rank() in ranks:
            self.created.append(g)
        return g


def build_pool(layout: ParallelLayout, offset: int, *, timeout_s: float, alias: bool,
               gloo_side: bool, pool_group: bool, local: bool = False) -> PoolGroups:
    """Create every group of the pool ``layout`` at ranks ``offset ..`` on every rank (collective
    over the world) and return this rank's. ``pool_group``: also the pool's ranks as one group.
    ``local``: called by the pool's ranks only; each group made by its members alone."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    me = dist.get_rank()
    if local and not offset <= me < offset + layout.world_size:
        raise ValueError(f"rank {me} builds the groups of the pool of ranks {offset}.."
                         f"{offset + layout.world_size - 1} locally: only its ranks may")
    make = _Factory(timeout_s, alias, local)
    groups, ranks, gloo = {}, {}, {}

    def axis(name, grid, dims, side=False):
        for rl in grid.get_rank_enum(list(dims) if isinstance(dims, tuple) else dims):
            g = make(rl)
            g_side = make(rl, backend="gloo") if side else None
            if me in rl:
                groups[name], ranks[name] = g, list(rl)
                if side:
                    gloo[name] = g_side

    lay = layout
    dense = HyperCommGrid([lay.tp, lay.cp, lay.dp, lay.pp], list(DENSE_AXES), rank_offset=offset)
    expert = HyperCommGrid([lay.expert_tp, lay.ep, lay.edp, lay.pp], list(EXPERT_AXES),
                           rank_offset=offset)
    for name, dims in _DENSE:
        axis(name, dense, dims, side=gloo_side and name in ("dp_cp", "dp"))
        if name == "pp":    # embedding groups follow each pp list, as in Megatron
            for rl in dense.get_rank_enum("pp"):
                for emb, members in (("embd", [rl[0], rl[-1]] if len(rl) > 1 else [rl[0]]),
                                     ("pos_embd", [rl[0]])):
                    g = make(members)
                    if me in members:
                        groups[emb], ranks[emb] = g, members
    for name, dims in _DENSE_LATE:
        axis(name, dense, dims)
    for name, dims in _EXPERT:
        axis(name, expert, dims, side=gloo_side and name == "expt_dp")
    # one distributed optimizer instance: edp consecutive tp-ep-pp lists make one group
    mp_lists = expert.get_rank_enum(["tp", "ep", "pp"])
    for i in range(0, len(mp_lists), lay.edp):
        rl = [r for block in mp_lists[i:i + lay.edp] for r in block]
        g = make(rl)
        if me in rl:
            groups["intra_dist_opt"], ranks["intra_dist_opt"] = g, rl
    pool = make(list(range(offset, offset + lay.world_size))) if pool_group else None
    member = offset <= me < offset + lay.world_size
    created = tuple({id(g): g for g in make.created}.values())
    if not member:
        return PoolGroups(lay, offset, False, created=created)
    return PoolGroups(lay, offset, True, groups, ranks, gloo, pool, created)
