"""Run a weight plan (plan/weight_plan.py): tensors point to point, never pickled objects.

    full_weights_at(policy, pushers, bucket_bytes)   every rank iterates it; at each pusher it
        yields one bucket of full tensors {global name: tensor} at a time, elsewhere None
    load_shards(policy, target)                      every rank: ``target``'s parameters (the
        same ranks, another layout) receive their shards of ``policy``'s weights
    hand_off(model, train, rollout)                  every rank: split placement's train pool
        sends the rollout pool (other ranks, another layout) its shards
    hand_off_full(cfg, train, pushers, params)       every rank: split placement's train pool
        assembles full buckets at the rollout pool's pushers (SGLang replica leaders)

Per bucket, on every rank, in the same order: local copies (rows a destination holds itself),
then the bucket's transfers as one round of batched isend/irecv (runtime/transport.py, as the
switcher runs its rounds) on the world group, or on ``group=`` where the caller passes one
(split placement's handoff runs on a group of its own, whose timeout bounds it). Within a
bucket, the transfers between two ranks of one dtype travel as one message (``_per_peer``: the
plan's order on both sides, packed by the sender, unpacked by the receiver): a plan of many
small tensors costs a message per peer, not one per tensor (the tiny model's handoff from a dp2
train pool to a dp1 rollout rank: 2 messages instead of 27). A rank that neither
sends nor receives in a bucket posts nothing for it: only the plan's senders and destinations
touch weights.
Tensors stay on the model's device: on GPUs they travel over NCCL and a pusher's buckets are
already on the device its server's NCCL weight group broadcasts from; on CPU the same code runs
over gloo.

One small tensor collective per transfer gives every receiver the dtype of every tensor it
receives (a model may keep tensors in different dtypes): an all-reduce (max) of one code per
tensor over the world (or ``group``), each sender writing the codes of what it sends.

A collective or point-to-point op that fails (a peer stalled past the group's timeout, or died)
raises ``WeightPlanError``: the rank, the step it was in (the dtype agreement, or bucket i of n
and the ranks it was receiving from and sending to) and torch's own error. Never the shared
memory transport (runtime/shm.py, whose fences are world barriers): isend/irecv only.

Memory per rank: a pusher holds one bucket of full tensors (at most ``bucket_bytes``, or one
tensor larger than that) while its caller converts and pushes it; a sender stages the packed
messages of one bucket at a time (the rows it sends in it, once per receiving peer), a receiver
their landing buffers.
"""

from __future__ import annotations

import functools
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.weight_plan import FullAt, ShardsIn, WeightPlan, plan_weights
from earl_megatron.runtime.build import ModelOnLayout
from earl_megatron.runtime.switcher import plan_params
from earl_megatron.runtime.transport import Message, Traffic, run_rounds

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class WeightPlanError(RuntimeError):
    """A weight plan's collective or point-to-point op failed on this rank (module docstring)."""

    def __init__(self, rank: int, step: str, cause: BaseException):
        self.rank, self.step = rank, step
        first = " ".join(str(cause).split())[:300]
        super().__init__(f"rank {rank}, {step}: {type(cause).__name__}: {first}")


@functools.lru_cache(maxsize=64)
def cached_plan(cfg, src, destinations: tuple, bucket_bytes: int, world_size: int,
                devices_per_node: Optional[int] = None, adapters_only: bool = False
                ) -> WeightPlan:
    """``plan_weights``, memoised: a run pushes from the same few train layouts every iteration."""
    return plan_weights(cfg, src, destinations, bucket_bytes=bucket_bytes,
                        world_size=world_size, devices_per_node=devices_per_node,
                        adapters_only=adapters_only)


def full_weights_at(policy: ModelOnLayout, pushers, bucket_bytes: int,
                    traffic: Optional[Traffic] = None, devices_per_node: Optional[int] = None,
                    adapters_only: bool = False
                    ) -> Iterator[tuple[int, int, Optional[dict[str, torch.Tensor]]]]:
    """(index, count, bucket) for each bucket of ``policy``'s full weights: at a rank of
    ``pushers`` the bucket's full tensors (global Megatron names, the model's dtype and
    device), elsewhere None. Collective over the world: every rank consumes every bucket.
    ``devices_per_node``: rows come from a replica on the pusher's node where one exists.
    ``adapters_only``: the LoRA adapters alone (the pushers hold the frozen base)."""
    plan = cached_plan(policy.cfg, policy.layout, tuple(FullAt(r) for r in pushers),
                       bucket_bytes, dist.get_world_size(), devices_per_node, adapters_only)
    _, src = plan_params(policy)
    yield from run_weight_plan(plan, src, traffic=traffic)


