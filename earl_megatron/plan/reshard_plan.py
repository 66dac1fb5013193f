"""Reshard plan: which rank holds which slice of every full tensor, and what must move on a switch.

Pure data and pure functions (no torch, no torch.distributed, no megatron): every rank computes
the same plan from (model config, source layout, destination layout) and runs its own part of it
(runtime/switcher.py). The selector prices a switch with ``receive_bytes``, the bytes per rank
the plan moves (its ``recv_bytes()``, tested equal), without building the transfers.

Placement of one full tensor comes from the tensor table (plan/tensor_table.py: names, shapes,
TP split dim and stride, pp_stage, tied output layer); the plan speaks local-spec names, and
the switcher maps a TE-spec model's parameters onto them through the same table:

- a slice is a set of ``RowRange(dim, start, stop)`` along the tensor's TP split dim (dim 0 for
  replicated norms, one range covering it), concatenated in order to form the rank's local
  tensor: two ranges (``gate[r]``, ``up[r]``) for SwiGLU fc1's partition stride 2;
- dp and cp: every rank with the same (tp, pp) coordinates holds the same slices (replicas);
- experts (mixture-of-experts layers): a rank holds only its ep rank's experts
  (``table.held_on``), under their local index (``table.name_on``), split by the expert-TP
  rank (``row.local_rows``); the edp ranks of one (etp, ep) are the replicas. Moving an expert
  between EP layouts is ordinary traffic of whole rows, planned like any other tensor;
- a tied output layer on the last pp_stage (pp > 1) is a holding of the embedding under the
  local name ``output_layer.weight``.

Plan invariants (checked by tests/unit/test_reshard_plan.py):
- every destination slice is covered exactly once, by a local copy (the rank already held
  those elements under the source layout) or by exactly one transfer from another rank;
- nothing is sent to a rank that already holds it, so ``bytes_moved == min_bytes``, the bytes
  any plan must move (what destination ranks need and do not hold);
- among several source replicas the least-loaded sender is picked (ties: lowest rank), walking
  transfers in a fixed order, so the plan is a pure function of its inputs;
- the same plan moves the optimizer state, whose shapes equal the parameters': fp32 Adam
  moments (``exp_avg``, ``exp_avg_sq``) and, for bf16/fp16 weights, the fp32 master copies;
  the runtime applies every transfer once per kind of tensor.

``rounds(bucket_bytes)`` cuts the transfers into rounds in which no rank sends more than
``bucket_bytes`` and none receives more than ``bucket_bytes`` (a transfer larger than a bucket
is split along its dim first), which bounds transient memory during execution.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.specs import DTYPE_BYTES
from earl_megatron.plan.tensor_table import tensor_table


@dataclass(frozen=True, order=True)
class RowRange:
    """Rows [start, stop) of a full tensor along ``dim`` (all of every other dim)."""

    dim: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Holding:
    """One rank's copy of (part of) a full tensor, as a local parameter of its pp_stage."""

    rank: int
    local_name: str
    pieces: tuple[RowRange, ...]
    """In local order: the local tensor is their concatenation along the split dim."""

    def local_offset(self, dim: int, row: int) -> int:
        """Position along ``dim`` of full row ``row`` inside the local tensor."""
        off = 0
        for p in self.pieces:
            if p.start <= row < p.stop:
                return off + row - p.start
            off += p.length
        raise ValueError(f"row {row} is not held by rank {self.rank} ({self.local_name})")


def placement(cfg: ModelConfig, layout: ParallelLayout) -> dict[str, tuple[Holding, ...]]:
    """Every full tensor -> the holdings of every rank that has part of it (ascending rank).

    A rank holds ``table.held_on(layout, rank)`` (its pp_stage's rows; of the experts only its
    ep rank's), under ``table.name_on`` (local layer and expert index), rows
    ``row.local_rows`` (split by tp, or by etp and the expert-TP rank for experts)."""
    layout.check(layout.world_size, cfg)
    table = tensor_table(cfg)
    out: dict[str, list[Holding]] = {}
    for r, rows in _held(table, layout):
        for row in rows:
            full = table.row(row.tied_to) if row.tied_to else row
            dim = row.split_dim or 0
            out.setdefault(full.name, []).append(Holding(
                r, table.name_on(row, layout),
                tuple(RowRange(dim, a, b) for a, b in row.local_rows(layout, r))))
    return {n: tuple(sorted(h, key=lambda h: (h.rank, h.local_name))) for n, h in out.items()}


