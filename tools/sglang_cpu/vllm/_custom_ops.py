"""``vllm._custom_ops.rotary_embedding`` in plain torch, for SGLang on a machine without vllm.

Contract (vllm's): rotate ``query`` and ``key`` in place by the rotary angles of ``positions``.
``cos_sin_cache`` is [max_position, rot_dim] with cos in the first half and sin in the second;
only the first ``rot_dim`` channels of each head rotate. ``is_neox``: the channels pair as
(i, i + rot_dim/2) (GPT-NeoX / Llama style); otherwise as neighbours (2i, 2i + 1) (GPT-J).
Computed in fp32 and written back in the tensors' dtype.
"""
import torch


def _rotate(x, cos, sin, head_size: int, is_neox: bool) -> None:
    if x is None or x.numel() == 0:
        return
    heads = x.view(cos.shape[0], -1, head_size)
    rot = 2 * cos.shape[-1]
    part = heads[..., :rot].float()
    c, s = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    if is_neox:
        a, b = part[..., :rot // 2], part[..., rot // 2:]
        rotated = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    else:
        a, b = part[..., 0::2], part[..., 1::2]
        rotated = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    heads[..., :rot] = rotated.to(x.dtype)


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    flat = positions.reshape(-1)
    cos, sin = cos_sin_cache.index_select(0, flat).chunk(2, dim=-1)
    for x in (query, key):
        if x is not None and not x.is_contiguous():
            raise ValueError("rotary_embedding stand-in rotates in place: pass contiguous "
                             "query/key tensors")
        _rotate(x, cos, sin, head_size, is_neox)
