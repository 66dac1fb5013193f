"""Forward/backward over Megatron-Core's pipeline schedules for one layout.

``TokenBatch`` is a global batch (tests and tools build the same one on every rank; the trainer
hands each rank only its slice through the dispatcher). ``local_microbatches`` cuts this rank's
share (samples by dp block, tokens by cp zigzag) and stacks it with the trainer's builder,
runtime/step_inputs.py. ``forward_backward`` runs
``get_forward_backward_func()`` with a per-token loss:

    loss = sum_{tokens t with mask} w_t * ce_t / sum_{tokens with mask} 1      (global over dp, cp)

Megatron's ``calculate_per_token_loss`` path keeps the per-micro-batch sums and
``finalize_model_grads`` divides gradients by the global token count, so loss and gradients are
identical (to rounding) for every layout of the same global batch. ``loss_fn`` can replace the
cross-entropy term (the RL losses do) as long as it returns a per-token loss.

Two outputs of the model, two paths:

    forward_backward / train_step            model(..., labels=)  -> ce [b, s]   (cheapest: the
                                                                     default; logp = -ce)
    forward_backward_logprobs /              model(...)           -> logits [b, s, V/tp]
      train_step_logprobs / forward_logprobs   -> rl.vocab_parallel -> TokenLogprobs(logp, entropy)

The logits path serves losses that need the entropy (``entropy_coef > 0``) or a sampling
temperature, and the LOGPROB stage (``forward_logprobs``: old and reference logprobs, no grad).
On the same weights and data the two paths give the same logp (to rounding) in every layout.

The critic (models/value_model.py, PPO) has a third output and the same two uses:

    forward_backward_values / forward_values  model(...)           -> values [b, s] (fp32)
      train_step_values

Mixture of experts (Megatron's router, load-balancing ``aux_loss`` when
``moe_aux_loss_coeff > 0``): the aux loss never enters the reported loss (Megatron's router
attaches it to the activations with ``MoEAuxLossAutoScaler``, whose backward adds its gradient,
and logs it in its own tracker). Per micro-batch it is layout-invariant (token counts per
expert summed over the tp x cp group: the whole micro-batch), but under
``calculate_per_token_loss`` Megatron 0.16 multiplies each rank's part by the rank's *local*
token count (seq / (tp * cp) with sequence parallelism) while finalize_model_grads divides by
the global masked-token count, so its gradient would shrink by tp * cp (cp without SP).
``_aux_loss_scale`` multiplies the scale the schedule sets (``set_loss_scale``, 1 or the grad
scaler's) by that factor for the duration of the schedule call, so aux-loss gradients are the
one-process run's in every layout (tests/distributed/test_moe_equivalence.py). Sequence
parallelism (MoE with tp > 1) needs every sequence length divisible by tp (x 2 * cp):
``local_microbatches(..., model=cfg)`` checks it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from earl_megatron.plan.layout import Coords, ParallelLayout
from earl_megatron.models.cp_attention import zigzag_positions
from earl_megatron.plan.placement import TensorSpec
from earl_megatron.runtime.step_inputs import TRAIN_TENSORS, microbatches


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
                       micro_batch_size: int, device=None, model=None) -> list[dict]:
    """This rank's micro-batches of a global batch: dp block of samples, cp zigzag of tokens,
    stacked by ``step_inputs.microbatches`` (the trainer's builder). ``model`` (a ModelConfig)
    says whether sequence parallelism also constrains the length."""
    if batch.num_samples % layout.dp:
        raise ValueError(f"global batch of {batch.num_samples} samples does not divide by "
                         f"dp={layout.dp}; pad the batch or change the layout")
    per_dp = batch.num_samples // layout.dp
    if per_dp % micro_batch_size:
        raise ValueError(f"{per_dp} samples per dp rank do not divide by micro_batch_size="
                         f"{micro_batch_size}")
    multiple = layout.length_multiple(model)
    if batch.seq_len % multiple:
        raise ValueError(f"sequence length {batch.seq_len} must be divisible by {multiple} "
                         f"(2*cp, times tp under sequence parallelism) on {layout}; pad the batch")
    rows = list(range(coords.dp * per_dp, (coords.dp + 1) * per_dp))
    pos = zigzag_positions(batch.seq_len, layout.cp, coords.cp)
    columns = {"input_ids": batch.tokens[:, :-1], "labels": batch.tokens[:, 1:],
               "loss_mask": batch.loss_mask[:, 1:],
               **{k: v[:, 1:] for k, v in (batch.extras or {}).items()}}
    received = {name: {r: col[r, pos] for r in rows} for name, col in columns.items()}
    known = {spec.name: spec for spec in TRAIN_TENSORS}
    specs = [known.get(name, TensorSpec(name, "float32")) for name in columns]
    ids = [rows[m:m + micro_batch_size] for m in range(0, per_dp, micro_batch_size)]
    return microbatches(received, ids, seq_lens=[batch.seq_len] * len(ids), cp=layout.cp,
                        cp_rank=coords.cp, tensors=specs, device=device)


PerTokenLoss = Callable[[torch.Tensor, dict], torch.Tensor]
"""(model output [b, s] per-token CE or logits-derived values, micro-batch) -> per-token loss."""


def _ce_loss(output: torch.Tensor, mb: dict) -> torch.Tensor:
    return output.float()


@dataclass(frozen=True)
class ForwardBackwardResult:
    loss: float
    """Global token-mean loss over the whole batch (identical on every rank)."""
    num_tokens: int
    seconds: float


def forward_backward(model, tcfg, microbatches: list[dict], layout: ParallelLayout, *,
                     seq_len: int, micro_batch_size: int, forward_only: bool = False,
                     loss_fn: PerTokenLoss = _ce_loss) -> ForwardBackwardResult:
    """One forward(/backward) pass over ``microbatches`` with Megatron's schedule for ``layout``."""

    def forward_step(data_iterator, m):
        mb = next(data_iterator)
        output = m(mb["input_ids"], mb["position_ids"], None, labels=mb["labels"])
        return output, _masked_loss_func(lambda out: loss_fn(out, mb), mb)

    return _run_schedule(model, tcfg, microbatches, seq_len=seq_len,
                         micro_batch_size=micro_batch_size, forward_only=forward_only,
                         forward_step=forward_step)


def _masked_loss_func(per_token_fn, mb: dict):
    """Megatron's per-token loss contract: (sum of masked losses, token count, reported values)."""

    def loss_func(out):
        per_token = per_token_fn(out)
        mask = mb["loss_mask"].float()
        loss_sum = (per_token * mask).sum()
        ntok = mask.sum().to(torch.int)
        return loss_sum, ntok, {"loss": torch.stack([loss_sum.detach(), mask.sum()])}

    return loss_func


def _run_schedule(model, tcfg, microbatches: list[dict], *, seq_len: int, micro_batch_size: int,
                  forward_only: bool, forward_step) -> ForwardBackwardResult:
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tcfg.finalize_model_grads_func = finalize_model_grads
    if hasattr(model, "no_sync"):
        tcfg.no_sync_func = model.no_sync
    t0 = time.perf_counter()
    if not forward_only and hasattr(model, "zero_grad_buffer"):
        model.zero_grad_buffer()
    fb = get_forward_backward_func()
    with _aux_loss_scale(tcfg):
        reduced = fb(forward_step_func=forward_step, data_iterator=iter(microbatches),
                     model=[model], num_microbatches=len(microbatches), seq_length=seq_len,
                     micro_batch_size=micro_batch_size, forward_only=forward_only)
    seconds = time.perf_counter() - t0
    return ForwardBackwardResult(*_global_loss(reduced), seconds=seconds)


@contextlib.contextmanager
def _aux_loss_scale(tcfg):
    """Within the schedule call, MoE aux-loss gradients scaled by tp * cp (cp without sequence
    parallelism): Megatron scales each rank's aux loss by its local token count under
    ``calculate_per_token_loss`` (module docstring). A no-op for dense models."""
    factor = tcfg.context_parallel_size * (tcfg.tensor_model_parallel_size
                                           if tcfg.sequence_parallel else 1)
    if not tcfg.num_moe_experts or not tcfg.calculate_per_token_loss or factor == 1:
        yield
        return
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    original = MoEAuxLossAutoScaler.__dict__["set_loss_scale"]
    MoEAuxLossAutoScaler.set_loss_scale = staticmethod(
        lambda scale: original.__func__(scale * factor))
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.set_loss_scale = original


@dataclass(frozen=True)
class TrainStepResult:
    loss: float
    num_tokens: int
    grad_norm: float
    update_successful: bool
    seconds: float


def train_step(on_layout, microbatches: list[dict], *, seq_len: int, micro_batch_size: int,
               loss_fn: PerTokenLoss = _ce_loss) -> TrainStepResult:
    """zero grads -> forward/backward -> optimizer step, as Megatron-LM's train_step orders it.

    ``optimizer.zero_grad()`` matters as much as ``zero_grad_buffer()``: Megatron's optimizer
    points ``param.grad`` at the DDP buffer during ``step``; left in place, the next backward
    accumulates through that alias and the gradients are wrong from the second step on.
    """
    return _train_step(on_layout, lambda: forward_backward(
        on_layout.model, on_layout.tcfg, microbatches, on_layout.layout, seq_len=seq_len,
        micro_batch_size=micro_batch_size, loss_fn=loss_fn))


def _train_step(on_layout, run_forward_backward: Callable[[], ForwardBackwardResult]
                ) -> TrainStepResult:
    t0 = time.perf_counter()
    on_layout.optimizer.zero_grad()
    res = run_forward_backward()
    ok, grad_norm, _ = on_layout.optimizer.step()
    return TrainStepResult(loss=res.loss, num_tokens=res.num_tokens,
                           grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                           update_successful=bool(ok), seconds=time.perf_counter() - t0)


# --- the logits path: logp and entropy from vocab-parallel logits ---------------------------


@dataclass(frozen=True)
class TokenLogprobs:
    """Per-token values of one micro-batch on this rank: [b, s_local] (cp: the local zigzag chunk).

    Both are fp32, identical on every tp rank, and differentiable w.r.t. the model's parameters.
    """

    logp: torch.Tensor
    """log pi(label) under softmax(logits / temperature), normalised over the full vocabulary."""
    entropy: torch.Tensor
    """Entropy of that distribution (nats)."""


LogprobLoss = Callable[[TokenLogprobs, dict], torch.Tensor]
"""(TokenLogprobs of a micro-batch, micro-batch) -> per-token loss [b, s_local]."""


def token_logprobs(logits: torch.Tensor, mb: dict, temperature: float = 1.0) -> TokenLogprobs:
    """TokenLogprobs from Megatron's logits shard [b, s, V/tp] and ``mb["labels"]`` [b, s]."""
    from earl_megatron.rl.vocab_parallel import vocab_parallel_logprobs_and_entropy
    from earl_megatron.runtime import groups

    logp, entropy = vocab_parallel_logprobs_and_entropy(logits, mb["labels"], groups.tp_group(),
                                                        temperature=temperature)
    return TokenLogprobs(logp=logp, entropy=entropy)


def forward_backward_logprobs(model, tcfg, microbatches: list[dict], layout: ParallelLayout, *,
                              seq_len: int, micro_batch_size: int, loss_fn: LogprobLoss,
                              forward_only: bool = False,
                              temperature: float = 1.0) -> ForwardBackwardResult:
    """``forward_backward`` through the logits path: ``loss_fn`` sees logp AND entropy.

    Same loss normalisation and reporting as ``forward_backward`` (masked per-token sum over the
    global token count). Costs one more V/tp-wide fp32 buffer per micro-batch than the labels
    path; use it only when the loss needs the entropy or a temperature.
    """

    def forward_step(data_iterator, m):
        mb = next(data_iterator)
        logits = m(mb["input_ids"], mb["position_ids"], None)
        return logits, _masked_loss_func(
            lambda out: loss_fn(token_logprobs(out, mb, temperature), mb), mb)

    return _run_schedule(model, tcfg, microbatches, seq_len=seq_len,
                         micro_batch_size=micro_batch_size, forward_only=forward_only,
                         forward_step=forward_step)


def train_step_logprobs(on_layout, microbatches: list[dict], *, seq_len: int, micro_batch_size: int,
                        loss_fn: LogprobLoss, temperature: float = 1.0) -> TrainStepResult:
    """``train_step`` through the logits path (see ``forward_backward_logprobs``)."""
    return _train_step(on_layout, lambda: forward_backward_logprobs(
        on_layout.model, on_layout.tcfg, microbatches, on_layout.layout, seq_len=seq_len,
        micro_batch_size=micro_batch_size, loss_fn=loss_fn, temperature=temperature))


def forward_logprobs(on_layout, microbatches: list[dict], *, seq_len: int, micro_batch_size: int,
                     temperature: float = 1.0) -> list[torch.Tensor]:
    """Per-token logprobs of ``mb["labels"]`` for each micro-batch: the LOGPROB stage.

    Forward only (Megatron's schedule for ``on_layout.layout``, no grad, the model in eval mode for
    the call and restored after). Returns, in micro-batch order, fp32 [b, s_local] tensors
    (cp: this rank's zigzag chunk, positions ``mb["position_ids"]``) on every rank of the LAST
    pp_stage (identical across its tp ranks; each dp rank has its own samples); every other
    pp_stage gets ``[]``. Moving them to the consumer is the dispatcher's job.
    """
    return _forward_only(on_layout, microbatches, seq_len=seq_len,
                         micro_batch_size=micro_batch_size,
                         collect=lambda out, mb: token_logprobs(out, mb, temperature).logp)


def forward_values(on_layout, microbatches: list[dict], *, seq_len: int,
                   micro_batch_size: int) -> list[torch.Tensor]:
    """The critic's values for each micro-batch (``on_layout`` built with
    models/value_model.critic_loader): a VALUES stage, as ``forward_logprobs`` in every respect
    but the output (fp32 [b, s_local] on the last pp_stage, ``[]`` elsewhere)."""
    from earl_megatron.models.value_model import critic_values

    return _forward_only(on_layout, microbatches, seq_len=seq_len,
                         micro_batch_size=micro_batch_size,
                         collect=lambda out, mb: critic_values(out))


def _forward_only(on_layout, microbatches: list[dict], *, seq_len: int, micro_batch_size: int,
                  collect: Callable[[torch.Tensor, dict], torch.Tensor]) -> list[torch.Tensor]:
    """``collect(model output, micro-batch)`` of each micro-batch, no grad, in eval mode."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, m):
        mb = next(data_iterator)
        return m(mb["input_ids"], mb["position_ids"], None), \
            lambda out, non_loss_data=False: collect(out, mb)

    model = on_layout.model
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(microbatches), model=[model],
                num_microbatches=len(microbatches), seq_length=seq_len,
                micro_batch_size=micro_batch_size, forward_only=True, collect_non_loss_data=True)
    finally:
        model.train(was_training)
    return list(out) if on_layout.post_process else []


ValueLoss = Callable[[torch.Tensor, dict], torch.Tensor]
"""(the critic's values [b, s_local] fp32 of a micro-batch, micro-batch) -> per-token loss
(rl/value.value_loss with the micro-batch's old values and returns)."""


def forward_backward_values(model, tcfg, microbatches: list[dict], layout: ParallelLayout, *,
                            seq_len: int, micro_batch_size: int,
                            loss_fn: ValueLoss) -> ForwardBackwardResult:
    """``forward_backward`` for the critic: ``loss_fn`` sees the values. Same normalisation
    (masked per-token sum over the global token count, so the gradients are the same in every
    layout); a CRITIC TRAIN stage wraps it as ``train_step`` does (``_train_step``)."""
    from earl_megatron.models.value_model import critic_values

    def forward_step(data_iterator, m):
        mb = next(data_iterator)
        return m(mb["input_ids"], mb["position_ids"], None), _masked_loss_func(
            lambda out: loss_fn(critic_values(out), mb), mb)

    return _run_schedule(model, tcfg, microbatches, seq_len=seq_len,
                         micro_batch_size=micro_batch_size, forward_only=False,
                         forward_step=forward_step)


def train_step_values(on_layout, microbatches: list[dict], *, seq_len: int,
                      micro_batch_size: int, loss_fn: ValueLoss) -> TrainStepResult:
    """The critic's optimizer step (a CRITIC TRAIN stage): ``forward_backward_values`` ordered
    as ``train_step`` orders the policy's."""
    return _train_step(on_layout, lambda: forward_backward_values(
        on_layout.model, on_layout.tcfg, microbatches, on_layout.layout, seq_len=seq_len,
        micro_batch_size=micro_batch_size, loss_fn=loss_fn))


def _global_loss(reduced: list[dict]) -> tuple[float, int]:
    """Sum the last pp_stage's (loss_sum, tokens) over dp x cp; every rank gets the result."""
    from earl_megatron.runtime import groups

    totals = torch.zeros(2, dtype=torch.float64)
    coords = groups.coords_of_this_rank()
    if groups.is_pipeline_last_stage() and coords["tp"] == 0:
        for r in reduced:
            totals += r["loss"].double().cpu()
    dist.all_reduce(totals, group=groups.pool_group())
    loss_sum, ntok = totals.tolist()
    return loss_sum / max(ntok, 1.0), int(round(ntok))
