"""Parallel layouts: a (tp, cp, pp, dp, ep) value over a world of ranks, in Megatron-Core's order.

A layout is pure data. Constructing one checks only that each axis is a positive integer;
``ParallelLayout.create`` (and ``check``) validate it against a world size and a ModelConfig and
raise ``InvalidLayoutError`` naming the axis and the fix, before any process group exists.

Rank order is Megatron-Core's default ``order="tp-cp-ep-dp-pp"`` (tp varies fastest)::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

    world 8, tp=2 cp=1 pp=2 dp=2:      pp_stage 0        pp_stage 1
                                     dp0: [0 1]        dp0: [4 5]     [a b] = one tp group
                                     dp1: [2 3]        dp1: [6 7]

Expert parallelism (mixture-of-experts models) does not take ranks of its own: as in
Megatron-Core, the ``tp * cp * dp`` ranks of a pp_stage are regrouped for the expert layers as
``etp x ep x edp`` (expert tensor parallel, expert parallel, expert data parallel), in Megatron's
expert order "tp-ep-dp-pp"::

    rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank))
    edp = tp * cp * dp // (etp * ep)

``etp`` left None is ``tp`` (Megatron's ``expert_tensor_parallel_size=None``). EP rank ``e``
holds experts ``[e * E / ep, (e + 1) * E / ep)`` of every MoE layer, each split ``etp`` ways.
Dense layers (attention, norms, embeddings) ignore ep entirely. ``EP4xTP2`` on 8 ranks is
TP2xDP4 for attention and ETP2xEP4 for the experts.

Invariants:
- ``tp * cp * pp * dp == world_size`` for a checked layout; ``coords(rank(c)) == c``;
  ``etp * ep`` divides ``tp * cp * dp`` (ep > 1 only for a model with experts, which it divides).
- ``group_ranks(axis)`` partitions ``range(world_size)``; every group lists ranks ascending;
  ``expert_group_ranks`` likewise for the expert grid (both match Megatron's RankGenerator).
- Nothing here imports torch.distributed or megatron.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Optional

from earl_megatron.config.model import ModelConfig

AXES = ("tp", "cp", "pp", "dp")
"""The dense grid's axes; ``ep`` and ``etp`` regroup the same ranks for the experts."""
EXPERT_AXES = ("etp", "ep", "edp")


class InvalidLayoutError(ValueError):
    """A layout that cannot run: names the offending axis and how to fix it."""

    def __init__(self, axis: str, problem: str, fix: str):
        self.axis = axis
        self.problem = problem
        self.fix = fix
        super().__init__(f"invalid layout ({axis}): {problem}. Fix: {fix}")


@dataclass(frozen=True)
class Coords:
    tp: int
    cp: int
    pp: int
    dp: int


@dataclass(frozen=True)
class ExpertCoords:
    """A rank's place in the expert grid (Megatron's expert "tp-ep-dp-pp" order)."""

    etp: int
    ep: int
    edp: int
    pp: int


