"""A reference RolloutEngine over a transformers causal LM: batched, KV-cached, seeded sampling.

It is the yardstick for the embedded Megatron-Core engine (same weights -> same logprobs) and lets
the agent loop run against a real model on CPU. Not built for speed.

How a batch is decoded:

    prompts  [a b c]        left-padded   P P a b c     attention_mask 0 0 1 1 1
             [d e f g h]                  d e f g h                    1 1 1 1 1
    position_ids count real tokens only (P P 0 1 2), so a padded row sees exactly what it would
    alone; one prefill forward fills a DynamicCache, then one forward per new token.

Finished rows keep decoding (their tokens are discarded) until every row has stopped, so the
batch shape never changes. Sampling follows engine.py's contract: the logprob of a sampled
token is log_softmax(logits / temperature) before top-p truncation; temperature 0 is greedy and
reports log_softmax(logits) (temperature 1). Every call draws from a torch.Generator seeded with
``params.seed`` (or the engine's own generator, seeded once at construction, when it is None).
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch

from earl_megatron.rollout.engine import (EngineHealth, Generation, SamplingParams,
                                          check_prompts)


def sample_next(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] and their logprobs [B] from last-position logits [B, V] (float32)."""
    logits = logits.float()
    if params.temperature == 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logprobs.gather(1, tokens[:, None])[:, 0]
    logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
    probs = logprobs.exp()
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p: drop a token when the mass before
        # it already does (the first token is always kept)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(1, order, sorted_probs)
    tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


class HFEngine:
    """RolloutEngine over a ``transformers`` causal LM (e.g. a tiny random LlamaForCausalLM)."""

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int = 0, seed: int = 0,
                 device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.pad_token_id = pad_token_id
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._released = False
        # transformers 5.x renamed past_key_values to cache (the old name warns, then goes away)
        params = inspect.signature(type(model).forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams) -> list[Generation]:
        check_prompts(prompts)
        if self._released:
            raise RuntimeError("HFEngine.generate after release_memory(); call resume_memory() "
                               "first")
        if not prompts:
            return []
        from transformers import DynamicCache

        gen = self._generator
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        batch, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        stop = torch.tensor(list(params.stop_token_ids) or [-1], device=self.device)

        cache = {self._cache_kwarg: DynamicCache()}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, **cache)
        tokens_out, logprobs_out = [], []
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=self.device)
        lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        next_pos = positions[:, -1]
        for _ in range(params.max_new_tokens):
            tok, lp = sample_next(out.logits[:, -1, :], params, gen)
            tokens_out.append(tok)
            logprobs_out.append(lp)
            lengths += (~done).long()
            hit = torch.isin(tok, stop) & ~done
            stopped |= hit
            done |= hit
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype,
                                               device=self.device)], dim=1)
            next_pos = next_pos + 1
            out = self.model(input_ids=tok[:, None], attention_mask=mask,
                             position_ids=next_pos[:, None], use_cache=True, **cache)
        tokens = torch.stack(tokens_out, dim=1).tolist()
        logprobs = torch.stack(logprobs_out, dim=1).tolist()
        return [Generation(token_ids=tuple(tokens[i][:n]), logprobs=tuple(logprobs[i][:n]),
                           finish_reason="stop" if stopped[i] else "length")
                for i, n in enumerate(lengths.tolist())]

    def update_weights(self, source: Any) -> None:
        """Load weights from a state dict, a module with the same parameters, or an HF dir."""
        if isinstance(source, torch.nn.Module):
            source = source.state_dict()
        elif isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
            source = type(self.model).from_pretrained(source).state_dict()
        if not isinstance(source, dict):
            raise TypeError(f"HFEngine.update_weights takes a state dict, an nn.Module or a "
                            f"model directory, got {type(source).__name__}")
        missing, unexpected = self.model.load_state_dict(source, strict=False)
        real_missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
        if real_missing or unexpected:
            raise ValueError(f"weights do not match the model: missing {real_missing[:5]}, "
                             f"unexpected {list(unexpected)[:5]}")

    def release_memory(self) -> None:
        # The reference engine keeps no KV cache between calls; on an accelerator it moves the
        # weights to host memory so a colocated trainer gets the device back.
        if self.device.type != "cpu":
            self.model.to("cpu")
        self._released = True

    def resume_memory(self) -> None:
        self.model.to(self.device)
        self._released = False

    def health(self) -> EngineHealth:
        n = sum(p.numel() for p in self.model.parameters())
        return EngineHealth(healthy=not self._released,
                            detail="released" if self._released else "ready",
                            extra={"device": str(self.device), "parameters": n})

    def close(self) -> None:
        self._released = True