def _held(table, layout: ParallelLayout):
    """(rank, rows its model has) for every rank; ranks of one (pp, ep) share the row list."""
    memo: dict[tuple[int, int], tuple] = {}
    for r in range(layout.world_size):
        key = (layout.coords(r).pp, layout.expert_coords(r).ep)
        if key not in memo:
            memo[key] = table.held_on(layout, r)
        yield r, memo[key]


def _rank_class(layout: ParallelLayout, rank: int) -> tuple[int, ...]:
    """What decides the rows ``rank`` holds: (tp, pp) and, for experts, (etp, ep) coordinates."""
    c, e = layout.coords(rank), layout.expert_coords(rank)
    return c.tp, c.pp, e.etp, e.ep


def receive_bytes(cfg: ModelConfig, src: ParallelLayout, dst: ParallelLayout, *,
                  element_bytes: Optional[int] = None) -> tuple[int, ...]:
    """``_receive_bytes``, memoised: the selector prices the same few switches every plan."""
    return _receive_bytes(cfg, src, dst, element_bytes)


@functools.lru_cache(maxsize=4096)
def _receive_bytes(cfg: ModelConfig, src: ParallelLayout, dst: ParallelLayout,
                   element_bytes: Optional[int]) -> tuple[int, ...]:
    """Bytes each rank must receive to switch from ``src`` to ``dst``: the rows it holds under
    ``dst`` and did not hold, under any local name, under ``src``. The plan moves exactly these
    (its ``recv_bytes()``; ``min_bytes`` is their sum), so the selector prices a switch with
    them without building the transfers (ranks with the same tp, pp, expert-TP and ep
    coordinates in both layouts need the same, so each such class is counted once)."""
    eb = DTYPE_BYTES[cfg.params_dtype] if element_bytes is None else element_bytes
    table = tensor_table(cfg)
    memo: dict[tuple[int, ...], int] = {}
    out = []
    for r in range(dst.world_size):
        key = _rank_class(src, r) + _rank_class(dst, r)
        if key not in memo:
            held: dict[str, list[tuple[int, int]]] = {}
            for row in table.held_on(src, r):
                full = table.row(row.tied_to) if row.tied_to else row
                held.setdefault(full.name, []).extend(row.local_rows(src, r))
            missing = 0
            for row in table.held_on(dst, r):
                full = table.row(row.tied_to) if row.tied_to else row
                per_row = full.numel // full.shape[row.split_dim or 0]
                need = list(row.local_rows(dst, r))
                missing += per_row * sum(y - x for x, y in _subtract(need, held.get(full.name, [])))
            memo[key] = missing
        out.append(memo[key] * eb)
    return tuple(out)


