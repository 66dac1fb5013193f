"""The embedded rollout engine: Megatron-Core's own GPTModel in the rollout layout, with a KV cache.

``EmbeddedEngine(mol)`` serves the ``RolloutEngine`` interface from a ``ModelOnLayout`` built
with ``build_on_layout(cfg, layout, weights=..., ddp=False)``. Every rank of the world calls
``generate`` collectively (SPMD) with the same arguments.

Decoding (one model replica, i.e. one dp index):

    prompts   [a b c]      left-padded to the batch width    P P a b c     (P = pad_token_id)
              [d e f g h]                                    d e f g h
    prefill:  forwards over [rows, width] (rows = prefill_tokens // width, to bound the
              attention scores; the context's batch_size_offset places each chunk) with a
              boolean mask [rows, 1, width, width] that is causal and hides pad keys (a pad query
              sees only itself, so no row is all-masked); Megatron's StaticInferenceContext
              stores K/V of every layer at slots 0..width-1.
    decode:   one forward per new token, input [B, 1], mask [B, 1, 1, sk] hiding pad keys;
              ``increment_sequence_len_offset`` advances the cache slot after every forward.

Prefix reuse (``reuse_prefix=True``, for multi-turn agents whose next prompt is the previous
prompt + sampled tokens + the environment's answer): the cache survives between calls; each new
prompt is matched to the cached row it extends, the kept keys/values are copied into the slots
a fresh left-padded prefill would give them, and only the last N slots are computed (N = the
most tokens any row adds; a prompt that extends nothing counts whole). Exact, because the
static context stores keys before rope and applies rope by slot at every step: moving a
contiguous run of slots keeps every relative distance. Tested: same episodes as without reuse.

Rotary embeddings in the static context are taken at the cache slot, so a row shifted right by
its padding sees every real query/key pair at the same relative distance as alone: rope is
relative, and the test "batched == one at a time" checks it. Finished rows keep decoding (their
tokens are dropped) until every row has stopped, so the batch never changes shape.

Pipeline parallelism (pp > 1): hidden states [s, B, h] go pp_stage -> pp_stage + 1 with
Megatron's inference p2p helpers on the pp group; the last pp_stage gets full-vocabulary logits
(``runtime_gather_output=True`` gathers the TP shards), samples, and broadcasts (token, logprob)
back over the pp group, so every rank of the replica holds the same tokens and feeds the next
step. Every TP rank of the last pp_stage samples from bit-identical gathered logits with an
identically seeded generator, so they draw the same token without another collective.

Data parallelism: dp replicas are independent engines; no collective crosses dp while decoding.

    prompts="global" (default): every rank passes the SAME prompt list; replica r decodes the
        contiguous block r (sizes differ by at most one, the first replicas take the extra), and
        the results are all-gathered over dp: every rank returns all generations in prompt order.
        dp=2, prompts ABCDE: replica 0 decodes ABC, replica 1 decodes DE; every rank returns ABCDE.
    prompts="replica": the ranks of one replica pass the same list and other replicas pass their
        own (each runs its own agent loop); every rank returns its replica's generations.

Sampling follows engine.py (logprob = log_softmax(logits / T) before top-p) through
``hf_engine.sample_next``, one generator per row seeded by (call seed, global prompt index); the
call seed is ``params.seed`` or, when None, drawn from the engine's own generator on every rank
alike. So a row's samples do not depend on its batch mates or on the dp split (a dp2 rollout
samples what a tp2 one does, to rounding of the logits), and duplicated prompts still draw
independent samples. In "replica" mode the index is (dp rank, position in the replica's list).

``recompute_logprobs(mol, sequences)`` is the trainer's side of the consistency check: a plain
forward (no cache, no padding effects) over Megatron's forward-only pipeline schedule, with
vocab-parallel cross entropy on the TP-sharded logits. Its values must equal the engine's to
~1e-5 in fp32 (the test asserts 1e-4).

Limits: cp must be 1 in the rollout layout (decoding one token at a time has nothing to split);
the model runs in eval mode during a call (its mode is restored after); an engine is bound to
the process groups its model was built with: after a regroup build a new engine. With
``reuse_prefix``, weights changed behind the engine's back (an optimizer step on a shared
model) need ``release_memory()`` or ``update_weights``, which forget the cached rows.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from earl_megatron.rollout.engine import (EngineHealth, Generation, SamplingParams, check_prompts,
                                         split_evenly)
from earl_megatron.rollout.hf_engine import sample_next
from earl_megatron.runtime import groups

_CACHE_ROUND = 256  # cache length granularity, so growing agent contexts rarely reallocate


split_over_dp = split_evenly
"""Contiguous blocks of prompts over dp replicas (engine.split_evenly)."""


def _prefill_mask(pad: torch.Tensor, width: int, first_slot: int = 0) -> torch.Tensor:
    """[B, 1, width - first_slot, width] bool, True = hidden, for queries at slots first_slot..
    width-1: causal, pad keys hidden, a query's own slot always open."""
    k = torch.arange(width, device=pad.device)
    q = k[first_slot:]
    causal = k[None, :] > q[:, None]
    pad_key = k[None, None, :] < pad[:, None, None]
    own = k[None, :] == q[:, None]
    return ((causal[None] | pad_key) & ~own[None])[:, None]


