"""Reference weights edited so chosen tokens win whatever the context (tests and benchmarks).

Residual dim 0 carries 50.0 from the embedding through every layer (no attention or MLP writes
it) and the output layer reads only that dim, so token ``t`` gets logit ``50 * favour[t]`` and
every other token 0: a deterministic, context-free policy on a real Megatron-Core model.
"""

from __future__ import annotations


def biased_weights(cfg, favour: dict[int, float], seed: int = 11):
    from earl_megatron.models.sharding import reference_weights

    w = reference_weights(cfg, seed=seed)
    w["embedding.word_embeddings.weight"][:, 0] = 50.0
    for i in range(cfg.num_layers):
        w[f"decoder.layers.{i}.self_attention.linear_proj.weight"][0, :] = 0.0
        w[f"decoder.layers.{i}.mlp.linear_fc2.weight"][0, :] = 0.0
    w["output_layer.weight"][:, 0] = 0.0
    for tok, weight in favour.items():
        w["output_layer.weight"][tok, 0] = weight
    return w