@dataclass(frozen=True, order=True)
class WeightMove:
    """Rows [start, stop) along ``dim`` of full tensor ``name`` from ``src`` to ``dst``.

    ``src == dst`` is a local copy (between the old and new local tensors of one rank)."""

    name: str
    dst: int
    start: int
    stop: int
    src: int
    dim: int
    src_local: str
    dst_local: str
    src_offset: int
    """Position of ``start`` along ``dim`` in the source rank's local tensor."""
    dst_offset: int
    elements: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ReshardPlan:
    src: ParallelLayout
    dst: ParallelLayout
    element_bytes: int
    transfers: tuple[WeightMove, ...]
    """Between different ranks, sorted."""
    local_copies: tuple[WeightMove, ...]
    min_bytes: int
    """Bytes destination ranks need and did not hold under ``src``: what any plan must move
    (the sum of ``receive_bytes``)."""
    unit_elements: tuple[tuple[str, int], ...]
    """Elements per row along the split dim, per tensor (to split transfers into buckets)."""
    replicas: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...] = ()
    """Per full tensor, the groups of ``src`` ranks holding identical slices of it (a dense
    tensor's dp x cp replicas; an expert's edp replicas), each ascending."""

    @functools.cached_property
    def _replica_of(self) -> dict[tuple[str, int], tuple[int, ...]]:
        return {(name, r): g for name, groups in self.replicas for g in groups for r in g}

    def replicas_of(self, name: str, rank: int) -> tuple[int, ...]:
        """The ``src`` ranks (``rank`` included) holding what ``rank`` holds of ``name``."""
        return self._replica_of.get((name, rank), (rank,))

    @property
    def bytes_moved(self) -> int:
        return sum(t.elements for t in self.transfers) * self.element_bytes

    def send_bytes(self) -> tuple[int, ...]:
        out = [0] * self.src.world_size
        for t in self.transfers:
            out[t.src] += t.elements * self.element_bytes
        return tuple(out)

    def recv_bytes(self) -> tuple[int, ...]:
        out = [0] * self.dst.world_size
        for t in self.transfers:
            out[t.dst] += t.elements * self.element_bytes
        return tuple(out)

    def rounds(self, bucket_bytes: int, kinds: int = 1, *,
               bytes_per_element: Optional[int] = None) -> list[tuple[WeightMove, ...]]:
        """Transfers cut into rounds; per round no rank sends or receives over ``bucket_bytes``.

        ``kinds``: tensors moved per transfer (1 for weights, 3 for weights + Adam moments), all
        of the weights' dtype. ``bytes_per_element``: what one element costs over all kinds
        when they differ, overriding ``element_bytes * kinds`` (bf16 weights with an fp32 master
        and two fp32 moments: 2 + 3 * 4 = 14).
        A transfer bigger than a bucket is split along its dim (never below one row, so a
        single row larger than the bucket forms a round on its own). First fit, in plan order:
        every rank computes the same rounds and posts its sends and receives in the same order.
        """
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        unit = dict(self.unit_elements)
        per_elem = self.element_bytes * kinds if bytes_per_element is None else bytes_per_element
        chunks = []
        for t in self.transfers:
            row_bytes = unit[t.name] * per_elem
            step = max(1, bucket_bytes // row_bytes)
            for a in range(t.start, t.stop, step):
                b = min(t.stop, a + step)
                chunks.append(WeightMove(t.name, t.dst, a, b, t.src, t.dim, t.src_local,
                                       t.dst_local, t.src_offset + a - t.start,
                                       t.dst_offset + a - t.start, unit[t.name] * (b - a)))
        return first_fit_rounds(chunks, lambda c: c.elements * per_elem, bucket_bytes)


def first_fit_rounds(items, size, bucket_bytes: int) -> list[tuple]:
    """``items`` (each with ``src`` and ``dst`` ranks) packed first fit, in order, into rounds in
    which no rank sends more than ``bucket_bytes`` and none receives more (an item bigger than
    a bucket forms a round on its own). Every rank computes the same rounds."""
    rounds: list[list] = []
    loads: list[tuple[dict, dict]] = []
    for c in items:
        n = size(c)
        for rnd, (sent, got) in zip(rounds, loads):
            if sent.get(c.src, 0) + n <= bucket_bytes and got.get(c.dst, 0) + n <= bucket_bytes:
                break
        else:
            rnd, sent, got = [], {}, {}
            rounds.append(rnd)
            loads.append((sent, got))
        rnd.append(c)
        sent[c.src] = sent.get(c.src, 0) + n
        got[c.dst] = got.get(c.dst, 0) + n
    return [tuple(r) for r in rounds]


def _subtract(needed: list[tuple[int, int]], held: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for a, b in needed:
        cur = [(a, b)]
        for c, d in held:
            nxt = []
            for x, y in cur:
                if d <= x or c >= y:
                    nxt.append((x, y))
                    continue
                if x < c:
                    nxt.append((x, c))
                if d < y:
                    nxt.append((d, y))
            cur = nxt
        out.extend(cur)
    return out


def plan_reshard(cfg: ModelConfig, src: ParallelLayout, dst: ParallelLayout, *,
                 element_bytes: Optional[int] = None) -> ReshardPlan:
    """The transfer plan that turns ``src``'s shards into ``dst``'s on the same ranks."""
    if src.world_size != dst.world_size:
        raise ValueError(f"layouts over different world sizes ({src}: {src.world_size}, "
                         f"{dst}: {dst.world_size}); a switch keeps the same ranks")
    eb = DTYPE_BYTES[cfg.params_dtype] if element_bytes is None else element_bytes
    rows = {r.name: r for r in tensor_table(cfg).full_rows}
    before, after = placement(cfg, src), placement(cfg, dst)
    load = [0] * src.world_size
    transfers, local_copies = [], []
    unit = []
    for name in sorted(rows):
        dim = rows[name].split_dim or 0
        per_row = rows[name].numel // rows[name].shape[dim]
        unit.append((name, per_row))
        moves, copies = deliver(name, dim, per_row, after[name], before[name], load)
        transfers += moves
        local_copies += copies
    return ReshardPlan(src=src, dst=dst, element_bytes=eb, transfers=tuple(sorted(transfers)),
                       local_copies=tuple(sorted(local_copies)),
                       min_bytes=sum(receive_bytes(cfg, src, dst, element_bytes=eb)),
                       unit_elements=tuple(unit), replicas=_replica_groups(before))


def deliver(name: str, dim: int, per_row: int, wants, sources: tuple[Holding, ...],
            load: list[int], node_of=None) -> tuple[list[WeightMove], list[WeightMove]]:
    """(transfers, local copies) that give every holding of ``wants`` its rows of full tensor
    ``name`` from the holdings ``sources``: rows a wanting rank already holds (under any local
    name) are copied locally; each other row comes once, from the least-loaded source replica
    (``load``: elements sent per rank so far, updated; with ``node_of``, rank -> node, a
    replica on the receiver's node first). The one delivery step of every plan:
    a switch (``plan_reshard``) and a weight transfer to other ranks or layouts
    (plan/weight_plan.py)."""
    held_by: dict[int, list[Holding]] = {}
    for h in sources:
        held_by.setdefault(h.rank, []).append(h)
    transfers, local_copies = [], []
    for want in wants:
        mine = held_by.get(want.rank, [])
        for piece in want.pieces:
            need = [(piece.start, piece.stop)]
            # local copies first: rows this rank already holds (under any local name)
            for h in mine:
                for p in h.pieces:
                    for x, y in list(need):
                        a, b = max(x, p.start), min(y, p.stop)
                        if a < b:
                            local_copies.append(WeightMove(
                                name, want.rank, a, b, want.rank, dim, h.local_name,
                                want.local_name, h.local_offset(dim, a),
                                want.local_offset(dim, a), per_row * (b - a)))
                            need = _subtract(need, [(a, b)])
            for a0, b0 in need:
                transfers.extend(_cover(name, dim, per_row, a0, b0, want, sources, load,
                                        node_of))
    return transfers, local_copies


def _replica_groups(held: dict[str, tuple[Holding, ...]]
                    ) -> tuple[tuple[str, tuple[tuple[int, ...], ...]], ...]:
    out = []
    for name in sorted(held):
        groups: dict[tuple, list[int]] = {}
        for h in held[name]:
            groups.setdefault((h.local_name, h.pieces), []).append(h.rank)
        out.append((name, tuple(sorted(tuple(g) for g in groups.values()))))
    return tuple(out)


def _cover(name: str, dim: int, per_row: int, a0: int, b0: int, want: Holding,
           sources: tuple[Holding, ...], load: list[int], node_of=None) -> list[WeightMove]:
    """Transfers for rows [a0, b0) of ``want``: per source piece, the least-loaded replica
    (with ``node_of``: of those on ``want``'s node, if any)."""
    def far(rank: int) -> bool:
        return node_of is not None and node_of(rank) != node_of(want.rank)

    out = []
    cuts = sorted({a0, b0} | {x for h in sources for p in h.pieces for x in (p.start, p.stop)
                              if a0 < x < b0})
    for a, b in zip(cuts, cuts[1:]):
        cands = [h for h in sources if any(p.start <= a and b <= p.stop for p in h.pieces)]
        if not cands:
            raise AssertionError(f"{name} rows [{a}, {b}) are held by no source rank")
        h = min(cands, key=lambda c: (far(c.rank), load[c.rank], c.rank))
        n = per_row * (b - a)
        load[h.rank] += n
        prev = out[-1] if out else None
        if prev and prev.src == h.rank and prev.stop == a and prev.src_local == h.local_name \
                and h.local_offset(dim, a) == prev.src_offset + prev.rows:
            out[-1] = WeightMove(name, want.rank, prev.start, b, h.rank, dim, h.local_name,
                               want.local_name, prev.src_offset, prev.dst_offset,
                               prev.elements + n)
            continue
        out.append(WeightMove(name, want.rank, a, b, h.rank, dim, h.local_name, want.local_name,
                            h.local_offset(dim, a), want.local_offset(dim, a), n))
    return out
