"""The embedded engine's decode kernels equal Megatron's reference math.

- ``InferenceAttention`` (models/inference_attention.py): in eval mode with a mask, GQA decode
  (sq = 1) and SDPA prefill equal ``DotProductAttention`` to fp32 rounding; in training mode
  and without a mask it IS DotProductAttention (bitwise).
- ``HostRotary`` (rollout/rope_cache.py), flash-attn's rotary contract fed the cos/sin table of
  Megatron's flash-decode path, equals Megatron's own rope on the same positions, at one
  position (the matrix path) and many; ``CacheRope`` unrotation undoes rotation.
One spawned rank (DotProductAttention needs Megatron's process groups).
"""

from earl_megatron.testing.multiproc import run_distributed


def _check():
    from earl_megatron.runtime.cpu_backend import cpu_backend

    with cpu_backend():
        return _compare()


def _compare():
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from earl_megatron.models.inference_attention import InferenceAttention
    from earl_megatron.rollout.megatron_decode import pad_key_mask, prefill_mask
    from earl_megatron.rollout.rope_cache import CacheRope, HostRotary

    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1)  # DotProductAttention forks the RNG in training mode
    torch.manual_seed(0)
    heads, groups, hn, b = 6, 2, 16, 3
    tc = TransformerConfig(num_layers=1, hidden_size=heads * hn, num_attention_heads=heads,
                           num_query_groups=groups, use_cpu_initialization=True,
                           attention_dropout=0.0, masked_softmax_fusion=False)
    ref = DotProductAttention(tc, layer_number=1, attn_mask_type=AttnMaskType.causal,
                              attention_type="self").eval()
    fused = InferenceAttention(tc, layer_number=1, attn_mask_type=AttnMaskType.causal,
                               attention_type="self").eval()
    pad = torch.tensor([0, 2, 5])
    out = {}
    with torch.no_grad():
        sk = 9
        k, v = torch.randn(sk, b, groups, hn), torch.randn(sk, b, groups, hn)
        q1 = torch.randn(1, b, heads, hn)
        m1 = pad_key_mask(pad, 16)[..., :sk]
        out["decode"] = (fused(q1, k, v, m1) - ref(q1, k, v, m1)).abs().max().item()
        qp = torch.randn(sk, b, heads, hn)
        mp = prefill_mask(pad, sk)
        out["prefill"] = (fused(qp, k, v, mp) - ref(qp, k, v, mp)).abs().max().item()
        out["no_mask_same"] = torch.equal(fused(qp, k, v, None), ref(qp, k, v, None))
        fused.train(), ref.train()
        out["train_same"] = torch.equal(fused(qp, k, v, mp), ref(qp, k, v, mp))

        rope = RotaryEmbedding(hn, rotary_percent=1.0, rotary_base=10000)
        cos, sin = rope.get_cos_sin(32)
        freqs = rope(32)  # [32, 1, 1, hn], Megatron's standard rope table
        x = torch.randn(b, 7, heads, hn)  # flash-attn layout [b, s, h, d]
        want = _apply_rotary_pos_emb_bshd(x.transpose(0, 1), freqs[:7]).transpose(0, 1)
        out["rope_many"] = (HostRotary()(x, cos[:7], sin[:7]) - want).abs().max().item()
        want1 = _apply_rotary_pos_emb_bshd(x[:, :1].transpose(0, 1), freqs[5:6]).transpose(0, 1)
        rot = HostRotary()
        got1 = rot(x[:, :1], cos[5:6], sin[5:6])
        again = rot(x[:, 1:2], cos[5:6], sin[5:6])  # same position: the cached matrix
        want2 = _apply_rotary_pos_emb_bshd(x[:, 1:2].transpose(0, 1), freqs[5:6]).transpose(0, 1)
        out["rope_one"] = max((got1 - want1).abs().max().item(),
                              (again - want2).abs().max().item())

        class _Model:
            rotary_pos_emb, config = rope, tc
        cache_rope = CacheRope(_Model())
        keys = torch.randn(10, b, groups, hn)
        roped = cache_rope.rotate(keys, 4)
        want_k = _apply_rotary_pos_emb_bshd(keys, freqs[4:14])
        out["cache_rotate"] = (roped - want_k).abs().max().item()
        out["cache_inverse"] = (cache_rope.rotate(roped, 4, inverse=True) - keys).abs().max().item()
    ps.destroy_model_parallel()
    return out


def test_decode_kernels_equal_megatron_reference():
    out = run_distributed(_check, 1, timeout=180)[0]
    assert out["decode"] < 1e-6 and out["prefill"] < 1e-6, out
    assert out["no_mask_same"] and out["train_same"], out
    assert out["rope_many"] < 1e-6 and out["rope_one"] < 1e-6, out
    assert out["cache_rotate"] < 1e-6 and out["cache_inverse"] < 1e-5, out
