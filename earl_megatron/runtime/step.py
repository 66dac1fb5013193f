"""Forward/backward over Megatron-Core's pipeline schedules for one layout.

``TokenBatch`` is the global batch (every rank builds or receives the same view of it in tests;
the trainer hands each rank only its slice through the dispatcher). ``local_microbatches`` cuts
this rank's share: samples by dp rank (contiguous blocks), tokens by cp rank (the load-balanced
split, chunks i and 2*cp-1-i), then micro-batches. ``forward_backward`` runs
``get_forward_backward_func()`` with a per-token loss:

    loss = sum_{tokens t with mask} w_t * ce_t / sum_{tokens with mask} 1      (global over dp, cp)

Megatron's ``calculate_per_token_loss`` path keeps the per-micro-batch sums and
``finalize_model_grads`` divides gradients by the global token count, so loss and gradients are
identical (to rounding) for every layout of the same global batch. ``loss_fn`` can replace the
cross-entropy term (the RL losses do) as long as it returns a per-token loss.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from earl_megatron.models.cp_attention import zigzag_positions
from earl_megatron.plan.layout import Coords, ParallelLayout


@dataclass(frozen=True)
class TokenBatch:
    """A padded global batch: tokens [B, S+1]; the model reads [:, :-1] and predicts [:, 1:]."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    """[B, S+1], float; the entry at position j weighs the prediction of tokens[:, j]."""
    extras: Optional[dict] = None
    """Per-token tensors [B, S+1] aligned like loss_mask (old logprobs, advantages, ...)."""

    @property
    def num_samples(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1] - 1


def random_batch(num_samples: int, seq_len: int, vocab: int, seed: int) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (num_samples, seq_len + 1), generator=g)
    mask = (torch.rand(num_samples, seq_len + 1, generator=g) > 0.25).float()
    mask[:, 0] = 0.0
    return TokenBatch(tokens=tokens, loss_mask=mask)


def local_microbatches(batch: TokenBatch, layout: ParallelLayout, coords: Coords,
                       micro_batch_size: int, device=None) -> list[dict]:
    """This rank's micro-batches: dp block of samples, cp zigzag of tokens."""
    if batch.num_samples % layout.dp:
        raise ValueError(f"global batch of {batch.num_samples} samples does not divide by "
                         f"dp={layout.dp}; pad the batch or change the layout")
    per_dp = batch.num_samples // layout.dp
    if per_dp % micro_batch_size:
        raise ValueError(f"{per_dp} samples per dp rank do not divide by micro_batch_size="
                         f"{micro_batch_size}")
    rows = slice(coords.dp * per_dp, (coords.dp + 1) * per_dp)
    pos = zigzag_positions(batch.seq_len, layout.cp, coords.cp)
    inputs = batch.tokens[rows, :-1][:, pos]
    labels = batch.tokens[rows, 1:][:, pos]
    mask = batch.loss_mask[rows, 1:][:, pos]
    extras = {k: v[rows, 1:][:, pos] for k, v in (batch.extras or {}).items()}
    out = []
    for m in range(0, per_dp, micro_batch_size):
        sl = slice(m, m + micro_batch_size)
        mb = dict(input_ids=inputs[sl], labels=labels[sl], loss_mask=mask[sl],
                  position_ids=pos.unsqueeze(0).expand(micro_batch_size, -1),
                  **{k: v[sl] for k, v in extras.items()})
        out.append({k: (v.to(device) if device is not None else v) for k, v in mb.items()})
    return out


PerTokenLoss = Callable[[torch.Tensor, dict], torch.Tensor]
"""(model output [b, s] per-token CE or logits-derived values, micro-batch) -> per-token loss."""


def _ce_loss(output: torch.Tensor, mb: dict) -> torch.Tensor:
    return output.float()


@dataclass(frozen=True)
class StepResult:
    loss: float
    """Global token-mean loss over the whole batch (identical on every rank)."""
    num_tokens: int
    seconds: float


def forward_backward(model, tcfg, microbatches: list[dict], layout: ParallelLayout, *,
                     seq_len: int, micro_batch_size: int, forward_only: bool = False,
                     loss_fn: PerTokenLoss = _ce_loss) -> StepResult:
    """One forward(/backward) pass over ``microbatches`` with Megatron's schedule for ``layout``."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tcfg.finalize_model_grads_func = finalize_model_grads
    if hasattr(model, "no_sync"):
        tcfg.no_sync_func = model.no_sync
    it = iter(microbatches)

    def forward_step(data_iterator, m):
        mb = next(data_iterator)
        output = m(mb["input_ids"], mb["position_ids"], None, labels=mb["labels"])

        def loss_func(out):
            per_token = loss_fn(out, mb)
            mask = mb["loss_mask"].float()
            loss_sum = (per_token * mask).sum()
            ntok = mask.sum().to(torch.int)
            return loss_sum, ntok, {"loss": torch.stack([loss_sum.detach(), mask.sum()])}

        return output, loss_func

    t0 = time.perf_counter()
    if not forward_only and hasattr(model, "zero_grad_buffer"):
        model.zero_grad_buffer()
    fb = get_forward_backward_func()
    reduced = fb(forward_step_func=forward_step, data_iterator=it, model=[model],
                 num_microbatches=len(microbatches), seq_length=seq_len,
                 micro_batch_size=micro_batch_size, forward_only=forward_only)
    seconds = time.perf_counter() - t0
    return StepResult(*_global_loss(reduced), seconds=seconds)


@dataclass(frozen=True)
class TrainStepResult:
    loss: float
    num_tokens: int
    grad_norm: float
    update_successful: bool
    seconds: float


def train_step(mol, microbatches: list[dict], *, seq_len: int, micro_batch_size: int,
               loss_fn: PerTokenLoss = _ce_loss) -> TrainStepResult:
    """zero grads -> forward/backward -> optimizer step, as Megatron-LM's train_step orders it.

    ``optimizer.zero_grad()`` matters as much as ``zero_grad_buffer()``: Megatron's optimizer
    points ``param.grad`` at the DDP buffer during ``step``; left in place, the next backward
    accumulates through that alias and the gradients are wrong from the second step on.
    """
    t0 = time.perf_counter()
    mol.optimizer.zero_grad()
    res = forward_backward(mol.model, mol.tcfg, microbatches, mol.layout, seq_len=seq_len,
                           micro_batch_size=micro_batch_size, loss_fn=loss_fn)
    ok, grad_norm, _ = mol.optimizer.step()
    return TrainStepResult(loss=res.loss, num_tokens=res.num_tokens,
                           grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                           update_successful=bool(ok), seconds=time.perf_counter() - t0)


def _global_loss(reduced: list[dict]) -> tuple[float, int]:
    """Sum the last pp_stage's (loss_sum, tokens) over dp x cp; every rank gets the result."""
    from earl_megatron.runtime import groups

    totals = torch.zeros(2, dtype=torch.float64)
    coords = groups.coords_of_this_rank()
    if groups.is_pipeline_last_stage() and coords["tp"] == 0:
        for r in reduced:
            totals += r["loss"].double().cpu()
    dist.all_reduce(totals)
    loss_sum, ntok = totals.tolist()
    return loss_sum / max(ntok, 1.0), int(round(ntok))
