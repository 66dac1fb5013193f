"""Placements: which rank holds which per-sample tensor elements (pure planning).

A *placement* is the set of pieces ``(rank, tensor, sample_id, start, end)``: rank holds elements
``[start, end)`` of that sample's 1-D tensor. Per-token tensors have one element per token (the
trainer pads or shifts logprobs so they have the sample's length); per-sample tensors (rewards)
have one element. A rank's local tensor for one sample is the concatenation of its pieces in
ascending ``start`` order, which is Megatron's CP order (chunk i, then chunk 2*cp-1-i).

Context parallelism uses Megatron's load-balanced split: the sequence is cut in ``2*cp`` chunks
and cp rank i holds chunks i and ``2*cp-1-i``, so every cp rank gets the same causal work::

    length 16, cp=2:  chunks  [0:4) [4:8) [8:12) [12:16)
                      cp rank    0     1     1      0

A consumer placement comes from a layout and sample lengths: samples go to DP ranks and then to
micro-batches by token-balanced greedy (longest first, ties by sample id, to the least-loaded
DP rank, ties by fewer samples then lower rank); given the producer placement, a sample stays on
the DP rank that already holds it when that does not make the busiest DP rank busier. Each
tensor is replicated on every TP rank and on the pp_stages that read it
(``TensorSpec.pp_stages``); e.g. DP4 producer -> TP2xPP2 consumer, 4 samples A..D::

    producer DP4 (rank = dp)          consumer TP2xPP2 (dp=1): every rank needs A..D
      r0: A  r1: B  r2: C  r3: D        pp_stage 0 [r0 r1]: tokens (inputs)
                                        pp_stage 1 [r2 r3]: tokens (labels), loss_mask,
                                                            old/ref logprobs, advantages, rewards

Invariants (checked on construction, tested):
- Pieces are canonical: sorted, without duplicates, adjacent ranges of one (rank, tensor,
  sample) merged. The same pieces given in any order or repeated give an equal Placement, so every
  rank that builds it from gathered metadata gets the same value.
- ``0 <= start < end <= elements`` and every tensor/sample named is declared.
- The CP chunks of one sample partition ``[0, length)`` across the cp ranks.
- Nothing here imports torch, torch.distributed or megatron.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Iterable, Mapping, Optional, Sequence

from earl_megatron.plan.layout import ParallelLayout

ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "float16": 2, "bfloat16": 2,
            "int32": 4, "float32": 4, "int64": 8, "float64": 8}
PP_STAGE_SETS = ("first", "last", "first+last", "all")

Interval = tuple[int, int]


@dataclass(frozen=True)
class TensorSpec:
    """One kind of per-sample tensor and the pp_stages that read it."""

    name: str
    dtype: str
    """torch dtype name without the 'torch.' prefix, e.g. "float32"; see ITEMSIZE."""
    per_token: bool = True
    """True: one element per token; False: one element per sample (a reward)."""
    pp_stages: str = "last"
    """Which pp_stages hold it: "first" (model inputs), "last" (loss), "first+last" or "all"."""

    def __post_init__(self):
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"TensorSpec {self.name!r}: unknown dtype {self.dtype!r}; "
                             f"use one of {sorted(ITEMSIZE)}")
        if self.pp_stages not in PP_STAGE_SETS:
            raise ValueError(f"TensorSpec {self.name!r}: pp_stages={self.pp_stages!r}; "
                             f"use one of {PP_STAGE_SETS}")

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    def elements(self, length: int) -> int:
        return length if self.per_token else 1

    def stages(self, pp: int, pp_stages: Optional[str] = None) -> tuple[int, ...]:
        which = pp_stages or self.pp_stages
        if which == "first":
            return (0,)
        if which == "last":
            return (pp - 1,)
        if which == "first+last":
            return tuple(sorted({0, pp - 1}))
        return tuple(range(pp))


@dataclass(frozen=True, order=True)
class Piece:
    rank: int
    tensor: str
    sample_id: int
    start: int
    end: int


# ----------------------------------------------------------------------------- intervals
def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """Union of half-open intervals, sorted, adjacent and overlapping ones merged."""
    out: list[list[int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def subtract_intervals(keep: Sequence[Interval], remove: Sequence[Interval]) -> list[Interval]:
    """``keep`` minus ``remove``; both merged and sorted."""
    out = []
    for a, b in keep:
        cur = a
        for c, d in remove:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
        if cur < b:
            out.append((cur, b))
    return out


def cp_chunks(length: int, cp: int, cp_rank: int) -> list[Interval]:
    """Token ranges cp rank ``cp_rank`` holds: chunks i and 2*cp-1-i of 2*cp (empty dropped).

    Chunk k is ``[k*length // (2*cp), (k+1)*length // (2*cp))``, so the chunks partition any
    length; Megatron pads to a multiple of 2*cp, and then these are its chunks exactly.
    """
    n = 2 * cp
    bounds = [k * length // n for k in range(n + 1)]
    out = []
    for k in (cp_rank, n - 1 - cp_rank):
        if bounds[k] < bounds[k + 1]:
            out.append((bounds[k], bounds[k + 1]))
    return merge_intervals(out)


# ----------------------------------------------------------------------------- placement
@dataclass(frozen=True)
class Placement:
    """Who holds which elements of which tensor of which sample (see the module docstring)."""

    world_size: int
    tensors: tuple[TensorSpec, ...]
    lengths: tuple[tuple[int, int], ...]
    """(sample_id, length in tokens), sorted by sample id."""
    pieces: tuple[Piece, ...]
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...] = ()
    """Consumer only: ``micro_batches[dp_rank][mb]`` = sample ids, in the order to train them."""
    layout: Optional[ParallelLayout] = field(default=None, compare=True)

    def __post_init__(self):
        lengths = dict(self.lengths)
        if len(lengths) != len(set(self.lengths)):
            raise ValueError("Placement: a sample id has two different lengths in the metadata; "
                             "every rank must report the same length for a sample")
        specs = {t.name: t for t in self.tensors}
        if len(specs) != len(self.tensors):
            raise ValueError("Placement: tensor names must be unique")
        for p in self.pieces:
            if not 0 <= p.rank < self.world_size:
                raise ValueError(f"Placement: {p} has a rank outside world size {self.world_size}")
            if p.tensor not in specs:
                raise ValueError(f"Placement: {p} names tensor {p.tensor!r}, not in {list(specs)}")
            if p.sample_id not in lengths:
                raise ValueError(f"Placement: {p} names sample {p.sample_id} with no length")
            n = specs[p.tensor].elements(lengths[p.sample_id])
            if not 0 <= p.start < p.end <= n:
                raise ValueError(f"Placement: {p} is not a non-empty range inside [0, {n})")
        object.__setattr__(self, "lengths", tuple(sorted(lengths.items())))
        object.__setattr__(self, "pieces", _canonical(self.pieces))

    # ------------------------------------------------------------------ lookups
    @cached_property
    def length_of(self) -> dict[int, int]:
        return dict(self.lengths)

    @cached_property
    def spec(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}

    @cached_property
    def _by_key(self) -> dict[tuple[str, int], list[Piece]]:
        idx: dict[tuple[str, int], list[Piece]] = {}
        for p in self.pieces:
            idx.setdefault((p.tensor, p.sample_id), []).append(p)
        return idx

    @cached_property
    def _by_rank(self) -> dict[int, list[Piece]]:
        idx: dict[int, list[Piece]] = {}
        for p in self.pieces:
            idx.setdefault(p.rank, []).append(p)
        return idx

    @property
    def sample_ids(self) -> tuple[int, ...]:
        return tuple(s for s, _ in self.lengths)

    def holders(self, tensor: str, sample_id: int) -> list[Piece]:
        return self._by_key.get((tensor, sample_id), [])

    def pieces_of(self, rank: int) -> list[Piece]:
        return self._by_rank.get(rank, [])

    def intervals(self, rank: int, tensor: str, sample_id: int) -> list[Interval]:
        return [(p.start, p.end) for p in self.holders(tensor, sample_id) if p.rank == rank]

    def local_samples(self, rank: int, tensor: str) -> list[int]:
        return sorted({p.sample_id for p in self.pieces_of(rank) if p.tensor == tensor})

    def nbytes(self, piece: Piece) -> int:
        return (piece.end - piece.start) * self.spec[piece.tensor].itemsize

    def shifted(self, offset: int, world_size: int) -> "Placement":
        """The same pieces on ranks ``offset + r`` of a world of ``world_size`` ranks: a pool's
        placement (split placement, runtime/groups.py) seen from the whole world, for a
        dispatch between pools."""
        if offset < 0 or offset + self.world_size > world_size:
            raise ValueError(f"a placement over {self.world_size} ranks shifted by {offset} "
                             f"does not fit a world of {world_size}")
        return replace(self, world_size=world_size,
                       pieces=tuple(replace(p, rank=p.rank + offset) for p in self.pieces))

    def owned_intervals(self, rank: int, tensor: str, sample_id: int) -> list[Interval]:
        """Elements of this sample that ``rank`` holds and no lower rank holds.

        Every element held anywhere has exactly one owner, so reductions that sum over owners
        count each token once however the placement replicates it.
        """
        mine = self.intervals(rank, tensor, sample_id)
        lower = merge_intervals((p.start, p.end) for p in self.holders(tensor, sample_id)
                                if p.rank < rank)
        return subtract_intervals(mine, lower)


def _canonical(pieces: Iterable[Piece]) -> tuple[Piece, ...]:
    groups: dict[tuple[int, str, int], list[Interval]] = {}
    for p in pieces:
        groups.setdefault((p.rank, p.tensor, p.sample_id), []).append((p.start, p.end))
    out = [Piece(r, t, s, a, b) for (r, t, s), ivs in groups.items()
           for a, b in merge_intervals(ivs)]
    return tuple(sorted(out))


# ----------------------------------------------------------------------------- construction
def assign_samples(lengths: Mapping[int, int], dp: int, num_micro_batches: int = 1,
                   prefer: Optional[Mapping[int, int]] = None,
                   ) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Token-balanced ``[dp_rank][micro_batch] -> sample ids`` (deterministic).

    Longest first (ties by sample id), each to the DP rank with the fewest tokens (ties: fewer
    samples, then lower rank); then the same greedy inside each DP rank over micro-batches.
    Greedy longest-first keeps every DP rank under ``mean + longest``.

    ``prefer[s]``: a DP rank where sample s already is (locality). The sample goes there instead
    when that keeps the rank at or under the busiest DP rank of the plain greedy; the result with
    preferences is kept only if its busiest DP rank is no worse than plain greedy's. Training
    time follows the busiest DP rank, so locality never costs training time.
    """
    if dp < 1 or num_micro_batches < 1:
        raise ValueError(f"assign_samples: dp={dp} and num_micro_batches={num_micro_batches} "
                         "must be >= 1")
    order = sorted(lengths, key=lambda s: (-lengths[s], s))

    def greedy(ids: list[int], bins: int, pref: Mapping[int, int], cap: float):
        load = [[0, 0, b] for b in range(bins)]  # tokens, samples, index
        out: list[list[int]] = [[] for _ in range(bins)]
        for s in ids:
            best = min(load)
            p = pref.get(s)
            if p is not None and load[p][0] + lengths[s] <= cap:
                best = load[p]
            out[best[2]].append(s)
            best[0] += lengths[s]
            best[1] += 1
        return out, max(x[0] for x in load)

    per_dp, busiest = greedy(order, dp, {}, 0)
    if prefer:
        local, local_busiest = greedy(order, dp, prefer, busiest)
        if local_busiest <= busiest:
            per_dp = local
    return tuple(tuple(tuple(sorted(mb)) for mb in greedy(ids, num_micro_batches, {}, 0)[0])
                 for ids in per_dp)


def placement_from_assignment(layout: ParallelLayout, assignment: Sequence[Sequence[Sequence[int]]],
                              lengths: Mapping[int, int],
                              tensors: Sequence[TensorSpec], *,
                              pp_stages: Optional[Mapping[str, str]] = None) -> Placement:
    """Pieces for samples assigned ``[dp_rank][micro_batch]``: replicated on TP, CP-split,
    on the pp_stages each tensor needs (``pp_stages`` overrides per tensor name, e.g. a
    producer that holds tokens on every pp_stage)."""
    if len(assignment) != layout.dp:
        raise ValueError(f"assignment has {len(assignment)} DP entries but layout {layout} has "
                         f"dp={layout.dp}; give one list of micro-batches per DP rank")
    pp_stages = dict(pp_stages or {})
    pieces = []
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        for spec in tensors:
            if c.pp not in spec.stages(layout.pp, pp_stages.get(spec.name)):
                continue
            for mb in assignment[c.dp]:
                for s in mb:
                    ranges = (cp_chunks(lengths[s], layout.cp, c.cp) if spec.per_token
                              else [(0, 1)])
                    pieces.extend(Piece(rank, spec.name, s, a, b) for a, b in ranges)
    used = {s for per_dp in assignment for mb in per_dp for s in mb}
    return Placement(world_size=layout.world_size, tensors=tuple(tensors),
                     lengths=tuple((s, lengths[s]) for s in sorted(used)), pieces=tuple(pieces),
                     micro_batches=tuple(tuple(tuple(mb) for mb in d) for d in assignment),
                     layout=layout)


def consumer_placement(layout: ParallelLayout, lengths: Mapping[int, int],
                       tensors: Sequence[TensorSpec], num_micro_batches: int = 1,
                       producer: Optional[Placement] = None,
                       assignment: Optional[Sequence[Sequence[Sequence[int]]]] = None,
                       ) -> Placement:
    """Where a consumer in ``layout`` needs each tensor: token-balanced over DP and micro-batches.

    With ``producer``, each sample prefers the consumer DP rank whose ranks already hold the
    most of its bytes (ties: lower DP rank), within the balance bound of ``assign_samples``.
    ``assignment`` (``[dp_rank][mb] -> ids``, e.g. plan/batching.py's length-grouped
    micro-batches) replaces that choice.
    """
    if assignment is not None:
        return placement_from_assignment(layout, assignment, lengths, tensors)
    prefer = None
    if producer is not None:
        names = {t.name for t in tensors}
        held: dict[int, dict[int, int]] = {}
        for p in producer.pieces:
            if p.tensor in names and p.sample_id in lengths:
                d = layout.coords(p.rank).dp
                per = held.setdefault(p.sample_id, {})
                per[d] = per.get(d, 0) + producer.nbytes(p)
        prefer = {s: min(per, key=lambda d: (-per[d], d)) for s, per in held.items()}
    return placement_from_assignment(
        layout, assign_samples(lengths, layout.dp, num_micro_batches, prefer), lengths, tensors)


def producer_placement(layout: ParallelLayout, reports: Sequence[Sequence[tuple[int, int]]],
                       tensors: Sequence[TensorSpec], *,
                       pp_stages: Optional[Mapping[str, str]] = None) -> Placement:
    """Producer placement from what each rank reports: ``reports[rank]`` = (sample_id, length)
    of the samples its DP replica produced. Ranks of one DP replica may report the same samples
    or only some of them; the union per DP rank is used. Order and duplicates do not matter."""
    if len(reports) != layout.world_size:
        raise ValueError(f"producer_placement: {len(reports)} reports for a world of "
                         f"{layout.world_size}; pass one (possibly empty) report per rank")
    lengths: dict[int, int] = {}
    by_dp: list[set[int]] = [set() for _ in range(layout.dp)]
    for rank, report in enumerate(reports):
        for s, n in report:
            if lengths.setdefault(s, n) != n:
                raise ValueError(f"sample {s} reported with lengths {lengths[s]} and {n}; "
                                 "ranks must agree on sample lengths")
            by_dp[layout.coords(rank).dp].add(s)
    owner: dict[int, int] = {}
    for d, ids in enumerate(by_dp):
        for s in ids:
            if owner.setdefault(s, d) != d:
                raise ValueError(f"sample {s} reported by DP ranks {owner[s]} and {d}; a sample "
                                 "must come from one DP replica (use distinct sample ids)")
    assignment = [[sorted(ids)] for ids in by_dp]
    return placement_from_assignment(layout, assignment, lengths, tensors, pp_stages=pp_stages)
