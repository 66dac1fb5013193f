"""Optimizer-state plan: who sends which flat range of the Adam state to whom on a switch.

Pure data and pure functions, like plan/reshard_plan.py, whose weight plan this refines.

Megatron's optimizers keep each parameter's fp32 state (master copy, ``exp_avg``,
``exp_avg_sq``) as a *flat range* of the rank's local (TP-sharded) parameter: the whole of it for
the plain optimizer, a slice ``[start, stop)`` of its row-major flattening per dp x cp rank for the
distributed optimizer (disjoint over the replicas, covering the parameter). A switch must hand
each new rank exactly its new range, and any plan must move at least the elements a rank needs
and did not own before.

The weight plan already cuts every destination tensor into boxes (``WeightMove``: rows along the
split dim, from one source replica). Inside a box, the map from the box's own row-major index
to the local tensor's flat index is increasing on both sides (source and destination local
tensors), so a flat range of either local tensor is one *interval* of box indices. A state
segment is therefore ``(box, [u, v))``: the part of the box that the destination owns under
the new layout and one source replica owned under the old. For each box the source replicas are
tried in order (the weight plan's sender first, then the others by rank: ``plan.replicas_of``,
the dp x cp replicas of a dense tensor, the edp replicas of an expert), each taking what is
still unassigned; with the plain optimizer the first covers everything. Megatron's distributed
optimizer shards an expert's state over its expert-data-parallel group (edp ranks), a dense
tensor's over dp x cp: the ranges say which, the plan needs no other rule.

Invariants (tests/unit/test_state_plan.py, against element-by-element enumeration):
- every element a destination owns is written exactly once, by a segment whose source owned it;
- a segment is local (``src == dst``) whenever the destination owned the element itself, so the
  elements sent equal the minimum any plan must send;
- ``pieces(u, v)`` lists at most three strided blocks (head row, whole rows, tail row) whose
  row-major concatenation is box elements ``[u, v)`` in order.
"""

from __future__ import annotations

from dataclasses import dataclass

from earl_megatron.plan.reshard_plan import ReshardPlan, WeightMove, first_fit_rounds


