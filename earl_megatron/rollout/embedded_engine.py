"""The embedded rollout engine: Megatron-Core's own GPTModel in the rollout layout, with a KV cache.

``EmbeddedEngine(on_layout)`` serves the ``RolloutEngine`` interface from a ``ModelOnLayout`` built
with ``build_on_layout(cfg, layout, weights=..., ddp=False)``. Every rank of the world calls
``generate`` collectively (SPMD) with the same arguments.

Decoding (one model replica, i.e. one dp index; the forwards are megatron_decode.py's):

    prompts   [a b c]      left-padded to the batch width    P P a b c     (P = pad_token_id)
              [d e f g h]                                    d e f g h
    prefill:  forwards over [rows, width] (rows = prefill_tokens // width, to bound the
              attention scores; the context's batch_size_offset places each chunk) with a
              causal mask that hides pad keys; Megatron's StaticInferenceContext stores K/V of
              every layer at slots 0..width-1.
    decode:   one forward per new token, input [B, 1], the pad-key mask sliced to the cache
              length; ``increment_sequence_len_offset`` advances the cache slot every forward.

Prefix reuse (``reuse_prefix=True``, for multi-turn agents whose next prompt is the previous
prompt + sampled tokens + the environment's answer): the cache survives between calls; each new
prompt is matched to the cached row it extends, its kept keys/values move to the slots a fresh
left-padded prefill would give them, and only the last N slots are computed (N = the most
tokens any row adds). Tested: same episodes as without reuse.

Rotary embeddings are taken at the cache slot, so a row shifted right by its padding sees
every real query/key pair at the same relative distance as alone: rope is relative, and the
test "batched == one at a time" checks it. Keys are stored already roped (rope_cache.py), so a
decode step ropes only its own token. The call runs in inference mode and, on CPU, out of the
backend's torch-function mode (megatron_decode.host_scope). With pp > 1 the last pp_stage
samples and broadcasts (token, logprob) to the replica's other pp_stages; every TP rank of the
last pp_stage samples from bit-identical gathered logits with identical uniforms, so they draw
the same token without another collective.

Data parallelism: dp replicas are independent engines; no collective crosses dp while decoding,
except under expert parallelism (MoE, ep > 1), whose ep group spans replicas: every forward's
all-to-all needs all of them, so they decode in lockstep. Before the prefill and before each
decode step one all-reduce (MAX) over the ep group agrees on the forwards left; a replica with
fewer (fewer or no prompts, every row stopped) runs one-pad-token forwards without a cache::

    ep2, replica 0: prefill  step step step  (stopped)  idle idle
         replica 1: prefill  step step step  step       step step   <- same 6 forwards each

Sequence parallelism (MoE with tp > 1 trains under it) is off during a call, as in Megatron's
own inference (megatron_decode.sequence_parallel_off): one token per row cannot be split.

    prompts="global" (default): every rank passes the SAME prompt list; replica r decodes the
        contiguous block r (sizes differ by at most one, the first replicas take the extra), and
        the results are all-gathered over dp: every rank returns all generations in prompt order.
        dp=2, prompts ABCDE: replica 0 decodes ABC, replica 1 decodes DE; every rank returns ABCDE.
    prompts="replica": the ranks of one replica pass the same list and other replicas pass their
        own (each runs its own agent loop); every rank returns its replica's generations.

Sampling is sampling.py's (shared with the HF reference engine): one batched pass per step,
fed by one uniform per row drawn up front from a generator per row, seeded by (call seed, global
prompt index); the call seed is ``params.seed`` or, when None, drawn from the engine's own
generator on every rank alike. So a row's samples do not depend on its batch mates or on the dp
split (a dp2 rollout samples what a tp2 one does, to rounding of the logits), and duplicated
prompts still draw independent samples. In "replica" mode the index is (dp rank, position in
the replica's list). The trainer's side of the logprob check is
``trainer.old_logprobs.recompute_logprobs`` (the trainer's LOGPROB stage).

Limits: cp must be 1 in the rollout layout (decoding one token at a time has nothing to split);
the model runs in eval mode during a call (its mode is restored after); an engine is bound to
the process groups its model was built with: after a regroup build a new engine. With
``reuse_prefix``, weights changed behind the engine's back (an optimizer step on a shared
model) need ``release_memory()`` or ``update_weights``, which forget the cached rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from earl_megatron.plan.rollout_rules import rollout_layout_problem
from earl_megatron.plan.specs import PREFILL_TOKENS
from earl_megatron.rollout.engine import (EngineHealth, Generation, SamplingParams, check_prompts,
                                         split_evenly)
from earl_megatron.rollout.megatron_decode import (Pipeline, host_scope, move_cached_rows,
                                                   pad_key_mask, prefill_mask, reuse_plan,
                                                   sequence_parallel_off)
from earl_megatron.rollout import routing_replay
from earl_megatron.rollout.rope_cache import forget_inference_tables
from earl_megatron.rollout.sampling import StopTracker, row_uniforms, sample_next
from earl_megatron.runtime import groups
from earl_megatron.seeds import row_sample_seed

_CACHE_ROUND = 256  # cache length granularity, so growing agent contexts rarely reallocate


class EmbeddedEngine:
    """RolloutEngine over a Megatron-Core GPTModel pp_stage (see the module docstring)."""

    streams_tokens = True   # generate(..., on_token=) hears tokens as they are sampled

    def __init__(self, on_layout, *, pad_token_id: int = 0, seed: int = 0, prompts: str = "global",
                 kv_cache: bool = True, prefill_tokens: int = PREFILL_TOKENS,
                 reuse_prefix: bool = False, record_routes: bool = False):
        problem = rollout_layout_problem(on_layout.layout, "embedded")
        if problem:
            raise ValueError(f"EmbeddedEngine: {problem}")
        if record_routes and reuse_prefix:
            raise ValueError("EmbeddedEngine: record_routes needs every prompt token's routes, "
                             "which reuse_prefix does not recompute; use one or the other")
        if prompts not in ("global", "replica"):
            raise ValueError(f"prompts must be 'global' or 'replica', got {prompts!r}")
        self.on_layout = on_layout
        self.model = on_layout.module()
        self.pad_token_id = pad_token_id
        self.prompts_mode = prompts
        self.kv_cache = kv_cache
        # rows per prefill forward = prefill_tokens // width: bounds the [rows, 1, W, W] mask
        # and bias of the prefill attention (one forward of 64 x 2K tokens would be GBs)
        self.prefill_tokens = prefill_tokens
        # keep each row's cache between calls and prefill only what a new prompt adds to it
        self.reuse_prefix = reuse_prefix and kv_cache
        # MoE routing replay: each Generation carries its tokens' experts (routing_replay.py)
        self.record_routes = record_routes
        if record_routes:
            routing_replay.routers(self.model)  # refuses a dense model, attaches the recorders
        self._rows: list[tuple[list[int], int]] = []  # per cache row: (cached tokens, 1st slot)
        self.device = groups.device()
        self._pipe = Pipeline(self.model, on_layout.cfg.hidden_size, on_layout.tcfg.params_dtype,
                               self.device)
        self._dp_group = groups.dp_group()
        # expert parallelism spans dp replicas: the MoE layer's all-to-all needs every rank of
        # the ep group in the same forward, so its replicas decode in lockstep (_agree)
        self._ep_group = groups.current_pg_collection().ep if on_layout.layout.ep > 1 else None
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._ctx = None
        self._released = False
        self._closed = False
        self.stats = {"calls": 0, "generated_tokens": 0, "seconds": 0.0, "reused_tokens": 0,
                      "steps": 0}   # steps: decode steps sampled (a token per live row each)

    # --- generation -----------------------------------------------------------------------
    # inference mode, not just no_grad: no version counters or autograd bookkeeping on the ~400
    # torch calls of a decode step. What it creates stays in the engine (the KV cache), except
    # Megatron's lru-cached rotary tables, dropped after the call (forget_inference_tables), so
    # the shared training model never meets an inference tensor.
    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 on_token: Optional[Callable[[int, int, float], None]] = None
                 ) -> list[Generation]:
        """``on_token(row in prompts, id, logprob)``: each token of this replica's rows, sampled."""
        check_prompts(prompts)
        if self._closed or self._released:
            raise RuntimeError("EmbeddedEngine.generate after close() or release_memory(); call "
                               "resume_memory() (or build a new engine) first")
        t0 = time.perf_counter()
        # Megatron takes the inference path only in eval mode; a shared training model gets its
        # mode back afterwards
        was_training = self.model.training
        self.model.eval()
        try:
            with host_scope(), sequence_parallel_off(self.model), (
                    routing_replay.recording(self.model) if self.record_routes
                    else contextlib.nullcontext()):
                out = self._generate(prompts, params, on_token)
        finally:
            self.model.train(was_training)
            forget_inference_tables()
        self.stats["calls"] += 1
        self.stats["generated_tokens"] += sum(len(g.token_ids) for g in out)
        self.stats["seconds"] += time.perf_counter() - t0
        return out

    def _generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                  on_token=None) -> list[Generation]:
        layout, dp_rank = self.on_layout.layout, self.on_layout.coords.dp
        # every rank draws the base seed, so the engine's generator stays in step on all ranks
        base = params.seed if params.seed is not None else int(
            torch.randint(2**31, (1,), generator=self._generator, device=self.device))
        if self.prompts_mode == "global" and layout.dp > 1:
            block = split_evenly(len(prompts), layout.dp)[dp_rank]
            mine = self._decode([prompts[i] for i in block], params, base, block.start,
                                on_token, block.start) if len(block) else self._idle()
            parts: list = [None] * layout.dp
            dist.all_gather_object(parts, mine, group=self._dp_group)
            out = [g for part in parts for g in part]
        else:
            first = dp_rank << 40 if self.prompts_mode == "replica" else 0
            out = self._decode(list(prompts), params, base, first, on_token) if prompts \
                else self._idle()
        return out

    # --- lockstep over the ep group (MoE with ep > 1) ----------------------------------------
    def _agree(self, n: int) -> int:
        """The largest ``n`` over the ep group (n itself without expert parallelism): how many
        prefill forwards, or whether any replica still decodes, so all run the same forwards."""
        if self._ep_group is None:
            return n
        t = torch.tensor([n], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._ep_group)
        return int(t)

    def _idle_forward(self) -> None:
        """One forward of a single pad token (no cache): this replica's part of a peer's MoE
        all-to-all while it has nothing (left) to decode."""
        ids = torch.full((1, 1), self.pad_token_id, dtype=torch.long, device=self.device)
        self._pipe.forward(ids, prefill_mask(torch.zeros(1, dtype=torch.long,
                                                         device=self.device), 1), None)

    def _idle(self) -> list[Generation]:
        """A replica without prompts: it joins its ep peers' prefill and decode forwards."""
        for _ in range(self._agree(0)):
            self._idle_forward()
        while self._agree(0):
            self._idle_forward()
        return []

    def _context(self, batch: int, length: int):
        from megatron.core.inference.contexts import StaticInferenceContext

        ctx = self._ctx
        if ctx is None or ctx.max_batch_size < batch or ctx.max_sequence_length < length:
            old_b, old_s = (ctx.max_batch_size, ctx.max_sequence_length) if ctx else (0, 0)
            need = -(-length // _CACHE_ROUND) * _CACHE_ROUND
            self._ctx = ctx = StaticInferenceContext(max(batch, old_b), max(need, old_s))
        ctx.reset()
        return ctx

    def _row_generators(self, base: int, first: int, n: int) -> list[torch.Generator]:
        """One generator per row, seeded by (call seed, global prompt index): a row's samples
        depend neither on its batch mates nor on the dp split, and duplicated prompts (a GRPO
        group) still draw independent samples."""
        return [torch.Generator(device=self.device).manual_seed(row_sample_seed(base, first + i))
                for i in range(n)]

    def _decode(self, prompts: list[Sequence[int]], params: SamplingParams, base: int,
                first: int, on_token=None, row0: int = 0) -> list[Generation]:
        dev, pipe = self.device, self._pipe
        batch, width = len(prompts), max(len(p) for p in prompts)
        uniforms = None
        if params.temperature and pipe.last:
            uniforms = row_uniforms(self._row_generators(base, first, batch),
                                    params.max_new_tokens, dev)
        ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        ids = ids.to(dev)
        pad = torch.tensor([width - len(p) for p in prompts], device=dev)
        first_slot, old = 0, None
        if self.reuse_prefix and self._rows and self._ctx is not None:
            first_slot, keep, sources = reuse_plan(self._rows, prompts, width)
            old = dict(self._ctx.key_value_memory_dict) if first_slot else None
        ctx = self._context(batch, width + params.max_new_tokens) if self.kv_cache else None
        if old:  # kept keys land unrotated: the window's forward ropes the cache by slot
            move_cached_rows(ctx, old, keep, sources, pad, pipe.rope)
            self.stats["reused_tokens"] += sum(keep)

        if ctx is None:
            for _ in range(self._agree(1) - 1):
                self._idle_forward()
            logits = pipe.forward(ids, prefill_mask(pad, width), None)
            routes = [self._grab(width, batch)] if self.record_routes else None
        else:  # prefill in row chunks: each writes its rows of the cache from first_slot
            rows, parts, chunk_routes = max(1, self.prefill_tokens // width), [], []
            chunks = -(-batch // rows)
            for _ in range(self._agree(chunks) - chunks):
                self._idle_forward()
            for r0 in range(0, batch, rows):
                ctx.sequence_len_offset, ctx.batch_size_offset = first_slot, r0
                parts.append(pipe.forward(
                    ids[r0:r0 + rows, first_slot:],
                    prefill_mask(pad[r0:r0 + rows], width, first_slot), ctx,
                    rotated=first_slot == 0))
                if self.record_routes:
                    chunk_routes.append(self._grab(width, min(rows, batch - r0)))
            ctx.batch_size_offset = 0
            routes = [torch.cat(chunk_routes, dim=2)] if self.record_routes else None
            if first_slot:  # decode steps store roped keys: rope the prefilled slots once
                pipe.rope.rotate_slots(ctx, width, batch)
            logits = torch.cat(parts) if pipe.last else None
            keys = pad_key_mask(pad, ctx.max_sequence_length)
        track = StopTracker(batch, params.stop_token_ids, dev)
        done = False
        for step in range(params.max_new_tokens):
            if not done:
                tok = lp = None
                if pipe.last:
                    tok, lp = sample_next(logits, params,
                                          None if uniforms is None else uniforms[step])
                tok, lp = pipe.broadcast_from_last(tok, lp, batch)
                live = None if on_token is None else (~track.done).tolist()
                done = track.add(tok, lp) or track.steps == params.max_new_tokens
                self.stats["steps"] += 1
                if live is not None:   # the rows still decoding before this step's token
                    for i, (t, p) in enumerate(zip(tok.tolist(), lp.tolist())):
                        live[i] and on_token(row0 + i, t, p)
            if not self._agree(int(not done)):
                break
            if done:  # finished here, a peer of the ep group still decodes
                self._idle_forward()
            elif ctx is not None:
                sk = ctx.sequence_len_offset + 1
                logits = pipe.forward(tok[:, None], keys[..., :sk], ctx)
                if self.record_routes:
                    routes.append(self._grab(1, batch))
            else:  # recompute-all: the whole sequence again, no cache (reference, benchmark)
                ids = torch.cat([ids, tok[:, None]], dim=1)
                logits = pipe.forward(ids, prefill_mask(pad, ids.shape[1]), None)
                if self.record_routes:
                    routes.append(self._grab(ids.shape[1], batch)[:, -1:])
        if self.reuse_prefix:
            # the cache holds each row's prompt and every sampled token that was fed back (all
            # but the last step's), contiguous from its first real slot; junk after a stop
            # is never part of a later prefix
            fed, tokens = track.steps - 1, track.token_lists()
            self._rows = [(list(p) + tokens[i][:min(n, fed)], int(pad[i]))
                          for i, (p, n) in enumerate(zip(prompts, track.lengths.tolist()))]
        if not self.record_routes:
            return track.generations()
        return self._with_routes(track.generations(), torch.cat(routes, dim=1), pad, width)

    # --- routing replay (MoE) ---------------------------------------------------------------
    def _grab(self, s: int, b: int) -> torch.Tensor:
        """The last forward's experts on this pp_stage: [local layers, s, b, topk] (the router
        flattens its [s, b] input s-major)."""
        got = routing_replay.recorded(self.model)
        return torch.stack(got).view(len(got), s, b, -1).to(torch.int16)

    def _with_routes(self, gens: list[Generation], routes: torch.Tensor, pad: torch.Tensor,
                     width: int) -> list[Generation]:
        """Each row's routes, [tokens fed, layers, topk]: slots pad_i .. width + n_i - 2 of
        ``routes`` [local layers, slots, B, topk], all pp_stages' layers in order."""
        if self._pipe.pp > 1:
            parts: list = [None] * self._pipe.pp
            dist.all_gather_object(parts, routes.cpu(), group=self._pipe.pp_group)
            routes = torch.cat(parts)
        routes = routes.permute(2, 1, 0, 3)  # [B, slots, layers, topk]
        return [dataclasses.replace(g, routes=routes[i, int(pad[i]):width + len(g.token_ids) - 1]
                                    .cpu().clone())
                for i, g in enumerate(gens)]

    # --- weights and memory ---------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, source: Any) -> None:
        """Load weights from a full-weights dict (global Megatron names) or a live model.

        A live model (a ModelOnLayout, or a GPTModel / DDP wrapper of one) in the SAME layout is
        copied parameter by parameter, locally. A ModelOnLayout in another layout sends each
        rank the rows of its shard it lacks, point to point (runtime/weight_transfer.py
        ``load_shards``: the weight plan's ``ShardsIn``; collective over the world, no full
        tensor anywhere). Every rank calls it.
        """
        from earl_megatron.models.sharding import load_full_weights, unwrap
        from earl_megatron.runtime.weight_transfer import load_shards

        on_layout = self.on_layout
        self._rows = []  # cached keys/values belong to the old weights
        if hasattr(source, "layout") and hasattr(source, "model"):
            if source.layout == on_layout.layout:
                source = source.module()
            else:
                load_shards(source, on_layout)
                return
        if isinstance(source, torch.nn.Module):
            source = unwrap(source)
            src = dict(source.named_parameters())
            dst = dict(self.model.named_parameters())
            if src.keys() != dst.keys() or any(src[k].shape != dst[k].shape for k in dst):
                raise ValueError("the live model's parameters do not match this engine's pp_stage "
                                 "(different layout or config); pass its ModelOnLayout, or a "
                                 "full-weights dict (global Megatron names)")
            for k, p in dst.items():
                p.copy_(src[k])
        elif isinstance(source, dict):
            load_full_weights(self.model, source, on_layout.cfg, on_layout.layout, on_layout.coords)
        else:
            raise TypeError(f"EmbeddedEngine.update_weights takes a full-weights dict, a "
                            f"ModelOnLayout or a GPTModel, got {type(source).__name__}")

    def release_memory(self) -> None:
        """Drop the KV cache (weights stay: in the embedded engine they are the policy's)."""
        self._ctx, self._rows = None, []
        self._released = True

    def resume_memory(self) -> None:
        self._released = False

    def kv_cache_bytes(self) -> int:
        if self._ctx is None:
            return 0
        return sum(t.numel() * t.element_size()
                   for kv in self._ctx.key_value_memory_dict.values() for t in kv)

    def health(self) -> EngineHealth:
        state = "closed" if self._closed else "released" if self._released else "ready"
        return EngineHealth(healthy=state == "ready", detail=state, extra={
            "layout": str(self.on_layout.layout), "coords": vars(self.on_layout.coords),
            "kv_cache": self.kv_cache, "kv_cache_bytes": self.kv_cache_bytes(),
            "parameters": sum(p.numel() for p in self.model.parameters()), **self.stats})

    def close(self) -> None:
        self._ctx, self._rows = None, []
        self._closed = True
