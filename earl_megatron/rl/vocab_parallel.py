"""Per-token log-probability and entropy from vocab-parallel logits (Megatron's TP output layer).

Under tensor parallelism Megatron's output layer leaves each tp rank with a contiguous slice of
the vocabulary: rank r holds logits[..., vocab_start : vocab_start + V/tp] with
``vocab_start = r * V/tp``. Nothing here gathers the full vocabulary; three per-token
all-reduces over the tp group give everything (z = logits / temperature):

    m    = max_v z_v                                   all-reduce MAX   (stability only)
    S    = sum_v exp(z_v - m)                          all-reduce SUM
    lse  = m + log S
    logp = z_y - lse        z_y from the rank that owns label y, zeros elsewhere; all-reduce SUM
    H    = lse - sum_v p_v z_v,   p_v = exp(z_v - lse)  all-reduce SUM of the local sum

Invariants:
- Results are identical on every rank of the tp group and equal (to rounding) the one-process
  full-vocab ``log_softmax`` / categorical entropy of the same logits.
- Gradients: the backward is analytic and local (no collective). Each rank returns the gradient
  for its own vocab slice:
      d logp / d z_v = 1[v == y] - p_v
      d H    / d z_v = -p_v (log p_v + H)
  which is exactly the full-vocab gradient restricted to the slice, given that the upstream
  gradients (of logp and H) are the same on every tp rank, as they are when the loss is computed
  redundantly on each tp rank (Megatron's convention; the output layer's input-gradient
  all-reduce then sums the slices' contributions).
- ``tp_group=None`` (or a group of size 1) is plain single-process log_softmax math; no collective
  is issued.
- Computation is in fp32 (fp64 for fp64 logits, so gradcheck applies); bf16/fp16 logits are
  upcast, and their gradient is cast back to the logits' dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogprobsEntropy(torch.autograd.Function):
    """(logits shard [..., V_local], labels [...]) -> (logp [...], entropy [...]); see module doc."""

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start, temperature):
        # in place where possible: peak memory is log_p and p (plus an fp32 copy of bf16 logits)
        x = logits if logits.dtype == torch.float64 else logits.float()
        m = x.max(dim=-1).values
        _all_reduce(m, dist.ReduceOp.MAX, group)
        log_p = x - m.unsqueeze(-1)                      # (x - m) / T == z - max z for T > 0
        del x
        if temperature != 1.0:
            log_p.div_(temperature)
        v_local = log_p.shape[-1]
        sum_exp = log_p.exp().sum(dim=-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        log_p.sub_(sum_exp.log().unsqueeze(-1))          # global log-softmax of this slice

        # label logit from the owning shard (log p_y directly; zeros on other ranks)
        local = labels - vocab_start
        owned = (local >= 0) & (local < v_local)
        idx = torch.where(owned, local, torch.zeros_like(local)).unsqueeze(-1)
        logp = torch.gather(log_p, -1, idx).squeeze(-1) * owned.to(log_p.dtype)
        # H = -sum_v p_v log p_v (= lse - sum_v p_v z_v); the local partial sum is reduced below
        neg_entropy = log_p.exp().mul_(log_p).sum(dim=-1)
        packed = torch.stack([logp, neg_entropy])        # one all-reduce for both
        _all_reduce(packed, dist.ReduceOp.SUM, group)
        logp, entropy = packed[0], -packed[1]

        ctx.save_for_backward(log_p, entropy, idx, owned)
        ctx.temperature = temperature
        ctx.in_dtype = logits.dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        # grad_v = g_logp (1[v == y] - p_v) - g_H p_v (log p_v + H)
        #        = 1[v == y] g_logp - p_v (g_logp + g_H (log p_v + H))
        # (autograd materialises a zero gradient for an unused output, so both are tensors)
        log_p, entropy, idx, owned = ctx.saved_tensors
        g_logp = grad_logp.to(log_p.dtype).unsqueeze(-1)
        g_ent = grad_entropy.to(log_p.dtype).unsqueeze(-1)
        grad = (log_p + entropy.unsqueeze(-1)).mul_(g_ent).add_(g_logp)
        grad.mul_(log_p.exp()).neg_()
        grad.scatter_add_(-1, idx, g_logp * owned.unsqueeze(-1).to(g_logp.dtype))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_logprobs_and_entropy(
        logits_shard: torch.Tensor, labels: torch.Tensor, tp_group=None,
        vocab_start: Optional[int] = None, temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(labels) [...], entropy [...]) of softmax(logits / temperature) over the full vocab.

    ``logits_shard``: [..., V/tp], this rank's contiguous vocab slice (any leading dims, e.g.
    Megatron's [b, s, V/tp]). ``labels``: [...] global token ids. ``vocab_start``: first global
    id of this slice; default ``tp_rank * V/tp`` (Megatron's split). Both outputs are fp32 (fp64
    for fp64 logits),
    identical on every tp rank, and differentiable with respect to ``logits_shard``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits_shard.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits_shard.shape)} and labels {tuple(labels.shape)} "
                         "disagree on the leading dims")
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    if vocab_start is None:
        vocab_start = 0 if tp_group is None else (
            dist.get_rank(tp_group) * logits_shard.shape[-1])
    return _VocabParallelLogprobsEntropy.apply(logits_shard, labels.long(), tp_group,
                                               int(vocab_start), float(temperature))
