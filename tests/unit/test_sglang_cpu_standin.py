"""tools/sglang_cpu/vllm: the rotary op SGLang's CPU path imports, against complex rotation."""

import importlib.util
from pathlib import Path

import pytest
import torch

OPS = Path(__file__).resolve().parents[2] / "tools" / "sglang_cpu" / "vllm" / "_custom_ops.py"


def _ops():
    spec = importlib.util.spec_from_file_location("standin_ops", OPS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cache(max_pos: int, rot: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).float(), ang


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_equals_complex_rotation(is_neox):
    torch.manual_seed(0)
    tokens, heads, kv_heads, head_size, rot = 5, 4, 2, 16, 8
    cache, ang = _cache(32, rot)
    pos = torch.tensor([0, 3, 7, 7, 31])
    q = torch.randn(tokens, heads * head_size)
    k = torch.randn(tokens, kv_heads * head_size)
    q0, k0 = q.clone(), k.clone()
    _ops().rotary_embedding(pos, q, k, head_size, cache, is_neox)
    for before, after, n in ((q0, q, heads), (k0, k, kv_heads)):
        x = before.view(tokens, n, head_size).double()
        part = x[..., :rot]
        if is_neox:
            z = torch.complex(part[..., :rot // 2], part[..., rot // 2:])
        else:
            z = torch.complex(part[..., 0::2], part[..., 1::2])
        z = z * torch.polar(torch.ones_like(ang[pos]), ang[pos])[:, None, :]
        want = torch.cat([z.real, z.imag], -1) if is_neox else \
            torch.stack([z.real, z.imag], -1).flatten(-2)
        got = after.view(tokens, n, head_size).double()
        assert torch.allclose(got[..., :rot], want, atol=1e-5)
        assert torch.equal(got[..., rot:], x[..., rot:])  # channels past rot_dim untouched