def load_shards(policy: ModelOnLayout, target: ModelOnLayout, bucket_bytes: int = 64 << 20,
                traffic: Optional[Traffic] = None) -> None:
    """Copy ``policy``'s weights into ``target``'s parameters (same ranks, any two layouts),
    each rank receiving only the rows of its ``target`` shard it does not hold in ``policy``."""
    plan = cached_plan(policy.cfg, policy.layout, (ShardsIn(target.layout),), bucket_bytes,
                       dist.get_world_size())
    _, src = plan_params(policy)
    _, dst = plan_params(target)
    for _ in run_weight_plan(plan, src, dst=dst, traffic=traffic):
        pass


def hand_off(model: ModelOnLayout, train: ParallelLayout, rollout: ParallelLayout,
             bucket_bytes: int = 64 << 20, traffic: Optional[Traffic] = None,
             group=None, adapters_only: bool = False) -> None:
    """Split placement's handoff (runtime/groups.py ``build_pool_groups((train, rollout))``):
    the train pool (ranks 0 .. n_t - 1, ``train``) sends every rollout-pool rank (ranks n_t ..,
    ``rollout``) its shard of the weights, by the weight plan, each row once. Collective over
    the world: every rank calls it with its own pool's model (the policy on the train pool, the
    rollout model on the rollout pool). ``group``: the process group every op runs on (None:
    the world; it must hold every rank); a failure raises ``WeightPlanError``.
    ``adapters_only``: the LoRA adapters alone, when the rollout pool holds the frozen base."""
    n_t = train.world_size
    dest = ShardsIn(rollout, tuple(range(n_t, n_t + rollout.world_size)))
    plan = cached_plan(model.cfg, train, (dest,), bucket_bytes, dist.get_world_size(),
                       adapters_only=adapters_only)
    _, params = plan_params(model)
    sender = dist.get_rank() < n_t
    for _ in run_weight_plan(plan, params if sender else {}, dst=None if sender else params,
                             traffic=traffic, group=group):
        pass


def hand_off_full(cfg, train: ParallelLayout, pushers, params: Optional[dict] = None, *,
                  bucket_bytes: int = 512 << 20, traffic: Optional[Traffic] = None,
                  group=None, device: Optional[torch.device] = None,
                  devices_per_node: Optional[int] = None, adapters_only: bool = False
                  ) -> Iterator[tuple[int, int, Optional[dict[str, torch.Tensor]]]]:
    """Split placement with SGLang servers on the rollout pool: the train pool (ranks 0 ..
    n_t - 1, ``train``) assembles each bucket of the full weights of model ``cfg`` at every
    rank of ``pushers`` (the servers' replica leaders, rollout-pool ranks), which hold no
    model: (index, count, bucket) as ``full_weights_at``. Collective over the world (or
    ``group``, which holds every rank): the train pool passes its ``params`` (``plan_params``
    of its model), the rollout pool None; ``device``: where a pusher's buckets land (its
    server's device; default the CPU); ``adapters_only``: as ``full_weights_at``."""
    plan = cached_plan(cfg, train, tuple(FullAt(r) for r in pushers), bucket_bytes,
                       dist.get_world_size(), devices_per_node, adapters_only)
    yield from run_weight_plan(plan, params or {}, traffic=traffic, group=group, device=device)