def _decode_mask(pad: torch.Tensor, sk: int) -> torch.Tensor:
    """[B, 1, 1, sk] bool: hide the pad keys of each row."""
    return (torch.arange(sk, device=pad.device)[None, :] < pad[:, None])[:, None, None, :]


class _Pipeline:
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

    @property
    def first(self) -> bool:
        return self.pp_rank == 0

    @property
    def last(self) -> bool:
        return self.pp_rank == self.pp - 1

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, ctx=None) -> Optional[torch.Tensor]:
        from megatron.core.inference.communication_utils import (
            recv_from_prev_pipeline_rank_, send_to_next_pipeline_rank)

        b, s = ids.shape
        if not self.first:
            buf = torch.empty(s, b, self.hidden_size, dtype=self.dtype, device=self.device)
            recv_from_prev_pipeline_rank_(buf, pp_group=self.pp_group)
            self.model.set_input_tensor(buf)
        pos = torch.arange(s, device=self.device)[None].expand(b, s)
        if ctx is not None:
            pos = pos + ctx.sequence_len_offset
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


class EmbeddedEngine:
    """RolloutEngine over a Megatron-Core GPTModel pp_stage (see the module docstring)."""

    def __init__(self, mol, *, pad_token_id: int = 0, seed: int = 0, prompts: str = "global",
                 kv_cache: bool = True, prefill_tokens: int = 16384, reuse_prefix: bool = False):
        if mol.layout.cp != 1:
            raise ValueError(f"EmbeddedEngine needs cp=1 in the rollout layout, got {mol.layout}; "
                             "decode with a layout whose cp is 1 (spend those ranks on tp or dp)")
        if prompts not in ("global", "replica"):
            raise ValueError(f"prompts must be 'global' or 'replica', got {prompts!r}")
        self.mol = mol
        self.model = mol.module()
        self.pad_token_id = pad_token_id
        self.prompts_mode = prompts
        self.kv_cache = kv_cache
        # rows per prefill forward = prefill_tokens // width: bounds the [rows, heads, W, W]
        # attention scores of the unfused attention (one forward of 64 x 2K tokens would be GBs)
        self.prefill_tokens = prefill_tokens
        # keep each row's cache between calls and prefill only what a new prompt adds to it
        self.reuse_prefix = reuse_prefix and kv_cache
        self._rows: list[tuple[list[int], int]] = []  # per cache row: (cached tokens, 1st slot)
        self.device = groups.device()
        self._pipe = _Pipeline(self.model, mol.cfg.hidden_size, mol.tcfg.params_dtype,
                               self.device)
        self._dp_group = groups.dp_group()
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._ctx = None
        self._released = False
        self._closed = False
        self.stats = {"calls": 0, "generated_tokens": 0, "seconds": 0.0, "reused_tokens": 0}

    # --- generation -----------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams) -> list[Generation]:
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
            out = self._generate(prompts, params)
        finally:
            self.model.train(was_training)
        self.stats["calls"] += 1
        self.stats["generated_tokens"] += sum(len(g.token_ids) for g in out)
        self.stats["seconds"] += time.perf_counter() - t0
        return out

    def _generate(self, prompts: Sequence[Sequence[int]],
                  params: SamplingParams) -> list[Generation]:
        layout, dp_rank = self.mol.layout, self.mol.coords.dp
        # every rank draws the base seed, so the engine's generator stays in step on all ranks
        base = params.seed if params.seed is not None else int(
            torch.randint(2**31, (1,), generator=self._generator, device=self.device))
        if self.prompts_mode == "global" and layout.dp > 1:
            block = split_over_dp(len(prompts), layout.dp)[dp_rank]
            mine = self._decode([prompts[i] for i in block], params,
                                base, block.start) if len(block) else []
            parts: list = [None] * layout.dp
            dist.all_gather_object(parts, mine, group=self._dp_group)
            out = [g for part in parts for g in part]
        else:
            first = dp_rank << 40 if self.prompts_mode == "replica" else 0
            out = self._decode(list(prompts), params, base, first) if prompts else []
        return out

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
        return [torch.Generator(device=self.device).manual_seed(
            (base * 1_000_003 + first + i) % (2**63 - 1)) for i in range(n)]

    def _reuse_plan(self, prompts: list[Sequence[int]], width: int):
        """Which cached row each prompt extends, and the first slot that must be computed.

        The new cache is laid out exactly as a fresh left-padded prefill of ``width`` would be
        (row j's tokens end at slot width-1). Prompt j extends cached row r when r's tokens are
        a proper prefix of it; every row recomputes the last N slots, N = the largest number of
        tokens any row must compute (all of a prompt that extends nothing), and keeps the first
        ``len(p) - N`` tokens' keys/values from its source row.
        """
        sources = []
        for p in prompts:
            best = None
            for r, (toks, start) in enumerate(self._rows):
                c = len(toks)
                if c < len(p) and (best is None or c > best[1]) and list(p[:c]) == toks:
                    best = (r, c, start)
            sources.append(best)
        window = max(len(p) - (m[1] if m else 0) for p, m in zip(prompts, sources))
        keep = [max(0, len(p) - window) for p in prompts]
        return width - window, keep, sources

    @staticmethod
    def _move_cached_rows(ctx, old: dict, keep: list[int], sources: list, pad) -> None:
        """Copy kept keys/values into a fresh cache laid out for this call (exact: the static
        context stores keys before rope and applies rope by slot at every step, so moving a
        contiguous run of slots keeps every relative distance)."""
        pad = pad.tolist()
        for layer, (k_old, v_old) in old.items():
            k_new = k_old.new_zeros((ctx.max_sequence_length, ctx.max_batch_size,
                                     *k_old.shape[2:]))
            v_new = v_old.new_zeros((ctx.max_sequence_length, ctx.max_batch_size,
                                     *v_old.shape[2:]))
            for j, (n, src) in enumerate(zip(keep, sources)):
                if n:
                    r, _, start = src
                    k_new[pad[j]:pad[j] + n, j] = k_old[start:start + n, r]
                    v_new[pad[j]:pad[j] + n, j] = v_old[start:start + n, r]
            ctx.key_value_memory_dict[layer] = (k_new, v_new)

    def _decode(self, prompts: list[Sequence[int]], params: SamplingParams, base: int,
                first: int) -> list[Generation]:
        dev = self.device
        gens = self._row_generators(base, first, len(prompts)) if params.temperature else None
        batch, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        ids = ids.to(dev)
        pad = torch.tensor([width - len(p) for p in prompts], device=dev)
        stop = torch.tensor(list(params.stop_token_ids) or [-1], device=dev)
        pipe = self._pipe
        first_slot, old = 0, None
        if self.reuse_prefix and self._rows and self._ctx is not None:
            first_slot, keep, sources = self._reuse_plan(prompts, width)
            old = dict(self._ctx.key_value_memory_dict) if first_slot else None
        ctx = self._context(batch, width + params.max_new_tokens) if self.kv_cache else None
        if old:
            self._move_cached_rows(ctx, old, keep, sources, pad)
            self.stats["reused_tokens"] += sum(keep)

        if ctx is None:
            logits = pipe.forward(ids, _prefill_mask(pad, width), None)
        else:  # prefill in row chunks: each writes its rows of the cache from first_slot
            rows, parts = max(1, self.prefill_tokens // width), []
            for r0 in range(0, batch, rows):
                ctx.sequence_len_offset, ctx.batch_size_offset = first_slot, r0
                parts.append(pipe.forward(
                    ids[r0:r0 + rows, first_slot:],
                    _prefill_mask(pad[r0:r0 + rows], width, first_slot), ctx))
            ctx.batch_size_offset = 0
            logits = torch.cat(parts) if pipe.last else None
        tokens_out, logprobs_out = [], []
        done = torch.zeros(batch, dtype=torch.bool, device=dev)
        stopped = torch.zeros(batch, dtype=torch.bool, device=dev)
        lengths = torch.zeros(batch, dtype=torch.long, device=dev)
        for _ in range(params.max_new_tokens):
            tok = lp = None
            if pipe.last and gens is None:
                tok, lp = sample_next(logits, params, None)  # greedy: no randomness
            elif pipe.last:
                drawn = [sample_next(logits[i:i + 1], params, g) for i, g in enumerate(gens)]
                tok, lp = torch.cat([t for t, _ in drawn]), torch.cat([x for _, x in drawn])
            tok, lp = pipe.broadcast_from_last(tok, lp, batch)
            tokens_out.append(tok)
            logprobs_out.append(lp)
            lengths += (~done).long()
            hit = torch.isin(tok, stop) & ~done
            stopped |= hit
            done |= hit
            if bool(done.all()) or len(tokens_out) == params.max_new_tokens:
                break
            if ctx is not None:
                sk = ctx.sequence_len_offset + 1
                logits = pipe.forward(tok[:, None], _decode_mask(pad, sk), ctx)
            else:  # recompute-all: the whole sequence again, no cache (reference and benchmark)
                ids = torch.cat([ids, tok[:, None]], dim=1)
                logits = pipe.forward(ids, _prefill_mask(pad, ids.shape[1]), None)
        tokens = torch.stack(tokens_out, dim=1).tolist()
        logprobs = torch.stack(logprobs_out, dim=1).tolist()
        if self.reuse_prefix:
            # the cache holds each row's prompt and every sampled token that was fed back (all
            # but the last step's), contiguous from its first real slot; junk after a stop
            # is never part of a later prefix
            fed = len(tokens_out) - 1
            self._rows = [(list(p) + tokens[i][:min(n, fed)], int(pad[i]))
                          for i, (p, n) in enumerate(zip(prompts, lengths.tolist()))]
        return [Generation(token_ids=tuple(tokens[i][:n]), logprobs=tuple(logprobs[i][:n]),
                           finish_reason="stop" if stopped[i] else "length")
                for i, n in enumerate(lengths.tolist())]

    # --- weights and memory ---------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, source: Any) -> None:
        """Load weights from a full-weights dict (global Megatron names) or a live model.

        A live model (a ModelOnLayout, or a GPTModel / DDP wrapper of one) in the SAME layout is
        copied parameter by parameter, locally. A ModelOnLayout in another layout is gathered to
        full tensors first (``gather_full``: collective over the world, small models only; the
        switcher reshards large ones in memory). Every rank calls it.
        """
        from earl_megatron.weights.gather import gather_full
        from earl_megatron.models.sharding import load_full_weights

        mol = self.mol
        self._rows = []  # cached keys/values belong to the old weights
        if hasattr(source, "layout") and hasattr(source, "model"):
            if source.layout == mol.layout:
                source = source.module()
            else:
                source = gather_full(source.model, source.cfg, source.layout)
        if isinstance(source, torch.nn.Module):
            while hasattr(source, "module"):
                source = source.module
            src = dict(source.named_parameters())
            dst = dict(self.model.named_parameters())
            if src.keys() != dst.keys() or any(src[k].shape != dst[k].shape for k in dst):
                raise ValueError("the live model's parameters do not match this engine's pp_stage "
                                 "(different layout or config); pass its ModelOnLayout, or a "
                                 "full-weights dict from weights.gather.gather_full")
            for k, p in dst.items():
                p.copy_(src[k])
        elif isinstance(source, dict):
            load_full_weights(self.model, source, mol.cfg, mol.layout, mol.coords)
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
            "layout": str(self.mol.layout), "coords": vars(self.mol.coords),
            "kv_cache": self.kv_cache, "kv_cache_bytes": self.kv_cache_bytes(),
            "parameters": sum(p.numel() for p in self.model.parameters()), **self.stats})

    def close(self) -> None:
        self._ctx, self._rows = None, []
        self._closed = True


