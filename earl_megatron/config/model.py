"""Model architecture config for the Llama / Qwen2 / Qwen3 / Qwen3-MoE family: one frozen value,
no torch.

``ModelConfig`` describes a decoder-only transformer with RMSNorm, SwiGLU, rotary embeddings and
grouped-query attention, optionally with a qkv bias (Qwen2), RMSNorm on queries and keys per head
(Qwen3, Megatron-Core's ``qk_layernorm``) and tied embeddings. It is the one
model value every layer uses: layouts are checked against it (plan/layout.py), its tensors are
listed from it (plan/tensor_table.py, which also counts its parameters) and models/provider.py
turns it into Megatron-Core's TransformerConfig.
Invariants: every count (layers, sizes, heads, groups, vocab, positions) is >= 1 and every float
finite and > 0, checked before any division by them (config/checks.py: one ``ConfigError``
naming ``model.<key>``); ``num_attention_heads % num_query_groups == 0``;
``kv_channels`` defaults to ``hidden_size // num_attention_heads`` (Qwen3 sets it: its head_dim
is independent of hidden_size / heads); ``add_qkv_bias`` and ``qk_layernorm`` left None take the
family's value (qwen2: bias; qwen3 and qwen3_moe: q/k norms), so ``model.family=qwen3`` alone
switches a recipe.

Mixture of experts (``family="qwen3_moe"``, HF ``Qwen3MoeForCausalLM``): every layer's MLP is
``num_experts`` SwiGLU experts of width ``moe_ffn_hidden_size`` behind a top-k router
(``moe_router_topk``: softmax over all experts, top k, renormalised when ``moe_norm_topk_prob``,
as Qwen3-MoE does), no shared experts, with Switch-style auxiliary load-balancing loss
(``moe_aux_loss_coeff``). A qwen3_moe config must set ``num_experts`` (>= 2) and
``moe_ffn_hidden_size``; a dense family must leave ``num_experts`` None. ``ffn_hidden_size`` is
kept (HF ``intermediate_size``) but no tensor of an all-MoE model has that width.

Starting from a checkpoint (``run.init``): its config is the model; a field set on the command
line must equal the checkpoint's (floats within a relative 1e-6, so a typed ``1e-5`` matches a
stored float32 ``9.999999747378752e-06``) unless it is one of ``INIT_MAY_DIFFER``, which only
change how the same weights run (config/conversion.py ``init_model``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from earl_megatron.config.checks import ConfigError, at_least, require_finite
from earl_megatron.config.lora import LoraSpec

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
# What each family's HF architecture always has (the values None resolves to).
FAMILY_FEATURES = {"llama": {"add_qkv_bias": False, "qk_layernorm": False},
                   "qwen2": {"add_qkv_bias": True, "qk_layernorm": False},
                   "qwen3": {"add_qkv_bias": False, "qk_layernorm": True},
                   "qwen3_moe": {"add_qkv_bias": False, "qk_layernorm": True}}
MOE_FAMILIES = ("qwen3_moe",)
INIT_MAY_DIFFER = ("max_position_embeddings",)
"""Fields a run may set apart from its ``run.init`` checkpoint. max_position_embeddings: rotary
embeddings have no learned positions, so the value only bounds the run's contexts (the rollout's
default cap, the warm start's sequences); a shorter one caps them, a longer one extrapolates.
Every other field fixes a tensor's shape, what the weights compute, or (params_dtype) the dtype
the checkpoint's weights are built in, and must match."""


