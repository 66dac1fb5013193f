"""RMSNorm for the local spec under sequence parallelism (mixture-of-experts with tp > 1).

Megatron-Core trains an MoE layer with tp > 1 only under sequence parallelism (MoELayer raises
otherwise). Without apex or TransformerEngine the local spec's norm is ``WrappedTorchNorm``,
which refuses sequence parallelism: not because the math differs, but because under sequence
parallelism each tp rank normalises its own slice of the sequence, so a norm weight's gradient
is a partial sum that must be all-reduced over tp, and WrappedTorchNorm does not mark its weight
for that. ``SequenceParallelRMSNorm`` is ``torch.nn.RMSNorm`` with the mark Megatron's fused and
TE norms set (``weight.sequence_parallel``): Megatron's ``finalize_model_grads`` then sums those
gradients over the tp group. It is used for the input, pre-MLP and final norms of a model whose
TransformerConfig has ``sequence_parallel`` (models/provider.py); elsewhere the spec is Megatron's.
"""

from __future__ import annotations

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose weight is marked for the tp all-reduce of sequence parallelism."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        if normalization != "RMSNorm" or zero_centered_gamma:
            raise ValueError(f"SequenceParallelRMSNorm is RMSNorm with a plain gamma; got "
                             f"normalization={normalization!r}, zero_centered_gamma="
                             f"{zero_centered_gamma}")
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)
