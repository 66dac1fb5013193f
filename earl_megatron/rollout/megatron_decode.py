"""One replica's forward passes for KV-cached decoding with Megatron-Core's GPTModel.

The embedded engine (embedded_engine.py) decides what to decode; this module runs it:

- ``Pipeline.forward``: one forward through this replica's pp_stages. Hidden states [s, B, h] go
  pp_stage -> pp_stage + 1 with Megatron's inference p2p helpers; the last pp_stage gets
  full-vocabulary logits of the last position (``runtime_gather_output=True`` gathers the TP
  shards). With a ``StaticInferenceContext`` the cache slot advances after every forward.
- ``Pipeline.broadcast_from_last``: the sampled (tokens, logprobs) from the last pp_stage to
  every pp_stage of the replica, one message per step.
- masks (True = hidden): prefill [B, 1, q, width] causal with pad keys hidden (a query's own
  slot always open, so no row is all-masked); decode steps slice one precomputed pad-key mask
  [B, 1, 1, max_len] to the current length instead of building one per token.
- keys: with a context, forwards store keys already roped (rope_cache.py: Megatron's
  rope-before-store path, ``rotated=True``), so a step ropes its own token only; the one
  exception is prefix reuse's window (N > 1 tokens at a slot > 0), run on an unrotated cache
  with ``rotated=False``.
- prefix reuse: ``reuse_plan`` matches new prompts to cached rows and ``move_cached_rows`` copies
  their keys/values to the slots a fresh left-padded prefill would give them, unrotated on the
  way (rope is relative, so a contiguous run of slots keeps every relative distance).

Host fast path (CPU only, under ``runtime.cpu_backend``): the backend's torch-function mode
adds Python dispatch to every torch call (~400 per decode forward of 3 layers: a quarter to a
third of the step). A generate call needs none of its rewrites: its only CUDA uses are
``device=torch.cuda.current_device()`` allocations (the KV cache, the rope offsets of the
flash-decode path, the rotary table, the TP logits gather), which ``cpu_backend.unredirected()``
answers with the CPU. So the whole call, at every tp and pp, runs in ``host_scope()``. A CUDA
call that did slip in would fail loudly ("Cannot access accelerator device"), never silently;
on GPUs nothing changes.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from earl_megatron.rollout.rope_cache import CacheRope, rotated_keys
from earl_megatron.runtime import cpu_backend, groups


def host_scope():
    """Scope of a whole generate call: out of the CPU backend's torch-function mode (module
    docstring); elsewhere a no-op."""
    return cpu_backend.unredirected()


_SP_ATTRS = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")


@contextlib.contextmanager
def sequence_parallel_off(model):
    """Decode without sequence parallelism (an MoE model with tp > 1 trains under it).

    A decode step feeds one token per row, which cannot be split over tp. Megatron's own
    inference does the same (text_generation_controller: ``set_model_to_sequence_parallel(model,
    False, ...)`` for tp > 1 with ep > 1, refusing sequence parallelism otherwise): every module
    flag and ``config.sequence_parallel`` off for the call, each restored to its own value
    after. The MoE layer in eval mode accepts tp > 1 without it: its dispatcher gathers the
    (then replicated) tokens over expert-tp and reduce-scatters them back, so each tp rank gets
    the full result. No-op for a model that does not use it.
    """
    if not getattr(model.config, "sequence_parallel", False):
        yield
        return
    saved = [(m, a, getattr(m, a)) for m in model.modules() for a in _SP_ATTRS
             if isinstance(getattr(m, a, None), bool)]
    configs = {id(c): (c, c.sequence_parallel)
               for c in [model.config] + [getattr(m, "config", None) for m in model.modules()]
               if c is not None and hasattr(c, "sequence_parallel")}
    try:
        for m, a, _ in saved:
            setattr(m, a, False)
        for c, _ in configs.values():
            c.sequence_parallel = False
        yield
    finally:
        for m, a, v in saved:
            setattr(m, a, v)
        for c, v in configs.values():
            c.sequence_parallel = v


def prefill_mask(pad: torch.Tensor, width: int, first_slot: int = 0) -> torch.Tensor:
    """[B, 1, width - first_slot, width] bool, True = hidden, for queries at slots first_slot..
    width-1: causal, pad keys hidden, a query's own slot always open."""
    k = torch.arange(width, device=pad.device)
    q = k[first_slot:]
    causal = k[None, :] > q[:, None]
    pad_key = k[None, None, :] < pad[:, None, None]
    own = k[None, :] == q[:, None]
    return ((causal[None] | pad_key) & ~own[None])[:, None]


def pad_key_mask(pad: torch.Tensor, length: int) -> torch.Tensor:
    """[B, 1, 1, length] bool: row b hides its first pad[b] keys; slice [..., :sk] per step."""
    return (torch.arange(length, device=pad.device)[None, :] < pad[:, None])[:, None, None, :]