@dataclass(frozen=True)
class ModelConfig:
    family: str = "llama"
    """Architecture family: "llama" (no qkv bias), "qwen2" (qkv bias) or "qwen3" (q/k norms)."""
    num_layers: int = 4
    """Transformer layers (HF ``num_hidden_layers``); pp must divide it."""
    hidden_size: int = 64
    """Width of the residual stream (HF ``hidden_size``)."""
    ffn_hidden_size: int = 128
    """Width of the dense SwiGLU MLP (HF ``intermediate_size``); tp must divide it."""
    num_attention_heads: int = 8
    """Query heads (HF ``num_attention_heads``)."""
    num_query_groups: int = 4
    """Number of KV heads (GQA); equal to num_attention_heads for plain multi-head attention."""
    vocab_size: int = 128
    """Token ids the embedding and the output layer cover (HF ``vocab_size``); tp must divide
    it."""
    kv_channels: Optional[int] = None
    """Head dim (HF ``head_dim``); None means hidden_size // num_attention_heads, and that value
    given explicitly is stored as None (one spelling: a recipe and a checkpoint compare equal)."""
    max_position_embeddings: int = 4096
    """Longest sequence the model takes (prompt and every turn of an episode); it bounds
    rollout.max_context_tokens."""
    rotary_base: float = 10000.0
    """RoPE base (HF ``rope_theta``)."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon (HF ``rms_norm_eps``)."""
    add_qkv_bias: Optional[bool] = None
    """Bias on the q/k/v projections; None: the family's (True for qwen2 only)."""
    qk_layernorm: Optional[bool] = None
    """RMSNorm over each query and key head (weights of shape [head_dim]) before rotary;
    None: the family's (True for qwen3 only)."""
    tie_word_embeddings: bool = False
    """The output layer reuses the word embedding (HF ``tie_word_embeddings``)."""
    params_dtype: str = "float32"
    """"float32" or "bfloat16"."""
    num_experts: Optional[int] = None
    """Routed experts per layer (qwen3_moe only; HF ``num_experts``); None: a dense model."""
    moe_ffn_hidden_size: Optional[int] = None
    """Each expert's SwiGLU width (HF ``moe_intermediate_size``)."""
    moe_router_topk: int = 2
    """Experts each token is routed to (HF ``num_experts_per_tok``)."""
    moe_norm_topk_prob: bool = True
    """Renormalise the top-k routing probabilities to sum to 1 (HF ``norm_topk_prob``)."""
    moe_aux_loss_coeff: float = 0.001
    """Weight of the auxiliary load-balancing loss in training (HF ``router_aux_loss_coef``);
    0 turns it off."""
    lora: LoraSpec = field(default_factory=LoraSpec)
    """Low-rank adapters (config/lora.py, docs/lora.md): ``lora.rank`` 0 (default) trains every
    parameter; r >= 1 trains rank-r adapters on ``lora.targets`` over a frozen base."""
    value_head: bool = field(default=False, metadata={
        "internal": "the critic's (algorithm.name=ppo builds one beside the policy)"})
    """PPO's critic (models/value_model.py ``critic_config``; never a policy's): a scalar value
    head in place of the output layer, so the tensor table's output rows are the head's
    [1, hidden] weight and [1] bias, replicated on the last pp_stage, and build_on_layout puts
    the head in: the critic switches layouts like the policy."""

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ConfigError(f"model.family={self.family!r} is not a known family; supported: "
                              f"{FAMILIES}")
        if isinstance(self.lora, dict):   # a checkpoint's earl_model_config.json holds a mapping
            object.__setattr__(self, "lora", LoraSpec(**self.lora))
        require_finite(self, "model")
        at_least(self, "model", 1, "num_layers", "hidden_size", "ffn_hidden_size",
                 "num_attention_heads", "num_query_groups", "vocab_size",
                 "max_position_embeddings", "kv_channels", "moe_ffn_hidden_size",
                 "moe_router_topk")
        self._check_moe()
        if self.value_head and (self.tie_word_embeddings or self.lora.enabled):
            raise ConfigError("model.value_head (a critic) is built untied and without adapters")
        expert_targets = sorted({"linear_fc1", "linear_fc2"} & set(self.lora.targets))
        if self.is_moe and self.lora.enabled and expert_targets:
            raise ConfigError(f"model.lora.targets={list(self.lora.targets)} on model.family="
                              f"{self.family}: {expert_targets} are the experts' linears, which "
                              "LoRA does not adapt yet (issue #46); use model.lora.targets="
                              "[linear_qkv,linear_proj]")
        for key in ("rotary_base", "norm_epsilon"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"model.{key}={getattr(self, key)} must be > 0")
        # None -> the family's value, stored as a bool (equality and hashing see the resolved value)
        for key, value in FAMILY_FEATURES[self.family].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        if self.kv_channels is not None and \
                self.kv_channels * self.num_attention_heads == self.hidden_size:
            object.__setattr__(self, "kv_channels", None)
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(f"model.num_attention_heads={self.num_attention_heads} must be a "
                              f"multiple of model.num_query_groups={self.num_query_groups}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"model.hidden_size={self.hidden_size} must divide by "
                              f"model.num_attention_heads={self.num_attention_heads} (or set "
                              "model.kv_channels)")
        if self.params_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"model.params_dtype={self.params_dtype!r}: use float32, bfloat16 "
                              "or float16")

    def _check_moe(self) -> None:
        if self.family not in MOE_FAMILIES:
            if self.num_experts is not None:
                raise ConfigError(f"model.num_experts={self.num_experts} but model.family="
                                  f"{self.family!r} is dense; use model.family=qwen3_moe or "
                                  "leave num_experts null")
            return
        if self.num_experts is None or self.num_experts < 2:
            raise ConfigError(f"model.family={self.family} needs model.num_experts >= 2 (got "
                              f"{self.num_experts})")
        if self.moe_ffn_hidden_size is None:
            raise ConfigError(f"model.family={self.family} needs model.moe_ffn_hidden_size "
                              "(HF moe_intermediate_size)")
        if self.moe_router_topk > self.num_experts:
            raise ConfigError(f"model.moe_router_topk={self.moe_router_topk} exceeds "
                              f"model.num_experts={self.num_experts}")
        if self.moe_aux_loss_coeff < 0:
            raise ConfigError(f"model.moe_aux_loss_coeff={self.moe_aux_loss_coeff} must be >= 0")

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def base(self) -> "ModelConfig":
        """This model without adapters: what a LoRA run's frozen base and KL reference are."""
        return replace(self, lora=LoraSpec()) if self.lora.enabled else self

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def with_(self, **changes) -> "ModelConfig":
        """A copy with ``changes``; the family's features are already resolved here, so a new
        ``family`` keeps this config's add_qkv_bias / qk_layernorm unless given as None."""
        return replace(self, **changes)

    @classmethod
    def tiny(cls, family: str = "llama", **overrides) -> "ModelConfig":
        """The test/demo model: 4 layers, d=64, 8 heads, 4 KV groups, vocab 128 (~0.2M params),
        with the family's qkv bias / q-k norms; qwen3_moe: 4 experts of width 32, top 2."""
        if family in MOE_FAMILIES:
            overrides = {"num_experts": 4, "moe_ffn_hidden_size": 32, "moe_router_topk": 2,
                         **overrides}
        return cls(family=family, **overrides)
