"""The tiny model each family means in the distributed tests (one definition for every file).

    family  ModelConfig                                   what it adds to the others
    llama   ModelConfig.tiny("llama")                     (base: untied, head_dim 8 = 64 / 8)
    qwen2   tiny("qwen2", tie_word_embeddings=True)       qkv bias, tied embeddings
    qwen3   tiny("qwen3", kv_channels=12)                 q/k norms, head_dim 12 != 64 / 8
    qwen3_moe  tiny("qwen3_moe")                          4 experts of width 32, top 2

``tied`` overrides the tying (a tied Qwen3, an untied Qwen2).
"""

from __future__ import annotations

from typing import Optional

from earl_megatron.config.model import ModelConfig

_EXTRA = {"llama": {}, "qwen2": {"tie_word_embeddings": True}, "qwen3": {"kv_channels": 12},
          "qwen3_moe": {}}


def tiny_model(family: str, *, tied: Optional[bool] = None, **overrides) -> ModelConfig:
    changes = dict(_EXTRA[family])
    if tied is not None:
        changes["tie_word_embeddings"] = tied
    changes.update(overrides)
    return ModelConfig.tiny(family, **changes)
