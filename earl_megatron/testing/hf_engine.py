"""A reference RolloutEngine over a transformers causal LM: batched, KV-cached, seeded sampling.

It is the yardstick for the embedded Megatron-Core engine (same weights -> same logprobs) and lets
the agent loop run against a real model on CPU. Not built for speed.

How a batch is decoded:

    prompts  [a b c]        left-padded   P P a b c     attention_mask 0 0 1 1 1
             [d e f g h]                  d e f g h                    1 1 1 1 1
    position_ids count real tokens only (P P 0 1 2), so a padded row sees exactly what it would
    alone; one prefill forward fills a DynamicCache, then one forward per new token.

Sampling and stop tracking are sampling.py's, shared with the embedded engine (finished rows keep
decoding, their tokens discarded, so the batch shape never changes). Each step draws one uniform
per row from a torch.Generator seeded with ``params.seed`` (or the engine's own generator, seeded
once at construction, when it is None) and samples the whole batch in one pass.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch

from earl_megatron.rollout.engine import (EngineHealth, Generation, SamplingParams,
                                          check_prompts)
from earl_megatron.rollout.sampling import StopTracker, sample_next


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
        track = StopTracker(batch, params.stop_token_ids, self.device)

        cache = {self._cache_kwarg: DynamicCache()}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, **cache)
        next_pos = positions[:, -1]
        for _ in range(params.max_new_tokens):
            u = torch.rand(batch, generator=gen, device=self.device) if params.temperature \
                else None
            tok, lp = sample_next(out.logits[:, -1, :], params, u)
            if track.add(tok, lp) or track.steps == params.max_new_tokens:
                break
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype,
                                               device=self.device)], dim=1)
            next_pos = next_pos + 1
            out = self.model(input_ids=tok[:, None], attention_mask=mask,
                             position_ids=next_pos[:, None], use_cache=True, **cache)
        return track.generations()

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