@torch.no_grad()
def recompute_logprobs(mol, sequences: Sequence[Sequence[int]], *, temperature: float = 1.0,
                       micro_batch_size: int = 1, pad_token_id: int = 0) -> list[list[float]]:
    """Per-token logprobs of whole sequences under ``mol`` (any layout, DDP-wrapped or not).

    Returns, for every sequence, ``len(seq)`` values: entry j is log p(seq[j] | seq[:j]) at
    ``temperature`` (log_softmax(logits / T)); entry 0 has no context and is 0.0, which aligns
    the result with ``Episode.logprobs``. Every rank passes the same sequences and gets all
    results: dp replicas take contiguous blocks and all-gather; cp ranks take the load-balanced
    token split and all-gather. Right padding (to the longest sequence, a multiple of 2*cp)
    cannot change earlier tokens under the causal mask.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from earl_megatron.models.cp_attention import zigzag_positions

    check_prompts(sequences)
    layout, coords = mol.layout, mol.coords
    if temperature <= 0:
        temperature = 1.0  # greedy decoding reports logprobs at T=1 (engine.py)
    block = list(split_over_dp(len(sequences), layout.dp)[coords.dp])
    local = [list(sequences[i]) for i in block]
    n_real = len(local)
    mbs = max(1, min(micro_batch_size, n_real or 1))
    while len(local) == 0 or len(local) % mbs:
        local.append([pad_token_id])  # filler rows: every replica runs whole micro-batches
    seq = max(len(s) for s in local) - 1
    seq = max(seq, 1)
    seq = -(-seq // (2 * layout.cp)) * (2 * layout.cp) if layout.cp > 1 else seq
    tokens = torch.full((len(local), seq + 1), pad_token_id, dtype=torch.long)
    for i, s in enumerate(local):
        tokens[i, :len(s)] = torch.tensor(s)
    dev = groups.device()
    tokens = tokens.to(dev)
    pos = zigzag_positions(seq, layout.cp, coords.cp, device=dev)
    inputs, labels = tokens[:, :-1][:, pos], tokens[:, 1:][:, pos]
    mbs_list = [dict(input_ids=inputs[m:m + mbs], labels=labels[m:m + mbs],
                     position_ids=pos[None].expand(len(inputs[m:m + mbs]), -1))
                for m in range(0, len(local), mbs)]
    it = iter(mbs_list)

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        logits = model(mb["input_ids"], mb["position_ids"], None)  # [b, s, V/tp]

        def collect(out):
            nll = vocab_parallel_cross_entropy(
                (out.float().transpose(0, 1) / temperature).contiguous(),
                mb["labels"].transpose(0, 1).contiguous())
            lp = -nll.transpose(0, 1)  # [b, s_local]
            return lp.sum() * 0.0, torch.tensor(0, dtype=torch.int, device=dev), {"logprobs": lp}
        return logits, collect

    was_training = mol.module().training
    mol.module().eval()
    fb = get_forward_backward_func()
    stored = fb(forward_step_func=forward_step, data_iterator=it, model=[mol.model],
                num_microbatches=len(mbs_list), seq_length=seq // layout.cp,
                micro_batch_size=mbs, forward_only=True)
    if was_training:
        mol.module().train()
    # last pp_stage -> every pp_stage; then the cp shards -> full sequences; then dp blocks
    local_lp = torch.empty(len(local), seq // layout.cp, dtype=torch.float32, device=dev)
    if groups.is_pipeline_last_stage():
        local_lp = torch.cat([d["logprobs"] for d in stored], dim=0).float()
    if layout.pp > 1:
        pp_ranks = dist.get_process_group_ranks(groups.pp_group())
        dist.broadcast(local_lp, src=pp_ranks[-1], group=groups.pp_group())
    full = torch.empty(len(local), seq, dtype=torch.float32, device=dev)
    if layout.cp > 1:
        parts = [torch.empty_like(local_lp) for _ in range(layout.cp)]
        dist.all_gather(parts, local_lp.contiguous(), group=groups.cp_group())
        for r, part in enumerate(parts):
            full[:, zigzag_positions(seq, layout.cp, r, device=dev)] = part
    else:
        full = local_lp
    full = full.cpu()
    mine = [[0.0] + full[i, :len(s) - 1].tolist() for i, s in enumerate(local[:n_real])]
    if layout.dp == 1:
        return mine
    everything: list = [None] * layout.dp
    dist.all_gather_object(everything, mine, group=groups.dp_group())
    return [lp for part in everything for lp in part]