@dataclass(frozen=True)
class Block:
    """``rows`` x ``cols`` elements of a flat tensor, row ``i`` starting at ``start + i * stride``."""

    start: int
    rows: int
    cols: int
    stride: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class Box:
    """Rows ``[offset, offset + rows)`` along ``dim`` of a local 1-D or 2-D tensor of ``shape``."""

    shape: tuple[int, ...]
    dim: int
    offset: int
    rows: int

    @property
    def _grid(self) -> tuple[int, int, int]:
        """(box rows, box cols, columns of the local tensor) in the 2-D view of the box."""
        cols = 1 if len(self.shape) == 1 else self.shape[1]
        if self.dim == 0:
            return self.rows, cols, cols
        return self.shape[0], self.rows, cols

    @property
    def numel(self) -> int:
        r, c, _ = self._grid
        return r * c

    def flat_of(self, k: int) -> int:
        """Local flat index of box element ``k`` (row-major in the box)."""
        _, c, width = self._grid
        if self.dim == 0:
            return self.offset * width + k
        return (k // c) * width + self.offset + k % c

    def count_below(self, x: int) -> int:
        """How many box elements have a local flat index below ``x`` (increasing in ``x``)."""
        r, c, width = self._grid
        if self.dim == 0:
            return min(max(x - self.offset * width, 0), r * c)
        row, col = divmod(max(x, 0), width)
        if row >= r:
            return r * c
        return row * c + min(max(col - self.offset, 0), c)

    def interval(self, start: int, stop: int) -> tuple[int, int]:
        """Box elements ``[u, v)`` whose local flat index lies in ``[start, stop)``."""
        return self.count_below(start), self.count_below(stop)

    def pieces(self, u: int, v: int) -> tuple[Block, ...]:
        """Box elements ``[u, v)`` as blocks of the local flat tensor, in box order."""
        if u >= v:
            return ()
        _, c, width = self._grid
        if self.dim == 0:
            return (Block(self.flat_of(u), 1, v - u, v - u),)
        out = []
        r0, c0 = divmod(u, c)
        r1, c1 = divmod(v, c)
        if r0 == r1:
            return (Block(self.flat_of(u), 1, c1 - c0, c1 - c0),)
        if c0:
            out.append(Block(self.flat_of(u), 1, c - c0, c - c0))
            r0 += 1
        if r1 > r0:
            out.append(Block(self.flat_of(r0 * c), r1 - r0, c, width))
        if c1:
            out.append(Block(self.flat_of(r1 * c), 1, c1, c1))
        return tuple(out)


@dataclass(frozen=True)
class StateSegment:
    """Box elements ``[u, v)`` of one weight-plan box, from ``src``'s old state to ``dst``'s new."""

    src: int
    dst: int
    src_local: str
    dst_local: str
    src_box: Box
    dst_box: Box
    u: int
    v: int

    @property
    def elements(self) -> int:
        return self.v - self.u

    def split(self, max_elements: int) -> list["StateSegment"]:
        step = max(1, max_elements)
        return [StateSegment(self.src, self.dst, self.src_local, self.dst_local, self.src_box,
                             self.dst_box, a, min(self.v, a + step))
                for a in range(self.u, self.v, step)]


StateRanges = dict[str, tuple[tuple[int, ...], int, int]]
"""{local name: (local shape, flat start, flat stop)}: the state one rank owns."""
LayoutStateRanges = dict[int, StateRanges]
"""{rank: StateRanges}: one layout's state ownership, every rank's."""


def plan_state_segments(plan: ReshardPlan, old: LayoutStateRanges,
                        new: LayoutStateRanges) -> tuple[StateSegment, ...]:
    """Segments that give every new rank its state range, each element from one old owner."""
    out = []
    for t in sorted(plan.local_copies + plan.transfers):
        dst_shape, c, d = new[t.dst].get(t.dst_local, ((), 0, 0))
        if c >= d:
            continue
        dst_box = _box(t, dst_shape, t.dst_offset)
        todo = [iv for iv in [dst_box.interval(c, d)] if iv[0] < iv[1]]
        for s in [t.src] + [r for r in plan.replicas_of(t.name, t.src) if r != t.src]:
            if not todo:
                break
            shape, a, b = old[s].get(t.src_local, ((), 0, 0))
            if a >= b:
                continue
            src_box = _box(t, shape, t.src_offset)
            lo, hi = src_box.interval(a, b)
            left = []
            for x, y in todo:
                u, v = max(x, lo), min(y, hi)
                if u < v:
                    out.append(StateSegment(s, t.dst, t.src_local, t.dst_local, src_box,
                                            dst_box, u, v))
                    left += [iv for iv in ((x, u), (v, y)) if iv[0] < iv[1]]
                else:
                    left.append((x, y))
            todo = left
        if todo:
            raise ValueError(f"{t.name}: state elements {todo} of rank {t.dst}'s box are owned "
                             "by no old rank; the old optimizer's ranges do not cover the model")
    return tuple(out)


def _box(t: WeightMove, shape: tuple[int, ...], offset: int) -> Box:
    return Box(tuple(shape), t.dim, offset, t.rows)


def segment_rounds(segments, bytes_per_element: int,
                   bucket_bytes: int) -> list[tuple[StateSegment, ...]]:
    """Segments cut to at most one bucket and packed first-fit into rounds in which no rank sends
    or receives over ``bucket_bytes`` (local segments excluded: they move no bytes)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    pieces = [p for seg in segments if seg.src != seg.dst
              for p in seg.split(bucket_bytes // bytes_per_element)]
    return first_fit_rounds(pieces, lambda p: p.elements * bytes_per_element, bucket_bytes)
