"""Token sampling and stop tracking shared by every in-process rollout engine (embedded, HF).

``sample_next(logits, params, uniforms)`` turns last-position logits [B, V] into tokens [B] and
their logprobs [B] in ONE batched pass, whatever the batch size: the randomness comes in as one
uniform number per row (``uniforms`` [B] in [0, 1)), and a row's token is the inverse CDF of its
(top-p truncated) distribution at that number::

    probs  (sorted descending when top_p < 1)   0.50 0.30 0.15 0.05
    cdf                                         0.50 0.80 0.95 1.00
    u * cdf[-1] = 0.62  ->  first index whose cdf exceeds it: 1

``torch.searchsorted(..., right=True)`` picks the first cdf entry strictly above ``u * total``, so
a token of probability 0 (a run of equal cdf entries) can never be drawn, and u < 1 keeps the
index in range. Where the uniforms come from is the engine's choice: the embedded engine draws
them from one generator per row (a row's samples then depend neither on its batch mates nor on
the dp split), the HF reference engine from one generator per call. Drawing them up front
(``row_uniforms``: one ``torch.rand(steps)`` per row per call) replaces one multinomial call per
row per step (the embedded engine's former per-row loop, ~20% of a decode step on CPU).

Contract (engine.py): the logprob of a sampled token is log_softmax(logits / T) before top-p;
temperature 0 is greedy and reports log_softmax(logits) (T = 1).

``StopTracker`` keeps what a batch decode returns: per step tokens and logprobs, which rows hit a
stop token (the stop token is kept, finish_reason "stop") and each row's length; finished rows
keep decoding (their tokens are dropped) so the batch never changes shape.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from earl_megatron.rollout.engine import Generation, SamplingParams


def sample_next(logits: torch.Tensor, params: SamplingParams,
                uniforms: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] and logprobs [B] from logits [B, V]; ``uniforms`` [B] (unused when greedy)."""
    logits = logits.float()
    if params.temperature == 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logprobs.gather(1, tokens[:, None])[:, 0]
    if uniforms is None:
        raise ValueError("sampling at temperature > 0 needs one uniform number per row")
    logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
    probs = logprobs.exp()
    order = None
    if params.top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p: drop a token when the mass before
        # it already does (the first token is always kept)
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= params.top_p, 0.0)
    cdf = probs.cumsum(dim=-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
    tokens = (index if order is None else order.gather(1, index))[:, 0]
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


def row_uniforms(generators: Sequence[torch.Generator], steps: int,
                 device: torch.device) -> torch.Tensor:
    """[steps, rows] uniforms: column i is drawn from ``generators[i]`` alone."""
    return torch.stack([torch.rand(steps, generator=g, device=device) for g in generators],
                       dim=1)


class StopTracker:
    """Tokens, logprobs, stops and lengths of a batch decode, step by step."""

    def __init__(self, batch: int, stop_token_ids: Sequence[int], device: torch.device):
        self.stop = torch.tensor(list(stop_token_ids) or [-1], device=device)
        self.tokens: list[torch.Tensor] = []
        self.logprobs: list[torch.Tensor] = []
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.stopped = torch.zeros(batch, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)

    @property
    def steps(self) -> int:
        return len(self.tokens)

    def add(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> bool:
        """Record one step; True when every row has stopped."""
        self.tokens.append(tokens)
        self.logprobs.append(logprobs)
        self.lengths += (~self.done).long()
        hit = torch.isin(tokens, self.stop) & ~self.done
        self.stopped |= hit
        self.done |= hit
        return bool(self.done.all())

    def token_lists(self) -> list[list[int]]:
        """Every row's tokens of every step (also those after its stop)."""
        return torch.stack(self.tokens, dim=1).tolist()

    def generations(self) -> list[Generation]:
        tokens = self.token_lists()
        logprobs = torch.stack(self.logprobs, dim=1).tolist()
        return [Generation(token_ids=tuple(tokens[i][:n]), logprobs=tuple(logprobs[i][:n]),
                           finish_reason="stop" if self.stopped[i] else "length")
                for i, n in enumerate(self.lengths.tolist())]
