"""Named model architectures for planning (shapes only; no weights are loaded).

Values copied from each model's published Hugging Face ``config.json``; the checksum for a reader
is the parameter count in each comment (``tensor_table.num_parameters``, asserted in tests).
Invariant: every preset is a valid ``ModelConfig`` in bfloat16.
"""

from __future__ import annotations

from earl_megatron.config.model import ModelConfig

PRESETS: dict[str, ModelConfig] = {
    # Qwen/Qwen2.5-7B: 7,615,616,512 parameters.
    "qwen2.5-7b": ModelConfig(
        family="qwen2", num_layers=28, hidden_size=3584, ffn_hidden_size=18944,
        num_attention_heads=28, num_query_groups=4, vocab_size=152064,
        max_position_embeddings=131072, rotary_base=1e6, norm_epsilon=1e-6, add_qkv_bias=True,
        tie_word_embeddings=False, params_dtype="bfloat16"),
    # Qwen/Qwen2.5-72B: 72,706,203,648 parameters.
    "qwen2.5-72b": ModelConfig(
        family="qwen2", num_layers=80, hidden_size=8192, ffn_hidden_size=29568,
        num_attention_heads=64, num_query_groups=8, vocab_size=152064,
        max_position_embeddings=131072, rotary_base=1e6, norm_epsilon=1e-5, add_qkv_bias=True,
        tie_word_embeddings=False, params_dtype="bfloat16"),
    # meta-llama/Meta-Llama-3-8B: 8,030,261,248 parameters.
    "llama3-8b": ModelConfig(
        family="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
        num_attention_heads=32, num_query_groups=8, vocab_size=128256,
        max_position_embeddings=8192, rotary_base=500000.0, norm_epsilon=1e-5,
        add_qkv_bias=False, tie_word_embeddings=False, params_dtype="bfloat16"),
    # Qwen/Qwen3-8B: 8,190,735,360 parameters (q/k norms; head_dim 128 given explicitly).
    "qwen3-8b": ModelConfig(
        family="qwen3", num_layers=36, hidden_size=4096, ffn_hidden_size=12288,
        num_attention_heads=32, num_query_groups=8, kv_channels=128, vocab_size=151936,
        max_position_embeddings=40960, rotary_base=1e6, norm_epsilon=1e-6,
        tie_word_embeddings=False, params_dtype="bfloat16"),
    # Qwen/Qwen3-30B-A3B: 30,532,122,624 parameters, 3,353,032,704 active per token (128 experts
    # of width 768 in each of 48 layers, top 8; q/k norms; head_dim 128).
    "qwen3-30b-a3b": ModelConfig(
        family="qwen3_moe", num_layers=48, hidden_size=2048, ffn_hidden_size=6144,
        num_attention_heads=32, num_query_groups=4, kv_channels=128, vocab_size=151936,
        max_position_embeddings=40960, rotary_base=1e6, norm_epsilon=1e-6,
        tie_word_embeddings=False, params_dtype="bfloat16", num_experts=128,
        moe_ffn_hidden_size=768, moe_router_topk=8, moe_norm_topk_prob=True,
        moe_aux_loss_coeff=0.001),
    # The repository's test model (ModelConfig.tiny): 164,416 parameters.
    "tiny": ModelConfig.tiny(),
}


def get_preset(name: str) -> ModelConfig:
    """The preset called ``name`` (case-insensitive); a KeyError lists the known names."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known presets: "
                       f"{', '.join(sorted(PRESETS))}") from None
