"""Reshard plan: which rank holds which slice of every full tensor, and what must move on a switch.

Pure data and pure functions (no torch, no torch.distributed, no megatron): every rank computes
the same plan from (model config, source layout, destination layout) and runs its own part of it
(runtime/switcher.py). The selector prices a switch with ``switch_cost_bytes``.

Placement of one full Megatron tensor (names as in weights/sharding.py, global layer indices):

- pp: a layer's tensors live on pp_stage ``layer // (num_layers / pp)``; the word embedding on
  pp_stage 0; final_layernorm and output_layer on the last. With tied embeddings and pp > 1 the
  last pp_stage holds a replica of the embedding under the local name ``output_layer.weight``
  (Megatron keeps the two equal); with pp == 1 the output layer is the embedding itself.
- tp: a slice is a set of ``Piece(dim, start, stop)`` row ranges along the tensor's TP split dim
  (dim 0: embedding, linear_qkv, linear_fc1, output_layer; dim 1: linear_proj, linear_fc2),
  concatenated in order to form the rank's local tensor. SwiGLU linear_fc1 has partition stride 2:
  tp rank r holds two pieces, ``gate[r]`` = rows [r*f/tp, (r+1)*f/tp) and ``up[r]`` = rows
  [f + r*f/tp, f + (r+1)*f/tp). Norms are replicated: one piece covering dim 0.
- dp and cp: every rank with the same (tp, pp) coordinates holds the same slices (replicas).

Transfer plan invariants (checked by tests/unit/test_reshard_plan.py):
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

from dataclasses import dataclass
from typing import Optional

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"

# Same rules as weights/sharding.py (which imports torch); a unit test checks they agree.
_DIM0 = ("embedding.word_embeddings.weight", "self_attention.linear_qkv.weight",
         "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight", "output_layer.weight")
_DIM1 = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_STRIDE2 = ("mlp.linear_fc1.weight",)


def split_dim(name: str) -> Optional[int]:
    """TP split dim of a full tensor, None for replicated ones (norms)."""
    if name.endswith(_DIM0):
        return 0
    if name.endswith(_DIM1):
        return 1
    return None


def full_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every full Megatron tensor of the model (global names) and its shape."""
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * d
    out = {EMBEDDING: (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attention.linear_qkv.weight"] = (qkv, h)
        if cfg.add_qkv_bias:
            out[p + "self_attention.linear_qkv.bias"] = (qkv,)
        out[p + "self_attention.linear_proj.weight"] = (h, cfg.num_attention_heads * d)
        out[p + "pre_mlp_layernorm.weight"] = (h,)
        out[p + "mlp.linear_fc1.weight"] = (2 * f, h)
        out[p + "mlp.linear_fc2.weight"] = (h, f)
    out["decoder.final_layernorm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        out[OUTPUT] = (cfg.vocab_size, h)
    return out


@dataclass(frozen=True, order=True)
class Piece:
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
    pieces: tuple[Piece, ...]
    """In local order: the local tensor is their concatenation along the split dim."""

    def local_offset(self, dim: int, row: int) -> int:
        """Position along ``dim`` of full row ``row`` inside the local tensor."""
        off = 0
        for p in self.pieces:
            if p.start <= row < p.stop:
                return off + row - p.start
            off += p.length
        raise ValueError(f"row {row} is not held by rank {self.rank} ({self.local_name})")


def tp_pieces(name: str, shape: tuple[int, ...], tp_rank: int, tp: int) -> tuple[Piece, ...]:
    dim = split_dim(name)
    if dim is None or tp == 1:
        return (Piece(0 if dim is None else dim, 0, shape[0 if dim is None else dim]),)
    n = shape[dim]
    if name.endswith(_STRIDE2):
        half = n // 2
        per = half // tp
        return (Piece(0, tp_rank * per, (tp_rank + 1) * per),
                Piece(0, half + tp_rank * per, half + (tp_rank + 1) * per))
    per = n // tp
    return (Piece(dim, tp_rank * per, (tp_rank + 1) * per),)


def _pp_local(name: str, layout: ParallelLayout, cfg: ModelConfig) -> list[tuple[int, str]]:
    """(pp_rank, local name) of every pp_stage that holds ``name``."""
    per = cfg.num_layers // layout.pp
    if name.startswith("decoder.layers."):
        rest = name[len("decoder.layers."):]
        idx, tail = rest.split(".", 1)
        g = int(idx)
        return [(g // per, f"decoder.layers.{g % per}.{tail}")]
    last = layout.pp - 1
    if name == EMBEDDING:
        out = [(0, EMBEDDING)]
        if cfg.tie_word_embeddings and layout.pp > 1:
            out.append((last, OUTPUT))
        return out
    return [(last, name)]


def placement(cfg: ModelConfig, layout: ParallelLayout) -> dict[str, tuple[Holding, ...]]:
    """Every full tensor -> the holdings of every rank that has part of it (ascending rank)."""
    layout.check(layout.world_size, cfg.shape)
    shapes = full_shapes(cfg)
    coords = [layout.coords(r) for r in range(layout.world_size)]
    out = {}
    for name, shape in shapes.items():
        holds = []
        for pp_rank, local in _pp_local(name, layout, cfg):
            for r, c in enumerate(coords):
                if c.pp == pp_rank:
                    holds.append(Holding(r, local, tp_pieces(name, shape, c.tp, layout.tp)))
        out[name] = tuple(sorted(holds, key=lambda h: (h.rank, h.local_name)))
    return out


@dataclass(frozen=True, order=True)
class Transfer:
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
    transfers: tuple[Transfer, ...]
    """Between different ranks, sorted."""
    local_copies: tuple[Transfer, ...]
    min_bytes: int
    """Bytes destination ranks need and did not hold under ``src``: what any plan must move."""
    unit_elements: tuple[tuple[str, int], ...]
    """Elements per row along the split dim, per tensor (to split transfers into buckets)."""

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

    @property
    def max_send_bytes(self) -> int:
        return max(self.send_bytes())

    @property
    def max_recv_bytes(self) -> int:
        return max(self.recv_bytes())

    def for_rank(self, rank: int) -> tuple[list[Transfer], list[Transfer], list[Transfer]]:
        """(sends, receives, local copies) of one rank."""
        sends = [t for t in self.transfers if t.src == rank]
        recvs = [t for t in self.transfers if t.dst == rank]
        return sends, recvs, [t for t in self.local_copies if t.src == rank]

    def rounds(self, bucket_bytes: int, kinds: int = 1, *,
               bytes_per_element: Optional[int] = None) -> list[tuple[Transfer, ...]]:
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
                chunks.append(Transfer(t.name, t.dst, a, b, t.src, t.dim, t.src_local,
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
    shapes = full_shapes(cfg)
    before, after = placement(cfg, src), placement(cfg, dst)
    load = [0] * src.world_size
    transfers, local_copies = [], []
    needed_elems = 0
    unit = []
    for name in sorted(shapes):
        shape = shapes[name]
        dim = split_dim(name) or 0
        per_row = 1
        for i, n in enumerate(shape):
            if i != dim:
                per_row *= n
        unit.append((name, per_row))
        held_by = {}
        for h in before[name]:
            held_by.setdefault(h.rank, []).append(h)
        for want in after[name]:
            mine = held_by.get(want.rank, [])
            for piece in want.pieces:
                need = [(piece.start, piece.stop)]
                # local copies first: rows this rank already holds (under any local name)
                for h in mine:
                    for p in h.pieces:
                        for x, y in list(need):
                            a, b = max(x, p.start), min(y, p.stop)
                            if a < b:
                                local_copies.append(Transfer(
                                    name, want.rank, a, b, want.rank, dim, h.local_name,
                                    want.local_name, h.local_offset(dim, a),
                                    want.local_offset(dim, a), per_row * (b - a)))
                                need = _subtract(need, [(a, b)])
                for a0, b0 in need:
                    needed_elems += per_row * (b0 - a0)
                    transfers.extend(_cover(name, dim, per_row, a0, b0, want, before[name], load))
    return ReshardPlan(src=src, dst=dst, element_bytes=eb, transfers=tuple(sorted(transfers)),
                       local_copies=tuple(sorted(local_copies)), min_bytes=needed_elems * eb,
                       unit_elements=tuple(unit))


def _cover(name: str, dim: int, per_row: int, a0: int, b0: int, want: Holding,
           sources: tuple[Holding, ...], load: list[int]) -> list[Transfer]:
    """Transfers for rows [a0, b0) of ``want``: per source piece, the least-loaded replica."""
    out = []
    cuts = sorted({a0, b0} | {x for h in sources for p in h.pieces for x in (p.start, p.stop)
                              if a0 < x < b0})
    for a, b in zip(cuts, cuts[1:]):
        cands = [h for h in sources if any(p.start <= a and b <= p.stop for p in h.pieces)]
        if not cands:
            raise AssertionError(f"{name} rows [{a}, {b}) are held by no source rank")
        h = min(cands, key=lambda c: (load[c.rank], c.rank))
        n = per_row * (b - a)
        load[h.rank] += n
        prev = out[-1] if out else None
        if prev and prev.src == h.rank and prev.stop == a and prev.src_local == h.local_name \
                and h.local_offset(dim, a) == prev.src_offset + prev.rows:
            out[-1] = Transfer(name, want.rank, prev.start, b, h.rank, dim, h.local_name,
                               want.local_name, prev.src_offset, prev.dst_offset,
                               prev.elements + n)
            continue
        out.append(Transfer(name, want.rank, a, b, h.rank, dim, h.local_name, want.local_name,
                            h.local_offset(dim, a), want.local_offset(dim, a), n))
    return out


@dataclass(frozen=True)
class SwitchCost:
    """What a layout switch moves, for the selector."""

    bytes_moved: int
    min_bytes: int
    max_send_bytes: int
    """Largest bytes any one rank sends (the switch's critical path on a uniform fabric)."""
    max_recv_bytes: int


def switch_cost_bytes(cfg: ModelConfig, a: ParallelLayout, b: ParallelLayout, *,
                      optimizer_state: bool = False) -> SwitchCost:
    """Bytes a switch from ``a`` to ``b`` moves: weights, plus fp32 Adam moments if asked.

    With ``optimizer_state`` each transfer also carries ``exp_avg`` and ``exp_avg_sq`` (fp32),
    and an fp32 master copy when the weights are not fp32 (plain optimizer state layout)."""
    if a == b:
        return SwitchCost(0, 0, 0, 0)
    plan = plan_reshard(cfg, a, b)
    wb = plan.element_bytes
    per_elem = wb + ((8 + (4 if wb != 4 else 0)) if optimizer_state else 0)
    scale = lambda x: x // wb * per_elem  # noqa: E731 - elements times bytes per element
    return SwitchCost(scale(plan.bytes_moved), scale(plan.min_bytes),
                      scale(plan.max_send_bytes), scale(plan.max_recv_bytes))
