"""The dispatcher executor: moves per-sample tensors producer -> consumer along a shard map.

Every rank calls the same functions in the same order (SPMD):

1. ``exchange_metadata``: ONE ``all_gather_object`` of each rank's (sample_id, length, group_id).
2. Pure planning on every rank from that metadata (``plan_dispatch``): producer placement,
   token-balanced consumer placement, shard map. Identical everywhere by construction.
3. ``execute_shard_map``: per round, one ``batch_isend_irecv`` in which each rank posts ONE
   packed uint8 buffer per peer it sends to and one per peer it receives from. A buffer holds
   that pair's transfers back to back in shard-map order, so sizes and offsets are known to both
   ends from the map and no header is sent. Round 1 (layout-aware fan-out) forwards data received
   in round 0. Buffers live on the device of the local tensors: gloo on CPU, NCCL on CUDA.

Local tensors, in and out, are ``{tensor name: {sample_id: 1-D tensor}}`` where each tensor is
this rank's pieces of that sample concatenated in ascending token order (for CP: chunk i then
chunk 2*cp-1-i, Megatron's order).

``owned_slices`` cuts, from what a rank received, the elements it owns
(``Placement.owned_intervals``: the lowest rank holding each element), so a reduction over
dispatched tensors (runtime/reduce.py) counts every element once.

Scope (``Scope``): a dispatch runs on this rank's pool by default (runtime/groups.py: the
world unless split placement made pools): shard-map rank r is global rank ``offset + r`` and the
collectives run on the pool's group. ``Scope.world()`` spans every rank (between pools).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.placement import (Placement, TensorSpec, consumer_placement,
                                          producer_placement)
from earl_megatron.plan.shard_map import ShardMap, Topology, Transfer, build_shard_map
from earl_megatron.runtime import groups
from earl_megatron.runtime.step_inputs import TRAIN_TENSORS

Local = dict[str, dict[int, torch.Tensor]]


@dataclass(frozen=True)
class Scope:
    """The ranks a dispatch runs on: global ranks ``offset .. offset + size - 1``, shard-map rank
    r being ``offset + r``; ``group`` their process group (None: the world)."""

    offset: int
    size: int
    group: Any = None

    @classmethod
    def pool(cls) -> "Scope":
        """This rank's pool (the world when there is one pool)."""
        return cls(*groups.pool_span(), groups.pool_group())

    @classmethod
    def world(cls) -> "Scope":
        return cls(0, dist.get_world_size())

    def rank(self) -> int:
        return dist.get_rank() - self.offset


@dataclass(frozen=True)
class SampleMeta:
    sample_id: int
    length: int
    group_id: int = 0
    """Prompt group (GRPO): samples of one prompt share it."""


@dataclass(frozen=True)
class DispatchStats:
    bytes_sent: int
    bytes_received: int
    messages: int
    seconds: float


@dataclass(frozen=True)
class DispatchResult:
    tensors: Local
    stats: DispatchStats


def exchange_metadata(local: Sequence[SampleMeta],
                      scope: Optional[Scope] = None) -> list[list[SampleMeta]]:
    """The scope's ranks' sample metadata, in rank order (one all_gather_object)."""
    scope = scope or Scope.pool()
    out: list = [None] * scope.size
    dist.all_gather_object(out, [(m.sample_id, m.length, m.group_id) for m in local],
                           group=scope.group)
    return [[SampleMeta(*m) for m in per_rank] for per_rank in out]


def plan_dispatch(producer_layout: ParallelLayout, consumer_layout: ParallelLayout,
                  metadata: Sequence[Sequence[SampleMeta]],
                  tensors: Sequence[TensorSpec] = TRAIN_TENSORS, *, num_micro_batches: int = 1,
                  topology: Optional[Topology] = None,
                  producer_pp_stages: Optional[Mapping[str, str]] = None,
                  assignment: Optional[Sequence[Sequence[Sequence[int]]]] = None,
                  ) -> tuple[Placement, Placement, ShardMap]:
    """Pure: the producer and consumer placements and the shard map from gathered metadata.

    ``assignment`` (``[dp_rank][mb] -> sample ids``) fixes the consumer's micro-batches (the
    trainer's length-grouped ones); without it they are token-balanced with locality."""
    reports = [[(m.sample_id, m.length) for m in r] for r in metadata]
    producer = producer_placement(producer_layout, reports, tensors, pp_stages=producer_pp_stages)
    consumer = consumer_placement(consumer_layout, producer.length_of, tensors, num_micro_batches,
                                  producer=producer, assignment=assignment)
    return producer, consumer, build_shard_map(producer, consumer, topology)


# ----------------------------------------------------------------------------- local store
class _Store:
    """Pieces this rank holds: (tensor, sample) -> [(start, end, 1-D tensor)]."""

    def __init__(self):
        self.pieces: dict[tuple[str, int], list[tuple[int, int, torch.Tensor]]] = {}

    def add(self, name: str, s: int, a: int, b: int, x: torch.Tensor) -> None:
        self.pieces.setdefault((name, s), []).append((a, b, x))

    def read(self, name: str, s: int, a: int, b: int) -> torch.Tensor:
        parts, cur = [], a
        for c, d, x in sorted(self.pieces.get((name, s), []), key=lambda p: p[:2]):
            if d <= cur or c > cur:
                continue
            stop = min(b, d)
            parts.append(x[cur - c:stop - c])
            cur = stop
            if cur == b:
                break
        if cur != b:
            raise RuntimeError(f"rank {dist.get_rank()} lacks {name!r} of sample {s} "
                               f"[{cur}, {b}); the shard map and the local tensors disagree")
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _load(store: _Store, placement: Placement, rank: int,
          local: Mapping[str, Mapping[int, torch.Tensor]], names: Sequence[str]) -> None:
    for name in names:
        for s in placement.local_samples(rank, name):
            ivs = placement.intervals(rank, name, s)
            x = local.get(name, {}).get(s)
            want = sum(b - a for a, b in ivs)
            if x is None or x.dim() != 1 or x.numel() != want:
                got = "missing" if x is None else f"shape {tuple(x.shape)}"
                raise ValueError(f"rank {rank}: local[{name!r}][{s}] is {got}; the producer "
                                 f"placement says this rank holds {ivs} ({want} elements, 1-D)")
            x, off = x.contiguous(), 0
            for a, b in ivs:
                store.add(name, s, a, b, x[off:off + b - a])
                off += b - a


