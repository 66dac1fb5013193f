"""``make_rollout``: the engine of ``rollout.engine``, fed by the weight source the placement
names; it imports trainer/rollout.py and trainer/sglang_rollout.py so that neither imports the
other."""

from __future__ import annotations

import torch.distributed as dist

from earl_megatron.trainer.rollout import EmbeddedRollout, EpisodeSpec, Rollout
from earl_megatron.trainer.sglang_rollout import HandoffWeights, LocalWeights, SGLangRollout

WEIGHT_SOURCES = ("local", "handoff")


def make_rollout(engine: str, spec: EpisodeSpec, tokenizer, *, model=None, python=None,
                 device: str = "cuda", out_dir=None, mem_fraction=None,
                 kv_tokens=None, bucket_mb: float = 512.0, cluster=None, ranks=None,
                 ranks_group=None, weights: str = "local") -> Rollout:
    """The engine of ``rollout.engine`` (validated by the config). The rest serves ``sglang``
    only: ``model``, ``python``, ``device``, ``out_dir`` (SGLang's logs and start config),
    ``mem_fraction`` (the servers' --mem-fraction-static; None:
    config.train.SGLANG_MEM_FRACTION), ``kv_tokens`` (their --max-total-tokens,
    config.train.sglang_kv_tokens; None: no cap), ``cluster`` (the ClusterConfig: server
    timeouts and restarts), ``ranks``, ``ranks_group`` (the servers' ranks and their group;
    None: the world and its default group) and ``weights``, where the servers' weights come
    from: ``local`` (the policy on these ranks, pushed by ``sync`` in buckets of at most
    ``bucket_mb``: colocated placement) or ``handoff`` (``receive``, ``push_received``: split
    placement's rollout pool). The embedded engine decodes with the policy it is given, which
    is its weights under either placement."""
    if weights not in WEIGHT_SOURCES:
        raise ValueError(f"make_rollout(weights={weights!r}): use local (colocated: the policy "
                         "on the servers' ranks) or handoff (split: the train pool's handoff)")
    if engine == "embedded":
        return EmbeddedRollout(spec, tokenizer)
    if engine == "sglang":
        if weights == "handoff" and ranks is None:
            raise ValueError("make_rollout('sglang', weights='handoff'): give ranks= and "
                             "ranks_group=, the rollout pool the servers run on")
        source = (LocalWeights(int(bucket_mb * 2**20)) if weights == "local"
                  else HandoffWeights())
        return SGLangRollout(spec, tokenizer, model, python=python, device=device,
                             out_dir=out_dir, mem_fraction=mem_fraction, kv_tokens=kv_tokens,
                             cluster=cluster, source=source,
                             ranks=range(dist.get_world_size()) if ranks is None else ranks,
                             ranks_group=ranks_group)
    raise ValueError(f"rollout.engine={engine!r}: use embedded or sglang")