@torch.no_grad()
def run_weight_plan(plan: WeightPlan, src: dict[str, torch.Tensor], *,
                    dst: Optional[dict[str, torch.Tensor]] = None,
                    traffic: Optional[Traffic] = None, group=None,
                    device: Optional[torch.device] = None
                    ) -> Iterator[tuple[int, int, Optional[dict[str, torch.Tensor]]]]:
    """Run ``plan`` from this rank's source parameters ``src`` ({plan local name: tensor}) into
    ``dst`` (this rank's parameters under a ``ShardsIn`` destination, by plan local name), and
    yield (index, count, full tensors of the bucket at a ``FullAt`` rank, else None) per
    bucket. Collective over the world, or over ``group`` (every collective and point-to-point
    op; the plan's ranks stay global ranks, torch maps them into the group), which must hold
    every rank that calls (module docstring). ``device``: where tensors land on a rank with no
    source parameters (default: the sources' device, else the CPU). A failed op raises
    ``WeightPlanError``."""
    me = dist.get_rank()
    traffic = traffic if traffic is not None else Traffic()
    full_here = me in plan.full_ranks
    if dst is None and any(isinstance(d, ShardsIn) and me in d.global_ranks()
                           for d in plan.destinations):
        raise ValueError(f"rank {me} is a ShardsIn destination of the plan; pass its "
                         "parameters as dst=")
    if device is None:
        device = next(iter(src.values())).device if src else torch.device("cpu")
    try:
        dtypes = _dtypes(plan, me, src, device, group)
    except RuntimeError as e:
        raise WeightPlanError(me, "agreeing the dtypes (an all-reduce of every rank of the "
                              "plan's group)", e) from e
    if dst is not None:
        wrong = sorted({t.dst_local for b in plan.buckets for t in b.transfers
                        if t.dst == me and dst[t.dst_local].dtype != dtypes[t.name]})
        if wrong:
            raise ValueError(f"rank {me}: parameters {wrong[:3]} differ in dtype from the "
                             "source model's; build both models with the same params_dtype")
    n = len(plan.buckets)
    for i, bucket in enumerate(plan.buckets):
        full: dict[str, torch.Tensor] = {}
        if full_here:
            shape = dict(plan.row_shapes)
            full = {name: torch.empty(shape[name], dtype=dtypes[name], device=device)
                    for name in bucket.names}

        def into(t) -> torch.Tensor:
            target = full[t.name] if full_here else dst[t.dst_local]
            return target.narrow(t.dim, t.dst_offset, t.rows)

        for t in bucket.local_copies:
            if t.dst == me:
                into(t).copy_(src[t.src_local].narrow(t.dim, t.src_offset, t.rows))
        mine = _per_peer([t for t in bucket.transfers if me in (t.src, t.dst)], dtypes)
        if mine:
            try:
                run_rounds([mine], me,
                           lambda m: [src[t.src_local].narrow(t.dim, t.src_offset, t.rows)
                                      for t in m.key],
                           lambda m: [into(t) for t in m.key], None, traffic, group=group)
            except RuntimeError as e:
                peers_in = sorted({m.src for m in mine if m.dst == me})
                peers_out = sorted({m.dst for m in mine if m.src == me})
                raise WeightPlanError(me, f"bucket {i + 1} of {n} (receiving from ranks "
                                      f"{peers_in}, sending to ranks {peers_out})", e) from e
        yield i, n, (full if full_here else None)
        del full


def _per_peer(transfers: list, dtypes: dict[str, torch.dtype]) -> list[Message]:
    """One message per (sender, receiver, dtype) of a bucket's ``transfers``, its key the
    transfers in the plan's order (the same on both sides: both read the same plan)."""
    groups: dict[tuple, list] = {}
    for t in transfers:
        groups.setdefault((t.src, t.dst, dtypes[t.name]), []).append(t)
    return [Message(src, dst, sum(t.elements for t in ts) * dtype.itemsize, tuple(ts))
            for (src, dst, dtype), ts in groups.items()]


def _dtypes(plan: WeightPlan, me: int, src: dict[str, torch.Tensor],
            device: torch.device, group=None) -> dict[str, torch.dtype]:
    """{full name: dtype} of every tensor that moves, agreed over the world or ``group``
    (module docstring)."""
    names = [name for name, _ in plan.row_shapes]
    index = {name: k for k, name in enumerate(names)}
    codes = torch.zeros(len(names), dtype=torch.int64, device=device)
    for b in plan.buckets:
        for t in b.transfers + b.local_copies:
            if t.src == me:
                codes[index[t.name]] = _DTYPES.index(src[t.src_local].dtype) + 1
    dist.all_reduce(codes, op=dist.ReduceOp.MAX, group=group)
    return {name: _DTYPES[int(c) - 1] for name, c in zip(names, codes.tolist()) if c}