def execute_shard_map(smap: ShardMap, producer: Placement, consumer: Placement,
                      local: Mapping[str, Mapping[int, torch.Tensor]], *,
                      device: Optional[torch.device] = None,
                      scope: Optional[Scope] = None) -> DispatchResult:
    """Run ``smap`` (decentralized or centralized) and return what ``consumer`` places here."""
    scope = scope or Scope.pool()
    rank = scope.rank()
    if scope.size != smap.world_size:
        raise ValueError(f"shard map for {smap.world_size} ranks run on {scope.size} ranks "
                         f"(from rank {scope.offset})")
    names = [t.name for t in consumer.tensors]
    dtypes = {t.name: getattr(torch, t.dtype) for t in consumer.tensors}
    if device is None:
        device = next((x.device for per in local.values() for x in per.values()),
                      torch.device("cpu"))
    store = _Store()
    _load(store, producer, rank, local, names)
    sent = received = messages = 0
    t0 = time.perf_counter()
    for rnd in range(smap.rounds):
        ops, inbox = [], []
        for dst, ts in sorted(smap.sends(rank, rnd).items()):
            buf = torch.empty(sum(t.nbytes for t in ts), dtype=torch.uint8, device=device)
            off = 0
            for t in ts:
                buf[off:off + t.nbytes].copy_(
                    store.read(t.tensor, t.sample_id, t.start, t.end).view(torch.uint8))
                off += t.nbytes
            ops.append(dist.P2POp(dist.isend, buf, scope.offset + dst, group=scope.group))
            sent += off
        for src, ts in sorted(smap.recvs(rank, rnd).items()):
            buf = torch.empty(sum(t.nbytes for t in ts), dtype=torch.uint8, device=device)
            ops.append(dist.P2POp(dist.irecv, buf, scope.offset + src, group=scope.group))
            inbox.append((buf, ts))
            received += buf.numel()
        messages += len(ops)
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for buf, ts in inbox:
            _unpack(store, buf, ts, dtypes, device)
    seconds = time.perf_counter() - t0
    out: Local = {name: {} for name in names}   # every name, also where no sample lands
    for name in names:
        for s in consumer.local_samples(rank, name):
            parts = [store.read(name, s, a, b) for a, b in consumer.intervals(rank, name, s)]
            out[name][s] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return DispatchResult(out, DispatchStats(sent, received, messages, seconds))


def _unpack(store: _Store, buf: torch.Tensor, ts: Sequence[Transfer],
            dtypes: Mapping[str, torch.dtype], device) -> None:
    off = 0
    for t in ts:
        # copy bytes into a typed tensor rather than viewing the buffer: a view would need
        # the offset aligned to the element size
        x = torch.empty(t.end - t.start, dtype=dtypes[t.tensor], device=device)
        x.view(torch.uint8).copy_(buf[off:off + t.nbytes])
        store.add(t.tensor, t.sample_id, t.start, t.end, x)
        off += t.nbytes


def dispatch(producer_layout: ParallelLayout, consumer_layout: ParallelLayout,
             local_meta: Sequence[SampleMeta], local: Mapping[str, Mapping[int, torch.Tensor]],
             tensors: Sequence[TensorSpec] = TRAIN_TENSORS, *, num_micro_batches: int = 1,
             topology: Optional[Topology] = None,
             producer_pp_stages: Optional[Mapping[str, str]] = None,
             assignment: Optional[Sequence[Sequence[Sequence[int]]]] = None,
             scope: Optional[Scope] = None,
             ) -> tuple[DispatchResult, Placement, list[list[SampleMeta]]]:
    """One call for the trainer: exchange metadata, plan, execute. Returns the result, the
    consumer placement (micro-batches, ownership for reductions) and the gathered metadata."""
    scope = scope or Scope.pool()
    meta = exchange_metadata(local_meta, scope)
    producer, consumer, smap = plan_dispatch(
        producer_layout, consumer_layout, meta, tensors, num_micro_batches=num_micro_batches,
        topology=topology, producer_pp_stages=producer_pp_stages, assignment=assignment)
    return (execute_shard_map(smap, producer, consumer, local, scope=scope), consumer, meta)


# ----------------------------------------------------------------------------- reductions
def owned_slices(placement: Placement, name: str,
                 local: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The parts of this rank's local tensors that it owns (each element has one owner);
    ``placement`` in this rank's pool's ranks."""
    rank = groups.pool_rank()
    out = {}
    for s, x in local.items():
        ivs = placement.intervals(rank, name, s)
        offsets, off = {}, 0
        for a, b in ivs:
            offsets[a] = (off, b)
            off += b - a
        parts = []
        for a, b in placement.owned_intervals(rank, name, s):
            base = max(c for c in offsets if c <= a)  # the local piece containing [a, b)
            parts.append(x[offsets[base][0] + a - base:offsets[base][0] + b - base])
        if parts:
            out[s] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out
