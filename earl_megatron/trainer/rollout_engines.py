"""``make_rollout``: the engine of ``rollout.engine``; it imports trainer/rollout.py and
trainer/sglang_rollout.py so that neither imports the other."""

from __future__ import annotations

from earl_megatron.trainer.rollout import EmbeddedRollout, EpisodeSpec, Rollout
from earl_megatron.trainer.sglang_rollout import SGLangRollout


def make_rollout(engine: str, spec: EpisodeSpec, tokenizer, *, model=None, python=None,
                 device: str = "cuda", out_dir=None, mem_fraction=None,
                 kv_tokens=None, bucket_mb: float = 512.0, cluster=None, ranks=None,
                 ranks_group=None) -> Rollout:
    """The engine of ``rollout.engine`` (validated by the config); ``model``, ``python``,
    ``device``, ``out_dir`` (SGLang's logs and start config), ``mem_fraction`` (the servers'
    --mem-fraction-static; None: config.train.SGLANG_MEM_FRACTION), ``kv_tokens`` (their
    --max-total-tokens, config.train.sglang_kv_tokens; None: no cap), ``bucket_mb``
    (weight-sync buckets), ``cluster`` (the ClusterConfig: server timeouts and restarts) and
    ``ranks``, ``ranks_group`` (split placement: the rollout pool the servers run on) serve
    ``sglang`` only."""
    if engine == "embedded":
        return EmbeddedRollout(spec, tokenizer)
    if engine == "sglang":
        return SGLangRollout(spec, tokenizer, model, python=python, device=device,
                             out_dir=out_dir, mem_fraction=mem_fraction, kv_tokens=kv_tokens,
                             bucket_bytes=int(bucket_mb * 2**20), cluster=cluster,
                             ranks=ranks, ranks_group=ranks_group)
    raise ValueError(f"rollout.engine={engine!r}: use embedded or sglang")