@functools.total_ordering
@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the parallel axes (ep / etp: the experts' regrouping of tp x cp x dp)."""

    tp: int = 1
    """Tensor parallel size: splits heads and the FFN; 1 means disabled."""
    cp: int = 1
    """Context parallel size: splits each sequence (load-balanced, 2*cp chunks); 1 = disabled."""
    pp: int = 1
    """Pipeline parallel size: splits layers into pp_stages; 1 means disabled."""
    dp: int = 1
    """Data parallel size: replicas that see different samples."""
    ep: int = 1
    """Expert parallel size: each EP rank holds num_experts / ep experts of every MoE layer."""
    etp: Optional[int] = None
    """Expert tensor parallel size; None: the same as tp (Megatron's default)."""

    def __post_init__(self):
        for axis in AXES + ("ep", "etp"):
            v = getattr(self, axis)
            if axis == "etp" and v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidLayoutError(axis, f"{axis}={v!r} is not a positive integer",
                                         f"set {axis} to an integer >= 1")
        if self.etp == self.tp:   # one spelling: etp=tp is the default
            object.__setattr__(self, "etp", None)

    def __lt__(self, other: "ParallelLayout") -> bool:
        return _sort_key(self) < _sort_key(other)

    @property
    def expert_tp(self) -> int:
        """Expert tensor parallel size (etp, or tp when unset)."""
        return self.tp if self.etp is None else self.etp

    @property
    def edp(self) -> int:
        """Expert data parallel size: replicas of each expert within a pp_stage."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    # ----------------------------------------------------------------- construction / checks
    @classmethod
    def create(cls, world_size: int, model: Optional[ModelConfig] = None, *, tp: int = 1,
               cp: int = 1, pp: int = 1, dp: Optional[int] = None, ep: int = 1,
               etp: Optional[int] = None) -> "ParallelLayout":
        """Build and check a layout; ``dp=None`` takes whatever the other axes leave."""
        if dp is None:
            denom = tp * cp * pp
            if denom <= 0 or world_size % denom:
                raise InvalidLayoutError(
                    "dp", f"tp*cp*pp={tp}*{cp}*{pp}={denom} does not divide world size {world_size}",
                    f"choose tp, cp, pp whose product divides {world_size}")
            dp = world_size // denom
        layout = cls(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp)
        layout.check(world_size, model)
        return layout

    def check(self, world_size: int, model: Optional[ModelConfig] = None) -> "ParallelLayout":
        """Raise InvalidLayoutError for the first axis that cannot work; return self otherwise."""
        if self.world_size != world_size:
            raise InvalidLayoutError(
                "dp", f"tp*cp*pp*dp = {self.tp}*{self.cp}*{self.pp}*{self.dp} = {self.world_size} "
                f"!= world size {world_size}",
                f"make the product equal {world_size} (e.g. leave dp unset so it is inferred)")
        grid = self.tp * self.cp * self.dp
        if grid % (self.expert_tp * self.ep):
            raise InvalidLayoutError(
                "ep", f"etp*ep = {self.expert_tp}*{self.ep} does not divide tp*cp*dp = {grid} "
                "(Megatron regroups each pp_stage's tp x cp x dp ranks for the experts)",
                f"use ep in {[e for e in _divisors(grid) if grid % (e * self.expert_tp) == 0]}")
        if model is None:
            return self
        if not model.is_moe and (self.ep > 1 or self.etp is not None):
            raise InvalidLayoutError(
                "ep", f"ep={self.ep}, etp={self.etp} but {model.family} has no experts",
                "set ep=1 and leave etp unset (dense model)")
        if model.is_moe:
            if model.num_experts % self.ep:
                raise InvalidLayoutError(
                    "ep", f"ep={self.ep} does not divide num_experts={model.num_experts} (each "
                    "ep rank holds the same number of whole experts)",
                    f"use ep in {_divisors(model.num_experts, limit=grid)}")
            if model.moe_ffn_hidden_size % self.expert_tp:
                raise InvalidLayoutError(
                    "etp", f"expert tp={self.expert_tp} does not divide moe_ffn_hidden_size="
                    f"{model.moe_ffn_hidden_size}",
                    f"use etp in {_divisors(model.moe_ffn_hidden_size, limit=self.tp)}")
        if model.num_query_groups % self.tp:
            raise InvalidLayoutError(
                "tp", f"tp={self.tp} does not divide num_query_groups={model.num_query_groups} "
                "(each tp rank must hold whole KV groups)",
                f"use tp in {_divisors(model.num_query_groups)}")
        if model.num_attention_heads % self.tp:
            raise InvalidLayoutError(
                "tp", f"tp={self.tp} does not divide num_attention_heads={model.num_attention_heads}",
                f"use tp in {_divisors(model.num_attention_heads)}")
        if model.vocab_size % self.tp:
            raise InvalidLayoutError(
                "tp", f"tp={self.tp} does not divide vocab_size={model.vocab_size}",
                f"pad the vocabulary to a multiple of {self.tp} or use tp in "
                f"{_divisors(model.vocab_size, limit=model.num_query_groups)}")
        if not model.is_moe and model.ffn_hidden_size % self.tp:
            raise InvalidLayoutError(
                "tp", f"tp={self.tp} does not divide ffn_hidden_size={model.ffn_hidden_size}",
                f"use tp in {_divisors(model.ffn_hidden_size, limit=model.num_query_groups)}")
        if self.pp > model.num_layers:
            raise InvalidLayoutError(
                "pp", f"pp={self.pp} exceeds num_layers={model.num_layers}",
                f"use pp <= {model.num_layers}, from {_divisors(model.num_layers)}")
        if model.num_layers % self.pp:
            raise InvalidLayoutError(
                "pp", f"pp={self.pp} does not divide num_layers={model.num_layers} "
                "(every pp_stage holds the same number of layers)",
                f"use pp in {_divisors(model.num_layers)}")
        return self

    # ----------------------------------------------------------------- rank arithmetic
    def sequence_parallel(self, model: Optional[ModelConfig]) -> bool:
        """Whether ``model`` runs with sequence parallelism on this layout: an MoE model with
        tp > 1 (Megatron-Core's MoELayer trains with tp > 1 only under sequence parallelism)."""
        return model is not None and model.is_moe and self.tp > 1

    def length_multiple(self, model: Optional[ModelConfig] = None) -> int:
        """What every micro-batch's sequence length must be a multiple of: 2 * cp with CP (the
        load-balanced split), times tp under sequence parallelism (each tp rank a slice)."""
        m = 2 * self.cp if self.cp > 1 else 1
        return m * self.tp if self.sequence_parallel(model) else m

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def model_parallel_size(self) -> int:
        """Ranks that together hold one replica of the model (tp * cp * pp)."""
        return self.tp * self.cp * self.pp

    def rank(self, coords: Coords) -> int:
        for axis in AXES:
            if not 0 <= getattr(coords, axis) < getattr(self, axis):
                raise ValueError(f"{axis} coordinate {getattr(coords, axis)} out of range for {self}")
        return coords.tp + self.tp * (coords.cp + self.cp * (coords.dp + self.dp * coords.pp))

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")
        tp_r = rank % self.tp
        rest = rank // self.tp
        cp_r = rest % self.cp
        rest //= self.cp
        dp_r = rest % self.dp
        pp_r = rest // self.dp
        return Coords(tp=tp_r, cp=cp_r, pp=pp_r, dp=dp_r)

    def expert_coords(self, rank: int) -> ExpertCoords:
        """Where ``rank`` sits in the expert grid (etp fastest, then ep, edp, pp)."""
        c = self.coords(rank)   # checks the range; pp is the same in both grids
        inner = rank % (self.tp * self.cp * self.dp)
        etp = self.expert_tp
        return ExpertCoords(etp=inner % etp, ep=(inner // etp) % self.ep,
                            edp=inner // (etp * self.ep), pp=c.pp)

    def expert_group_ranks(self, axis: str) -> list[list[int]]:
        """All groups of the expert grid along ``axis`` ("etp", "ep", "edp" or '-'-joined),
        each ascending: the lists Megatron's expert RankGenerator makes."""
        names = set(axis.split("-"))
        if names - set(EXPERT_AXES):
            raise ValueError(f"unknown expert axis {sorted(names - set(EXPERT_AXES))}; axes are "
                             f"{EXPERT_AXES}")
        groups: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            c = self.expert_coords(r)
            key = tuple(getattr(c, a) for a in EXPERT_AXES + ("pp",) if a not in names)
            groups.setdefault(key, []).append(r)
        return sorted(groups.values())

    def experts_of(self, ep_rank: int, num_experts: int) -> range:
        """The global expert indices ep rank ``ep_rank`` holds."""
        per = num_experts // self.ep
        return range(ep_rank * per, (ep_rank + 1) * per)

    def group_ranks(self, axis: str) -> list[list[int]]:
        """All groups along ``axis`` (or a '-'-joined set such as "dp-cp"), each ascending.

        Matches the rank lists Megatron-Core's RankGenerator produces for the same names.
        """
        names = set(axis.split("-"))
        unknown = names - set(AXES)
        if unknown:
            raise ValueError(f"unknown axis {sorted(unknown)}; axes are {AXES}")
        groups: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            key = tuple(getattr(c, a) for a in AXES if a not in names)
            groups.setdefault(key, []).append(r)
        return sorted(groups.values())

    def group_of(self, rank: int, axis: str) -> list[int]:
        for g in self.group_ranks(axis):
            if rank in g:
                return g
        raise AssertionError("unreachable: groups partition the world")

    def __str__(self) -> str:
        parts = [f"{a.upper()}{getattr(self, a)}" for a in ("ep",) + AXES if getattr(self, a) > 1]
        if self.etp is not None:
            parts.append(f"ETP{self.etp}")
        return "x".join(parts) if parts else "TP1"

    @classmethod
    def parse(cls, text: str, world_size: Optional[int] = None,
              model: Optional[ModelConfig] = None) -> "ParallelLayout":
        """Parse "tp2-pp2", "EP4xTP2", "TP2xPP2xDP2" or "tp=2,cp=1,pp=2,ep=2,etp=1"; dp inferred
        from world_size."""
        sizes: dict[str, int] = {}
        for token in text.replace("x", ",").replace("-", ",").replace("=", "").lower().split(","):
            token = token.strip()
            if not token:
                continue
            n = 3 if token.startswith("etp") else 2
            axis, num = token[:n], token[n:]
            if axis not in AXES + ("ep", "etp") or not num.isdigit():
                raise InvalidLayoutError(
                    axis, f"cannot parse {token!r} in layout {text!r}",
                    "write the layout like 'tp2-pp2', 'ep2xtp2' or 'tp=2,pp=2,dp=1'")
            sizes[axis] = int(num)
        if world_size is None:
            return cls(**sizes)
        return cls.create(world_size, model, **sizes)


def _divisors(n: int, limit: Optional[int] = None) -> list[int]:
    top = n if limit is None else min(n, limit)
    return [d for d in range(1, top + 1) if n % d == 0]


def enumerate_layouts(world_size: int, model: Optional[ModelConfig] = None, *,
                      max_tp: Optional[int] = None, max_cp: Optional[int] = None,
                      max_pp: Optional[int] = None, max_ep: Optional[int] = None,
                      expert_tp: str = "tp") -> list[ParallelLayout]:
    """Every valid layout for a world size and model, in a deterministic order.

    For a model with experts every ep that divides the experts and fits the grid is listed;
    ``expert_tp``: "tp" (etp = tp, Megatron's default), "1" (experts never tensor-split) or
    "both"."""
    if expert_tp not in ("tp", "1", "both"):
        raise ValueError(f"expert_tp={expert_tp!r}: use 'tp', '1' or 'both'")
    out = []
    divs = _divisors(world_size)
    moe = model is not None and model.is_moe
    for tp, cp, pp in itertools.product(divs, divs, divs):
        if world_size % (tp * cp * pp):
            continue
        if (max_tp and tp > max_tp) or (max_cp and cp > max_cp) or (max_pp and pp > max_pp):
            continue
        dp = world_size // (tp * cp * pp)
        eps = [e for e in divs if not max_ep or e <= max_ep] if moe else [1]
        etps = {"tp": [None], "1": [1], "both": [None, 1]}[expert_tp] if moe else [None]
        for ep, etp in itertools.product(eps, etps):
            layout = ParallelLayout(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp)
            try:
                layout.check(world_size, model)
            except InvalidLayoutError:
                continue
            out.append(layout)
    return sorted(set(out), key=_sort_key)


def _sort_key(layout: ParallelLayout) -> tuple:
    return (layout.tp, layout.cp, layout.pp, layout.dp, layout.ep, layout.expert_tp)

