"""Rotated keys in the static KV cache: rope once per token instead of once per step.

Megatron's ``StaticInferenceContext`` has two ways to store keys (attention.py,
``_adjust_key_value_for_inference``):

    default            cache holds keys BEFORE rope; every forward ropes the whole cache
                       k[:sk] by slot: O(cache) work per layer and step (at 64 rows x 384 slots,
                       more than the attention itself)
    config.flash_decode the new tokens' queries and keys are roped with precomputed cos/sin
                       (``get_cos_sin(max_sequence_length)``) BEFORE they are stored; nothing
                       else is roped; core attention then runs as usual, with the engine's mask

``rotated_keys(config)`` turns the second on for the engine's forwards (training builds no
inference context, so it never sees the switch). Two limits of that path, handled here:

- Its rope goes through flash-attn's rotary kernel (``rope_utils.apply_rotary_emb_flash``);
  without flash-attn Megatron 0.16 falls back to feeding the cos/sin VALUES to its own rope as
  if they were angles (cos(cos x)): wrong numbers, no error. Where the kernel is missing the
  scope installs ``HostRotary``, the kernel's contract in plain torch (and restores the
  module attribute on exit); with flash-attn installed, its kernel is used.
- Only a forward at slot 0 (prefill) or of ONE token (decode) slices cos/sin right; a forward
  of N > 1 tokens at slot > 0 (prefix reuse's window) would rope all N at the last slot. That
  forward runs with the default path instead, on an unrotated cache: the kept keys are
  unrotated as they are moved (``CacheRope.rotate(..., inverse=True)``), the window runs, and
  ``rotate_slots`` rotates slots [0, width) once. Two passes over the kept keys per call instead of one per step;
  rotation and its inverse agree to fp32 rounding.

The decode steps never call ``enable_decode_mode()``, so Megatron never takes its
flash_attn_with_kvcache branch (CUDA only, and blind to the pad mask that left-padded rows
need); with it off, ``flash_decode`` only changes where rope happens.
"""

from __future__ import annotations

import contextlib

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            interleaved: bool) -> torch.Tensor:
    """Rotate the first 2 * cos.shape[-1] dims of ``x`` (cos/sin broadcast to x[..., :rd/2])."""
    rd = 2 * cos.shape[-1]
    if interleaved:
        x1, x2 = x[..., 0:rd:2], x[..., 1:rd:2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = x[..., :rd // 2], x[..., rd // 2:rd]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out if rd == x.shape[-1] else torch.cat((out, x[..., rd:]), dim=-1)


class HostRotary:
    """flash_attn.layers.rotary.apply_rotary_emb's contract (no offsets) in plain torch: x
    [b, s, h, d], cos and sin [>= s, rd / 2]; positions 0..s-1 of cos/sin rotate the first rd
    dims of x. One instance per forward: a decode step (s = 1) ropes every layer's queries and
    keys at the same position, so it builds that position's [d, d] rotation matrix once and
    applies it as one matmul per call (instead of ~13 elementwise ops)."""

    def __init__(self):
        self._last: tuple = ()  # (cos, sin, interleaved, d, dtype, matrix); refs keep storage

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool = False, inplace: bool = False, **_) -> torch.Tensor:
        s = x.shape[1]
        if s == 1:
            out = torch.matmul(x, self._matrix(cos, sin, interleaved, x.shape[-1], x.dtype))
        else:
            out = _rotate(x, cos[:s, None, :].to(x.dtype), sin[:s, None, :].to(x.dtype),
                          interleaved)
        return x.copy_(out) if inplace else out

    def _matrix(self, cos, sin, interleaved: bool, d: int, dtype) -> torch.Tensor:
        last = self._last
        if last and last[2:5] == (interleaved, d, dtype) and all(
                a.data_ptr() == b.data_ptr() and a.shape == b.shape
                for a, b in ((last[0], cos), (last[1], sin))):
            return last[5]
        half = cos.shape[-1]
        c, sn = cos[0].to(dtype), sin[0].to(dtype)
        i = torch.arange(0, 2 * half, 2) if interleaved else torch.arange(half)
        j = i + 1 if interleaved else i + half
        # out = x @ R: out[i] = x[i] c - x[j] s, out[j] = x[j] c + x[i] s; dims >= rd pass
        m = torch.eye(d, dtype=dtype, device=cos.device)
        m[i, i], m[j, j], m[j, i], m[i, j] = c, c, -sn, sn
        self._last = (cos, sin, interleaved, d, dtype, m)
        return m


@contextlib.contextmanager
def rotated_keys(config):
    """Megatron's rope-before-store path (module docstring) for the forwards in this scope."""
    from megatron.core.models.common.embeddings import rope_utils

    saved = config.flash_decode, rope_utils.apply_rotary_emb_flash
    config.flash_decode = True
    if rope_utils.apply_rotary_emb_flash is None:
        rope_utils.apply_rotary_emb_flash = HostRotary()
    try:
        yield
    finally:
        config.flash_decode, rope_utils.apply_rotary_emb_flash = saved


class CacheRope:
    """Rotations of cached keys [slots, rows, groups, hn] by slot, from the model's own table."""

    def __init__(self, model):
        self.rotary = model.rotary_pos_emb
        self.interleaved = model.config.rotary_interleaved
        self._table: tuple[int, torch.Tensor, torch.Tensor] = (0, None, None)

    def _cos_sin(self, length: int):
        if self._table[0] < length:
            cos, sin = self.rotary.get_cos_sin(length)
            self._table = (length, cos, sin)
        return self._table[1], self._table[2]

    def rotate(self, keys: torch.Tensor, first_slot: int, inverse: bool = False) -> torch.Tensor:
        """``keys`` [n, ...] at slots first_slot .. first_slot + n - 1, rotated (or unrotated)."""
        n = keys.shape[0]
        cos, sin = self._cos_sin(first_slot + n)
        cos = cos[first_slot:first_slot + n, None, None, :].to(keys.dtype)
        sin = sin[first_slot:first_slot + n, None, None, :].to(keys.dtype)
        return _rotate(keys, cos, -sin if inverse else sin, self.interleaved)

    def rotate_slots(self, ctx, width: int, rows: int) -> None:
        """Rotate slots [0, width) of rows [0, rows) of every layer's cached keys in place."""
        for k, _ in ctx.key_value_memory_dict.values():
            k[:width, :rows] = self.rotate(k[:width, :rows], 0)


def forget_inference_tables() -> None:
    """Drop Megatron's lru-cached rotary tables (``RotaryEmbedding.forward``, keyed by length).

    A table built during a generate call (prefix reuse's window, the recompute-all path) is an
    inference-mode tensor; a training forward of the same length would get it from the cache,
    and a rope kernel that saves its table for backward (TransformerEngine's fused rope) would
    then fail. Training rebuilds its own after this (a few small ops)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    forward = RotaryEmbedding.forward
    if hasattr(forward, "cache_clear") and forward.cache_info().currsize:
        forward.cache_clear()
