"""The tensor table: one row per Megatron-Core tensor of a model; tensors are described only here.

Pure. Its readers: the reshard and state plans, shard/unshard and TP attributes (models/), the
HF mapping, the memory model's parameter counts and the selector's switch pricing. For the
Llama / Qwen2 / Qwen3 GPTModel (layer i)::

    local spec name (TE spec name if it differs)       split stride HF tensors (combine)
    embedding.word_embeddings.weight                      0     1   embed_tokens
    decoder.layers.i.input_layernorm.weight               -     1   input_layernorm
      (TE: decoder.layers.i.self_attention.linear_qkv.layer_norm_weight)
    decoder.layers.i.self_attention.linear_qkv.weight     0     1   q, k, v (qkv)
    decoder.layers.i.self_attention.linear_qkv.bias       0     1   q, k, v biases (Qwen2)
    decoder.layers.i.self_attention.q_layernorm.weight    -     1   q_norm (Qwen3, [head_dim])
    decoder.layers.i.self_attention.k_layernorm.weight    -     1   k_norm (Qwen3, [head_dim])
    decoder.layers.i.self_attention.linear_proj.weight    1     1   o_proj
    decoder.layers.i.pre_mlp_layernorm.weight             -     1   post_attention_layernorm
      (TE: decoder.layers.i.mlp.linear_fc1.layer_norm_weight)
    decoder.layers.i.mlp.linear_fc1.weight                0     2   gate, up (fc1)
    decoder.layers.i.mlp.linear_fc2.weight                1     1   down_proj
    decoder.final_layernorm.weight                        -     1   model.norm
    output_layer.weight                                   0     1   lm_head (untied only)

A critic (``cfg.value_head``) has its head there: ``output_layer.weight`` [1, hidden] and
``.bias`` [1], replicated (HF ``score.weight`` / ``.bias``).

For a mixture-of-experts layer (qwen3_moe: every layer) the two MLP rows are replaced by the
router and, for each expert e = 0..E-1 (global index; TE grouped-GEMM name in brackets)::

    decoder.layers.i.mlp.router.weight                    -     1   mlp.gate ([E, hidden])
    decoder.layers.i.mlp.experts.local_experts.e.linear_fc1.weight   0  2   experts.e.gate, up
      (TE: decoder.layers.i.mlp.experts.linear_fc1.weight<e>)
    decoder.layers.i.mlp.experts.local_experts.e.linear_fc2.weight   1  1   experts.e.down_proj
      (TE: decoder.layers.i.mlp.experts.linear_fc2.weight<e>)

- Expert rows (``TensorRow.expert`` set) are split over the expert grid, not the dense one: ep
  rank ``e // (E / ep)`` holds expert e under the local index ``e % (E / ep)``, tensor-split
  ``etp`` ways by its expert-TP rank (plan/layout.py ``expert_coords``); every other row ignores
  ep. The router is replicated on every rank, like a norm.

- TransformerEngine fuses the two pre-norms into linear_qkv / linear_fc1 (``layer_norm_weight``);
  the tensor, its shape and its placement are the same, so a TE name and a local name of one row
  describe the same bytes and switch and convert alike (``TensorTable.row`` accepts either).
  The q/k norms (``qk_layernorm``) keep their names in both specs: one [head_dim] weight shared
  by every head, replicated on every tp rank (Megatron's finalize_model_grads sums their grads
  over tp, since each rank's heads contribute a part).
- qkv rows are grouped per KV group ``[q heads of g | k_g | v_g]``, so a contiguous dim-0 TP
  split hands each tp rank whole groups; SwiGLU fc1 is ``[gate; up]`` with partition stride 2:
  tp rank r holds ``[gate_r; up_r]``.
- pp: a layer's rows live on pp_stage ``layer // (num_layers / pp)`` under the local name with
  index ``layer % (num_layers / pp)``; the embedding on pp_stage 0; final norm and output layer
  on the last. Tied embeddings: the output row is ``tied_to`` the embedding (no HF tensor of its
  own). With pp == 1 it is the embedding itself (no parameter); with pp > 1 the last pp_stage
  holds a replica under ``output_layer.weight`` that Megatron keeps equal.

With LoRA (``cfg.lora.enabled``, models/lora.py) each targeted linear of each layer (not an
expert's) is followed by its adapter's two rows, split like the base row they are derived from
(``_adapter_rows``; no HF tensor, ``combine`` "lora")::

    decoder.layers.i.<path>.linear_qkv.lora_a  [r, in]    -     1   (column-parallel: A whole)
    decoder.layers.i.<path>.linear_qkv.lora_b  [out, r]   0     s   (B's rows split as the base's)
    decoder.layers.i.<path>.linear_proj.lora_a [r, in]    1     1   (row-parallel: A's columns)
    decoder.layers.i.<path>.linear_proj.lora_b [out, r]   -     1   (B whole)

  and the wrapped base's live names ``<linear>.base.weight`` / ``.base.bias`` are aliases of the
  base rows (``TensorTable.row`` accepts them): a LoRA model switches like any other.

Invariant: ``sum(row.numel for row in table.full_rows)`` is the model's parameter count; the
local elements of every (layout, rank) are ``elements_on(pp_rank, tp, pp, ep, etp)``, and
``held_on(layout, rank)`` are the rows that rank's model has as parameters.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Optional

from earl_megatron.config.model import ModelConfig

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
VALUE_BIAS = "output_layer.bias"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(?:local_experts\.(\d+)\.(linear_fc[12]\.weight)|"
                     r"(linear_fc[12]\.weight)(\d+))$")
# The TE spec's names for the local spec's two pre-norms (the same rename Megatron's local spec
# declares in ``sharded_state_dict_keys_map`` so that checkpoints of both specs agree).
TE_RENAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
              "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


@dataclass(frozen=True)
class TensorRow:
    """One full (unsharded) tensor of the model."""

    name: str
    """Local-spec name with the global layer index (the plan's and the HF mapping's key)."""
    te_name: str
    """The TransformerEngine spec's name of the same tensor."""
    shape: tuple[int, ...]
    split_dim: Optional[int]
    """TP split dim; None: replicated on every tp rank (norms)."""
    stride: int
    """Partition stride: 2 for SwiGLU fc1 ([gate_r; up_r] per tp rank), else 1."""
    layer: Optional[int]
    """Global layer index; None for the embedding, final norm and output layer."""
    tied_to: Optional[str]
    """The row whose values this one holds (tied output layer -> embedding), else None."""
    hf: tuple[str, ...]
    """HF tensors it is built from ((q, k, v), (gate, up) or one); () when tied."""
    combine: str
    """How the HF tensors combine: "copy", "qkv" (grouped per KV group) or "fc1" ([gate; up]);
    "lora" for an adapter's A or B (no HF tensor: ``adapter``)."""
    expert: Optional[int] = None
    """Global expert index of an expert's fc1 / fc2 (split over the expert grid); else None."""

    @property
    def adapter(self) -> bool:
        """A LoRA adapter's A or B: a parameter of the model with no HF tensor."""
        return self.combine == "lora"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def local_numel(self, tp: int) -> int:
        return self.numel if self.split_dim is None else self.numel // tp

    def tp_of(self, layout) -> int:
        """The tensor-parallel size that splits this row in ``layout`` (etp for experts)."""
        return layout.expert_tp if self.expert is not None else layout.tp

    def tp_rank_of(self, layout, rank: int) -> int:
        """``rank``'s coordinate along that axis."""
        return layout.expert_coords(rank).etp if self.expert is not None \
            else layout.coords(rank).tp

    def local_rows(self, layout, rank: int) -> tuple[tuple[int, int], ...]:
        """``tp_rows`` for ``rank`` of ``layout``, along the axis that splits this row."""
        return self.tp_rows(self.tp_rank_of(layout, rank), self.tp_of(layout))

    def pp_stage(self, pp: int, num_layers: int) -> int:
        if self.layer is not None:
            return self.layer // (num_layers // pp)
        return 0 if self.name == EMBEDDING else pp - 1

    def local_name(self, pp: int, num_layers: int, *, te: bool = False, ep: int = 1,
                   num_experts: Optional[int] = None) -> str:
        """The name its pp_stage's GPTModel gives it (layer index local to the pp_stage; an
        expert's index local to its ep rank)."""
        name = self.te_name if te else self.name
        if self.layer is None:
            return name
        per = num_layers // pp
        name = f"decoder.layers.{self.layer % per}." + _LAYER.match(name).group(2)
        if self.expert is not None and ep > 1:
            local = self.expert % (num_experts // ep)
            m = _EXPERT.match(name)
            name = f"{m.group(1)}local_experts.{local}.{m.group(3)}" if m.group(2) is not None \
                else f"{m.group(1)}{m.group(4)}{local}"
        return name

    def tp_rows(self, tp_rank: int, tp: int) -> tuple[tuple[int, int], ...]:
        """Row ranges [start, stop) along ``split_dim`` (dim 0 if replicated) that tp rank
        ``tp_rank`` holds, in local order (their concatenation is its local tensor)."""
        dim = 0 if self.split_dim is None else self.split_dim
        n = self.shape[dim]
        if self.split_dim is None or tp == 1:
            return ((0, n),)
        part = n // self.stride
        per = part // tp
        return tuple((k * part + tp_rank * per, k * part + (tp_rank + 1) * per)
                     for k in range(self.stride))


@dataclass(frozen=True)
class TensorTable:
    cfg: ModelConfig
    rows: tuple[TensorRow, ...]
    """In model order (the order Megatron builds them; deterministic weights draw in it)."""

    @functools.cached_property
    def _by_name(self) -> dict[str, TensorRow]:
        out = {r.name: r for r in self.rows}
        out.update({r.te_name: r for r in self.rows})
        for r in self.rows:   # LoraLinear keeps the base linear as ``<linear>.base``
            if r.name.endswith(".lora_a"):
                linear = r.name[:-len(".lora_a")]
                out.update({f"{linear}.base.{k}": out[f"{linear}.{k}"] for k in ("weight", "bias")
                            if f"{linear}.{k}" in out})
        return out

    @property
    def full_rows(self) -> tuple[TensorRow, ...]:
        """The distinct tensors (a tied output layer is the embedding: left out)."""
        return tuple(r for r in self.rows if r.tied_to is None)

    def row(self, name: str) -> TensorRow:
        """The row of a full name in either spec; KeyError naming the fix if unknown."""
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a tensor of this {self.cfg.family} model (local or "
                           "TransformerEngine spec); add it to plan/tensor_table.py") from None

    def global_name(self, local: str, pp_rank: int, pp: int, ep_rank: int = 0,
                    ep: int = 1) -> str:
        """A rank's parameter name (either spec) -> the row's full local-spec name (global layer
        index; for an expert, the global expert index of ep rank ``ep_rank``'s local one)."""
        m = _LAYER.match(local)
        if m:
            local = f"decoder.layers.{int(m.group(1)) + pp_rank * self.cfg.num_layers // pp}." \
                    + m.group(2)
        e = _EXPERT.match(local)
        if e:
            per = (self.cfg.num_experts or 1) // ep
            idx = int(e.group(2) if e.group(2) is not None else e.group(5)) + ep_rank * per
            local = f"{e.group(1)}local_experts.{idx}.{e.group(3) or e.group(4)}"
        return self.row(local).name

    def name_on(self, row: TensorRow, layout, *, te: bool = False) -> str:
        """The parameter name ``row`` has on the ranks of ``layout`` that hold it."""
        return row.local_name(layout.pp, self.cfg.num_layers, te=te, ep=layout.ep,
                              num_experts=self.cfg.num_experts)

    def global_name_on(self, local: str, layout, rank: int) -> str:
        """``global_name`` for a parameter of ``rank`` in ``layout``."""
        return self.global_name(local, layout.coords(rank).pp, layout.pp,
                                layout.expert_coords(rank).ep, layout.ep)

    def source_of(self, local: str, pp_rank: int, pp: int, ep_rank: int = 0,
                  ep: int = 1) -> TensorRow:
        """The full tensor a live parameter holds (a tied output layer: the embedding)."""
        r = self.row(self.global_name(local, pp_rank, pp, ep_rank, ep))
        return self.row(r.tied_to) if r.tied_to else r

    def source_on(self, local: str, layout, rank: int) -> TensorRow:
        """``source_of`` for a parameter of ``rank`` in ``layout``."""
        r = self.row(self.global_name_on(local, layout, rank))
        return self.row(r.tied_to) if r.tied_to else r

    def on_pp_stage(self, pp_rank: int, pp: int) -> tuple[TensorRow, ...]:
        """Rows that are parameters of pp_stage ``pp_rank`` (tied output only if pp > 1), every
        expert included: ``held_on`` is one rank's subset. Memoised (an MoE table has ~10^4
        rows and the selector asks per layout)."""
        key = (pp_rank, pp)
        if key not in self._stages:
            n = self.cfg.num_layers
            self._stages[key] = tuple(r for r in self.rows if r.pp_stage(pp, n) == pp_rank
                                      and not (r.tied_to and pp == 1))
        return self._stages[key]

    def held_on(self, layout, rank: int) -> tuple[TensorRow, ...]:
        """Rows that are parameters of ``rank``'s model in ``layout`` (its pp_stage's, and of
        the experts only its ep rank's)."""
        c = layout.coords(rank)
        if not self.cfg.is_moe:
            return self.on_pp_stage(c.pp, layout.pp)
        mine = layout.experts_of(layout.expert_coords(rank).ep, self.cfg.num_experts)
        return tuple(r for r in self.on_pp_stage(c.pp, layout.pp)
                     if r.expert is None or r.expert in mine)

    def elements_on(self, pp_rank: int, tp: int, pp: int, ep: int = 1,
                    etp: Optional[int] = None) -> int:
        """Parameter elements one rank of ``pp_rank`` holds (every tp/cp/dp/ep rank alike: an
        ep rank holds E / ep experts, each split ``etp`` ways, default tp).
        Memoised: the selector's memory model asks for thousands of layouts per plan."""
        key = (pp_rank, tp, pp, ep, etp := tp if etp is None else etp)
        if key not in self._elements:
            self._elements[key] = int(round(sum(
                r.local_numel(tp) if r.expert is None else r.local_numel(etp) / ep
                for r in self.on_pp_stage(pp_rank, pp))))
        return self._elements[key]

    def expert_elements(self) -> int:
        """Elements of every expert's fc1 and fc2 (the part of the model EP divides)."""
        return sum(r.numel for r in self.rows if r.expert is not None)

    def active_elements(self) -> int:
        """Elements one token's forward reads: the dense rows plus top-k of E experts."""
        cfg = self.cfg
        dense = sum(r.numel for r in self.full_rows if r.expert is None)
        if not cfg.is_moe:
            return dense
        return dense + self.expert_elements() * cfg.moe_router_topk // cfg.num_experts

    _elements = functools.cached_property(lambda self: {})
    _stages = functools.cached_property(lambda self: {})


def _row(name, shape, split_dim, stride, layer, hf, combine, tied_to=None,
         expert=None) -> TensorRow:
    m = _LAYER.match(name)
    te = name if not m or m.group(2) not in TE_RENAMES else \
        f"decoder.layers.{m.group(1)}." + TE_RENAMES[m.group(2)]
    if expert is not None:   # TEGroupedMLP: one parameter per expert, index suffixed
        e = _EXPERT.match(name)
        te = f"{e.group(1)}{e.group(3)}{e.group(2)}"
    return TensorRow(name, te, shape, split_dim, stride, layer, tied_to, hf, combine, expert)


@functools.lru_cache(maxsize=64)
def tensor_table(cfg: ModelConfig) -> TensorTable:
    """Every tensor of ``cfg``'s GPTModel (Megatron-Core 0.16, RMSNorm, SwiGLU, no linear
    biases except the optional qkv bias, optional per-head q/k norms). Cached: a ModelConfig is a frozen value."""
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    q = cfg.num_attention_heads * d
    qkv = q + 2 * cfg.num_query_groups * d
    rows = [_row(EMBEDDING, (cfg.vocab_size, h), 0, 1, None, ("model.embed_tokens.weight",),
                 "copy")]
    for i in range(cfg.num_layers):
        m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = p + "self_attn."
        rows.append(_row(m + "input_layernorm.weight", (h,), None, 1, i,
                         (p + "input_layernorm.weight",), "copy"))
        rows.append(_row(m + "self_attention.linear_qkv.weight", (qkv, h), 0, 1, i,
                         tuple(f"{attn}{x}_proj.weight" for x in "qkv"), "qkv"))
        if cfg.add_qkv_bias:
            rows.append(_row(m + "self_attention.linear_qkv.bias", (qkv,), 0, 1, i,
                             tuple(f"{attn}{x}_proj.bias" for x in "qkv"), "qkv"))
        if cfg.qk_layernorm:
            for x in "qk":
                rows.append(_row(f"{m}self_attention.{x}_layernorm.weight", (d,), None, 1, i,
                                 (f"{attn}{x}_norm.weight",), "copy"))
        rows.append(_row(m + "self_attention.linear_proj.weight", (h, q), 1, 1, i,
                         (attn + "o_proj.weight",), "copy"))
        rows.append(_row(m + "pre_mlp_layernorm.weight", (h,), None, 1, i,
                         (p + "post_attention_layernorm.weight",), "copy"))
        if cfg.is_moe:
            rows.extend(_moe_rows(cfg, i))
            continue
        rows.append(_row(m + "mlp.linear_fc1.weight", (2 * f, h), 0, 2, i,
                         (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "fc1"))
        rows.append(_row(m + "mlp.linear_fc2.weight", (h, f), 1, 1, i,
                         (p + "mlp.down_proj.weight",), "copy"))
    if cfg.lora.enabled:
        rows = _with_adapters(rows, cfg.lora.rank, cfg.lora.targets)
    rows.append(_row(FINAL_NORM, (h,), None, 1, None, ("model.norm.weight",), "copy"))
    if cfg.value_head:   # a critic's head (models/value_model.py): whole on every tp rank
        rows += [_row(OUTPUT, (1, h), None, 1, None, ("score.weight",), "copy"),
                 _row(VALUE_BIAS, (1,), None, 1, None, ("score.bias",), "copy")]
    else:
        rows.append(_row(OUTPUT, (cfg.vocab_size, h), 0, 1, None, () if cfg.tie_word_embeddings
                         else ("lm_head.weight",), "copy",
                         tied_to=EMBEDDING if cfg.tie_word_embeddings else None))
    return TensorTable(cfg, tuple(rows))


def _adapter_rows(base: TensorRow, rank: int) -> tuple[TensorRow, TensorRow]:
    """A [r, in] and B [out, r] of the adapter on ``base`` (a linear's weight row), split as
    models/lora.py does: the factor that keeps the base's split dim takes its split and stride
    (column: B's rows, fc1's stride 2; row: A's columns), the other is whole on every tp rank."""
    linear, (out, inp), column = base.name[:-len(".weight")], base.shape, base.split_dim == 0

    def adapter(which: str, shape: tuple[int, int], split: bool) -> TensorRow:
        n = f"{linear}.{which}"
        return TensorRow(n, n, shape, base.split_dim if split else None,
                         base.stride if split else 1, base.layer, None, (), "lora")
    return adapter("lora_a", (rank, inp), not column), adapter("lora_b", (out, rank), column)


def _with_adapters(rows: list[TensorRow], rank: int, targets: tuple[str, ...]
                   ) -> list[TensorRow]:
    """``rows`` with each targeted dense linear's adapter after its weight (and bias), the order
    LoraLinear registers them in."""
    out, pending = [], []
    for row in rows:
        if pending and not row.name.startswith(pending[0].name.rsplit(".", 1)[0] + "."):
            out.extend(pending)
            pending = []
        out.append(row)
        if row.expert is None and row.layer is not None and row.name.endswith(".weight") \
                and row.name.rsplit(".", 2)[-2] in targets:
            pending = list(_adapter_rows(row, rank))
    return out + pending


def _moe_rows(cfg: ModelConfig, i: int) -> list[TensorRow]:
    """Layer i's router and experts, in the order Megatron's MoELayer builds them."""
    h, mf = cfg.hidden_size, cfg.moe_ffn_hidden_size
    m, p = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
    rows = [_row(m + "router.weight", (cfg.num_experts, h), None, 1, i, (p + "gate.weight",),
                 "copy")]
    for e in range(cfg.num_experts):
        x, hx = f"{m}experts.local_experts.{e}.", f"{p}experts.{e}."
        rows.append(_row(x + "linear_fc1.weight", (2 * mf, h), 0, 2, i,
                         (hx + "gate_proj.weight", hx + "up_proj.weight"), "fc1", expert=e))
        rows.append(_row(x + "linear_fc2.weight", (h, mf), 1, 1, i, (hx + "down_proj.weight",),
                         "copy", expert=e))
    return rows


def num_parameters(cfg: ModelConfig) -> int:
    """Total parameter count (a tied embedding counted once)."""
    return sum(r.numel for r in tensor_table(cfg).full_rows)
