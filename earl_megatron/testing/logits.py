"""Full-vocabulary logits of a model on a layout, through Megatron-Core's own schedule (tests).

``megatron_logits(on_layout, tokens)`` runs one forward-only micro-batch with
``get_forward_backward_func`` and returns ``(positions, logits [b, s_local, vocab])`` on the last
pp_stage's tp rank 0 and None elsewhere: tp shards gathered, with cp > 1 this rank's zigzag
positions of the sequence (models/cp_attention.py), so callers compare with transformers'
logits at those positions.
"""

from __future__ import annotations

import torch


def megatron_logits(on_layout, tokens: torch.Tensor):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from earl_megatron.models.cp_attention import zigzag_positions

    pos = zigzag_positions(tokens.shape[1], on_layout.layout.cp, on_layout.coords.cp)
    local = tokens[:, pos]
    position_ids = pos.unsqueeze(0).expand_as(local)

    def forward_step(data_iterator, model):
        out = model(next(data_iterator), position_ids, None)

        def loss_func(logits):
            full = gather_from_tensor_model_parallel_region(logits)
            return logits.sum() * 0.0, torch.tensor(1), {"logits": full.detach().clone()}

        return out, loss_func

    on_layout.tcfg.finalize_model_grads_func = None
    res = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([local]), model=[on_layout.model],
        num_microbatches=1, seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0],
        forward_only=True)
    if on_layout.post_process and on_layout.coords.tp == 0:
        return pos, res[0]["logits"].float()
    return None
