"""The rollout engine interface: token ids in, sampled token ids and their logprobs out.

Every engine (the embedded Megatron-Core engine, SGLang servers, the transformers reference)
implements ``RolloutEngine``. The agent loop only sees this interface. Invariants:

- ``generate`` returns one ``Generation`` per prompt, in prompt order; ``len(logprobs) ==
  len(token_ids)``; each logprob is log p(token | context) under the sampling distribution's
  *unmodified* model distribution at temperature ``params.temperature`` (i.e. log_softmax of
  logits / temperature, before top-p truncation), so it is comparable with the trainer's
  recomputed logprobs.
- Generation stops at the first token in ``stop_token_ids`` (included in the output,
  finish_reason "stop") or after ``max_new_tokens`` (finish_reason "length").
- Prompts are never empty (SGLang's scheduler crashes on 0-token prompts): engines raise
  ValueError for an empty prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    """Seed for this call's sampling; None draws from the engine's own generator."""

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class Generation:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    """"stop" (hit a stop token) or "length" (hit max_new_tokens)."""
    routes: Any = field(default=None, compare=False)
    """MoE routing replay (rollout/routing_replay.py): int16 [len(prompt) + len(token_ids) - 1,
    layers, topk], the experts each token fed to the model chose (the prompt's and every
    sampled token's but the last), from an engine asked to record them; None otherwise."""


@dataclass(frozen=True)
class EngineHealth:
    healthy: bool
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """Sample a continuation of every prompt (batched by the engine)."""

    def update_weights(self, source: Any) -> None:
        """Load new policy weights (engine-specific source: live model, state dict, HF dir)."""

    def release_memory(self) -> None:
        """Free KV cache / weights when colocated with training; resume_memory undoes it."""

    def resume_memory(self) -> None:
        ...

    def health(self) -> EngineHealth:
        ...

    def close(self) -> None:
        ...


def check_prompts(prompts: Sequence[Sequence[int]]) -> None:
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; engines need at least one token "
                             "(render the observation or a BOS token first)")


def split_evenly(n: int, parts: int) -> list[range]:
    """Contiguous index ranges covering 0..n-1 over ``parts`` workers (dp replicas, servers);
    sizes differ by at most one and the first ranges take the extra items."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out
