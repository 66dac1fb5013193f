"""Weight-transfer plan: from the shards of a source layout to the ranks that need the weights.

Pure data and pure functions (no torch, no torch.distributed, no megatron): every rank computes
the same plan and runs its own part of it (runtime/weight_transfer.py). A destination is

- ``FullAt(rank)``: every full tensor at ``rank`` (an SGLang server's leader, which converts the
  tensors to HF names and broadcasts them into its server);
- ``ShardsIn(layout, ranks)``: each rank's own shard under another layout (a rollout pool's
  Megatron model; rank i of ``layout`` is global rank ``ranks[i]``, by default i).

    train layout TP2xDP2 (source)          two servers, leaders 0 and 2 (FullAt)

    rank 0 [tp0] ──local──> rank 0: embedding rows [0, V/2)   rank 1 [tp1] ──> rank 0: [V/2, V)
    rank 2 [tp0] ──local──> rank 2: embedding rows [0, V/2)   rank 3 [tp1] ──> rank 2: [V/2, V)

Source shards are ranks 0 .. src.world_size-1 of the world (``plan/reshard_plan.placement``:
tensor table, tp / etp rows, pp_stages, ep ranks' experts, the tied output layer of the last
pp_stage as one more holding of the embedding). The transfers come from the reshard planner's
own delivery step (``reshard_plan.deliver``), so one planner serves a layout switch, the push to
servers and a handoff to a rollout pool.

Invariants (tests/unit/test_weight_plan.py):
- every destination gets every row it needs exactly once: rows it already holds by a local
  copy, every other row by one transfer from one source replica (with ``devices_per_node``
  one on the receiver's node if any, then the least loaded, ties to the lowest rank), so each
  source shard is read once per destination that needs it;
- a rank that is no destination receives nothing, and a source rank sends only what a
  destination lacks: ``recv_bytes()[r]`` is, for a ``FullAt`` rank, the model's bytes minus
  the distinct rows it holds; for a ``ShardsIn`` rank, its shard minus what it held already;
- buckets are whole tensors in model order (the push converts each bucket to HF names); per
  bucket no rank sends more than ``bucket_bytes`` and no destination rank lands more (a
  ``FullAt`` rank lands the bucket's full bytes, local rows included, since it assembles
  them), except a bucket of one tensor that alone exceeds the bound. With one ``FullAt``
  destination the buckets are the model's tensors cut greedily at ``bucket_bytes``;
- every rank computes the same buckets and walks them in the same order, so both ends of a
  transfer post it in the same bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.reshard_plan import Holding, RowRange, WeightMove, deliver, placement
from earl_megatron.plan.specs import DTYPE_BYTES
from earl_megatron.plan.tensor_table import tensor_table


@dataclass(frozen=True)
class FullAt:
    """Every full tensor of the model at ``rank`` (an SGLang server's leader)."""

    rank: int


@dataclass(frozen=True)
class ShardsIn:
    """Each rank's shard under ``layout``; rank i of the layout is global rank ``ranks[i]``
    (empty: i itself)."""

    layout: ParallelLayout
    ranks: tuple[int, ...] = ()

    def global_ranks(self) -> tuple[int, ...]:
        return self.ranks or tuple(range(self.layout.world_size))


Destination = Union[FullAt, ShardsIn]


@dataclass(frozen=True)
class WeightBucket:
    """Whole tensors (model order) that move together: no rank stages more than one bucket."""

    names: tuple[str, ...]
    transfers: tuple[WeightMove, ...]
    """Between different ranks. For a ``FullAt`` receiver, ``dst_local`` is the full name and
    ``dst_offset`` the position in the full tensor."""
    local_copies: tuple[WeightMove, ...]


@dataclass(frozen=True)
class WeightPlan:
    src: ParallelLayout
    destinations: tuple[Destination, ...]
    world_size: int
    element_bytes: int
    bucket_bytes: int
    buckets: tuple[WeightBucket, ...]
    model_bytes: int
    """Bytes of every full tensor once (a tied output layer counted with the embedding)."""
    row_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """The shape of every full tensor, model order."""

    @property
    def full_ranks(self) -> tuple[int, ...]:
        """The ranks that receive full tensors (the pushing ranks), in destination order."""
        return tuple(d.rank for d in self.destinations if isinstance(d, FullAt))

    def recv_bytes(self) -> tuple[int, ...]:
        out = [0] * self.world_size
        for b in self.buckets:
            for t in b.transfers:
                out[t.dst] += t.elements * self.element_bytes
        return tuple(out)

    def send_bytes(self) -> tuple[int, ...]:
        out = [0] * self.world_size
        for b in self.buckets:
            for t in b.transfers:
                out[t.src] += t.elements * self.element_bytes
        return tuple(out)

    def bucket_loads(self) -> list[tuple[dict[int, int], dict[int, int]]]:
        """Per bucket, (bytes each rank sends, bytes each destination rank lands)."""
        numel = {name: math.prod(shape) for name, shape in self.row_shapes}
        out = []
        for b in self.buckets:
            sent: dict[int, int] = {}
            landed: dict[int, int] = {}
            for name in b.names:
                _add_row(sent, landed, [t for t in b.transfers if t.name == name],
                         numel[name], self.full_ranks, self.element_bytes)
            out.append((sent, landed))
        return out


def _add_row(sent: dict, landed: dict, moves, numel: int, full_ranks, eb: int) -> None:
    """Add one tensor's transfers to a bucket's loads: each sender's bytes; a ``FullAt`` rank
    lands the whole tensor (it assembles it), a shard rank what it receives."""
    for t in moves:
        sent[t.src] = sent.get(t.src, 0) + t.elements * eb
        if t.dst not in full_ranks:
            landed[t.dst] = landed.get(t.dst, 0) + t.elements * eb
    for r in full_ranks:
        landed[r] = landed.get(r, 0) + numel * eb


def plan_weights(cfg: ModelConfig, src: ParallelLayout, destinations, *, bucket_bytes: int,
                 world_size: Optional[int] = None, element_bytes: Optional[int] = None,
                 devices_per_node: Optional[int] = None,
                 adapters_only: bool = False) -> WeightPlan:
    """The plan that moves ``src``'s shards to ``destinations`` (module docstring) in buckets
    of at most ``bucket_bytes`` per rank. ``world_size``: the ranks there are (default: the
    largest rank named, source or destination, plus one). ``devices_per_node`` (ranks
    ``k * devices_per_node ...`` share node k, as torchrun numbers them): a row comes from a
    replica on the receiver's node when there is one, so fewer bytes cross nodes; None:
    the least-loaded replica anywhere. Bytes per rank are the same either way.
    ``adapters_only``: the LoRA adapters' rows alone (``TensorRow.adapter``), for destinations
    that hold the frozen base already; ``model_bytes`` is then the adapters' bytes."""
    dests = tuple(destinations)
    if not dests:
        raise ValueError("a weight plan needs at least one destination (FullAt or ShardsIn)")
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    ranks_of = [(d.rank,) if isinstance(d, FullAt) else d.global_ranks() for d in dests]
    flat = [r for rs in ranks_of for r in rs]
    if len(set(flat)) != len(flat):
        raise ValueError(f"destinations {dests} name a rank twice; give each rank one "
                         "destination")
    world = world_size if world_size is not None else max(flat + [src.world_size - 1]) + 1
    if min(flat) < 0 or max(flat) >= world or src.world_size > world:
        raise ValueError(f"destination ranks {sorted(flat)} or source layout {src} fall "
                         f"outside the world of {world} ranks")
    for d in dests:
        if isinstance(d, ShardsIn) and d.ranks and len(d.ranks) != d.layout.world_size:
            raise ValueError(f"ShardsIn({d.layout}) names {len(d.ranks)} ranks for a layout of "
                             f"{d.layout.world_size}; name one global rank per layout rank")
    eb = DTYPE_BYTES[cfg.params_dtype] if element_bytes is None else element_bytes
    table = tensor_table(cfg)
    rows = tuple(r for r in table.full_rows if r.adapter or not adapters_only)
    if not rows:
        raise ValueError("adapters_only: the model has no LoRA adapters (model.lora.rank=0); "
                         "plan the full weights")
    before = placement(cfg, src)
    afters = [placement(cfg, d.layout) if isinstance(d, ShardsIn) else None for d in dests]
    full_ranks = tuple(d.rank for d in dests if isinstance(d, FullAt))
    load = [0] * world
    node_of = None if devices_per_node is None else (lambda r: r // devices_per_node)
    buckets: list[WeightBucket] = []
    names, transfers, local = [], [], []
    sent: dict[int, int] = {}
    landed: dict[int, int] = {}
    for row in rows:
        dim = row.split_dim or 0
        per_row = row.numel // row.shape[dim]
        wants: list[Holding] = []
        for d, after, rs in zip(dests, afters, ranks_of):
            if isinstance(d, FullAt):
                wants.append(Holding(d.rank, row.name, (RowRange(dim, 0, row.shape[dim]),)))
            else:
                wants += [Holding(rs[h.rank], h.local_name, h.pieces) for h in after[row.name]]
        moves, copies = deliver(row.name, dim, per_row, wants, before[row.name], load,
                                node_of)
        s_row: dict[int, int] = {}
        l_row: dict[int, int] = {}
        _add_row(s_row, l_row, moves, row.numel, full_ranks, eb)
        # a tensor over the bound alone is a bucket of its own: nothing joins it either
        over = any(sent.get(r, 0) + n > bucket_bytes for r, n in s_row.items()) or \
            any(landed.get(r, 0) + n > bucket_bytes for r, n in l_row.items()) or \
            max(list(sent.values()) + list(landed.values()), default=0) > bucket_bytes
        if names and over:
            buckets.append(_bucket(names, transfers, local))
            names, transfers, local, sent, landed = [], [], [], {}, {}
        names.append(row.name)
        transfers += moves
        local += copies
        for r, n in s_row.items():
            sent[r] = sent.get(r, 0) + n
        for r, n in l_row.items():
            landed[r] = landed.get(r, 0) + n
    buckets.append(_bucket(names, transfers, local))
    return WeightPlan(src=src, destinations=dests, world_size=world, element_bytes=eb,
                      bucket_bytes=bucket_bytes, buckets=tuple(buckets),
                      model_bytes=sum(r.numel for r in rows) * eb,
                      row_shapes=tuple((r.name, r.shape) for r in rows))


def _bucket(names, transfers, local) -> WeightBucket:
    return WeightBucket(tuple(names), tuple(sorted(transfers)), tuple(sorted(local)))


def minimum_recv_bytes(cfg: ModelConfig, src: ParallelLayout, rank: int, *,
                       element_bytes: Optional[int] = None) -> int:
    """What a ``FullAt(rank)`` destination must receive from other ranks: the model's bytes
    minus the distinct rows ``rank`` holds under ``src`` (0 .. src.world_size-1), none if it
    holds nothing. The plan receives exactly this (tests)."""
    eb = DTYPE_BYTES[cfg.params_dtype] if element_bytes is None else element_bytes
    table = tensor_table(cfg)
    total = sum(r.numel for r in table.full_rows)
    if rank >= src.world_size:
        return total * eb
    held: dict[str, list[tuple[int, int]]] = {}
    for row in table.held_on(src, rank):
        full = table.row(row.tied_to) if row.tied_to else row
        held.setdefault(full.name, []).extend(row.local_rows(src, rank))
    have = 0
    for name, spans in held.items():
        full = table.row(name)
        end = 0
        for a, b in sorted(spans):   # distinct rows: the union of the spans
            have += max(0, b - max(a, end)) * (full.numel // full.shape[full.split_dim or 0])
            end = max(end, b)
    return (total - have) * eb


def transfer_seconds(plan: WeightPlan, cluster) -> float:
    """The link model's seconds for ``plan`` on ``cluster`` (plan/specs.ClusterSpec; conventions
    of plan/time_model.py): every rank sends and receives at once; bytes between ranks of one
    node use that rank's intra-node link, bytes between nodes share each node's inter-node
    bandwidth (the busier of a node's way in and way out); the two parts are added (they may
    overlap: an upper bound), plus one latency per bucket."""
    node = cluster.node_of
    rank_in: dict[int, int] = {}
    rank_out: dict[int, int] = {}
    node_in: dict[int, int] = {}
    node_out: dict[int, int] = {}
    for b in plan.buckets:
        for t in b.transfers:
            n = t.elements * plan.element_bytes
            if node(t.src) == node(t.dst):
                rank_out[t.src] = rank_out.get(t.src, 0) + n
                rank_in[t.dst] = rank_in.get(t.dst, 0) + n
            else:
                node_out[node(t.src)] = node_out.get(node(t.src), 0) + n
                node_in[node(t.dst)] = node_in.get(node(t.dst), 0) + n
    intra = max(list(rank_in.values()) + list(rank_out.values()), default=0)
    inter = max(list(node_in.values()) + list(node_out.values()), default=0)
    latency = cluster.inter_node_latency_s if node_in else cluster.intra_node_latency_s
    return intra / cluster.intra_node_bandwidth + inter / cluster.inter_node_bandwidth \
        + len(plan.buckets) * latency