class Pipeline:
    """One forward through this replica's pp_stages; logits [B, V] (last position) on the last."""

    def __init__(self, model, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.model = model
        self.device = device
        self.pp_group = groups.pp_group()
        self.pp = dist.get_world_size(self.pp_group)
        self.pp_rank = dist.get_rank(self.pp_group)
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.rope = CacheRope(model)
        self._positions = torch.arange(0, device=device)

    @property
    def first(self) -> bool:
        return self.pp_rank == 0

    @property
    def last(self) -> bool:
        return self.pp_rank == self.pp - 1

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, ctx=None,
                rotated: bool = True) -> Optional[torch.Tensor]:
        """Logits of the last position on the last pp_stage (None elsewhere). With a context:
        ``rotated`` stores keys roped (rope_cache.py); False only for prefix reuse's window."""
        from megatron.core.inference.communication_utils import (
            recv_from_prev_pipeline_rank_, send_to_next_pipeline_rank)

        b, s = ids.shape
        if not self.first:
            buf = torch.empty(s, b, self.hidden_size, dtype=self.dtype, device=self.device)
            recv_from_prev_pipeline_rank_(buf, pp_group=self.pp_group)
            self.model.set_input_tensor(buf)
        start = ctx.sequence_len_offset if ctx is not None else 0
        if self._positions.numel() < start + s:  # rope ignores them; GPTModel wants them
            self._positions = torch.arange(max(2 * (start + s), 256), device=self.device)
        pos = self._positions[start:start + s][None].expand(b, s)
        with rotated_keys(self.model.config) if ctx is not None and rotated \
                else contextlib.nullcontext():
            out = self.model(ids, pos, mask, inference_context=ctx, runtime_gather_output=True)
        if ctx is not None:
            ctx.increment_sequence_len_offset(s)
        if not self.last:
            send_to_next_pipeline_rank(out.contiguous(), pp_group=self.pp_group)
            return None
        return out[:, -1, :].float()

    def broadcast_from_last(self, tokens: Optional[torch.Tensor], logprobs: Optional[torch.Tensor],
                            batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last pp_stage's sampled (tokens, logprobs) on every pp_stage of the replica."""
        if self.pp == 1:
            return tokens, logprobs
        # float64 holds token ids exactly and float32 logprobs exactly: one message per step
        buf = torch.empty(2, batch, dtype=torch.float64, device=self.device)
        if self.last:
            buf[0], buf[1] = tokens.double(), logprobs.double()
        dist.broadcast(buf, src=self.pp_ranks[-1], group=self.pp_group)
        return buf[0].long(), buf[1].float()


def reuse_plan(rows: list[tuple[list[int], int]], prompts: list, width: int):
    """Which cached row each prompt extends, and the first slot that must be computed.

    ``rows``: per cache row (cached tokens, first real slot). The new cache is laid out exactly
    as a fresh left-padded prefill of ``width`` would be (row j's tokens end at slot width-1).
    Prompt j extends cached row r when r's tokens are a proper prefix of it; every row
    recomputes the last N slots, N = the largest number of tokens any row must compute (all of
    a prompt that extends nothing), and keeps the first ``len(p) - N`` tokens' keys/values.
    Returns (first slot, kept tokens per prompt, (row, cached length, first slot) or None).
    """
    sources = []
    for p in prompts:
        best = None
        for r, (toks, start) in enumerate(rows):
            c = len(toks)
            if c < len(p) and (best is None or c > best[1]) and list(p[:c]) == toks:
                best = (r, c, start)
        sources.append(best)
    window = max(len(p) - (m[1] if m else 0) for p, m in zip(prompts, sources))
    keep = [max(0, len(p) - window) for p in prompts]
    return width - window, keep, sources


def move_cached_rows(ctx, old: dict, keep: list[int], sources: list, pad: torch.Tensor,
                     rope: CacheRope) -> None:
    """Copy kept keys/values of ``old`` (layer -> (k, v), keys roped) into the fresh cache of
    ``ctx``, keys unrotated (the window's forward ropes the whole cache by slot)."""
    pad = pad.tolist()
    for layer, (k_old, v_old) in old.items():
        k_new = k_old.new_zeros((ctx.max_sequence_length, ctx.max_batch_size, *k_old.shape[2:]))
        v_new = v_old.new_zeros((ctx.max_sequence_length, ctx.max_batch_size, *v_old.shape[2:]))
        for j, (n, src) in enumerate(zip(keep, sources)):
            if n:
                r, _, start = src
                k_new[pad[j]:pad[j] + n, j] = rope.rotate(k_old[start:start + n, r, None], start,
                                                          inverse=True)[:, 0]
                v_new[pad[j]:pad[j] + n, j] = v_old[start:start + n, r]
        ctx.key_value_memory_dict[layer] = (k_new, v_new)
