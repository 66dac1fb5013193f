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

Invariant: ``sum(row.numel for row in table.full_rows)`` is the model's parameter count; the
local elements of every (layout, rank) are ``elements_on(layout, pp_rank)``.
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
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
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
    """How the HF tensors combine: "copy", "qkv" (grouped per KV group) or "fc1" ([gate; up])."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def local_numel(self, tp: int) -> int:
        return self.numel if self.split_dim is None else self.numel // tp

    def pp_stage(self, pp: int, num_layers: int) -> int:
        if self.layer is not None:
            return self.layer // (num_layers // pp)
        return 0 if self.name == EMBEDDING else pp - 1

    def local_name(self, pp: int, num_layers: int, *, te: bool = False) -> str:
        """The name its pp_stage's GPTModel gives it (layer index local to the pp_stage)."""
        name = self.te_name if te else self.name
        if self.layer is None:
            return name
        per = num_layers // pp
        return f"decoder.layers.{self.layer % per}." + _LAYER.match(name).group(2)

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

    def global_name(self, local: str, pp_rank: int, pp: int) -> str:
        """A pp_stage's parameter name (either spec) -> the row's full local-spec name."""
        m = _LAYER.match(local)
        if m:
            local = f"decoder.layers.{int(m.group(1)) + pp_rank * self.cfg.num_layers // pp}." \
                    + m.group(2)
        return self.row(local).name

    def source_of(self, local: str, pp_rank: int, pp: int) -> TensorRow:
        """The full tensor a live parameter holds (a tied output layer: the embedding)."""
        r = self.row(self.global_name(local, pp_rank, pp))
        return self.row(r.tied_to) if r.tied_to else r

    def on_pp_stage(self, pp_rank: int, pp: int) -> tuple[TensorRow, ...]:
        """Rows that are parameters of pp_stage ``pp_rank`` (tied output only if pp > 1)."""
        n = self.cfg.num_layers
        return tuple(r for r in self.rows if r.pp_stage(pp, n) == pp_rank
                     and not (r.tied_to and pp == 1))

    def elements_on(self, pp_rank: int, tp: int, pp: int) -> int:
        """Parameter elements one rank of ``pp_rank`` holds (every tp/cp/dp rank alike).
        Memoised: the selector's memory model asks for thousands of layouts per plan."""
        key = (pp_rank, tp, pp)
        if key not in self._elements:
            self._elements[key] = sum(r.local_numel(tp) for r in self.on_pp_stage(pp_rank, pp))
        return self._elements[key]

    @functools.cached_property
    def _elements(self) -> dict[tuple[int, int, int], int]:
        return {}


def _row(name, shape, split_dim, stride, layer, hf, combine, tied_to=None) -> TensorRow:
    m = _LAYER.match(name)
    te = name if not m or m.group(2) not in TE_RENAMES else \
        f"decoder.layers.{m.group(1)}." + TE_RENAMES[m.group(2)]
    return TensorRow(name, te, shape, split_dim, stride, layer, tied_to, hf, combine)


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
        rows.append(_row(m + "mlp.linear_fc1.weight", (2 * f, h), 0, 2, i,
                         (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "fc1"))
        rows.append(_row(m + "mlp.linear_fc2.weight", (h, f), 1, 1, i,
                         (p + "mlp.down_proj.weight",), "copy"))
    rows.append(_row(FINAL_NORM, (h,), None, 1, None, ("model.norm.weight",), "copy"))
    if cfg.tie_word_embeddings:
        rows.append(_row(OUTPUT, (cfg.vocab_size, h), 0, 1, None, (), "copy", tied_to=EMBEDDING))
    else:
        rows.append(_row(OUTPUT, (cfg.vocab_size, h), 0, 1, None, ("lm_head.weight",), "copy"))
    return TensorTable(cfg, tuple(rows))


def num_parameters(cfg: ModelConfig) -> int:
    """Total parameter count (a tied embedding counted once)."""
    return sum(r.numel for r in tensor_table(cfg).full_rows)
