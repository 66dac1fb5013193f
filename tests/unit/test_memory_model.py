"""Memory model: exact parameter counts against Megatron-Core's GPTModel, hand-checked terms,
and monotonicity in the workload."""

import json
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings, strategies as st

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout, enumerate_layouts
from earl_megatron.plan.memory_model import (expert_param_count_per_rank,
                                             layer_activation_bytes, memory_breakdown,
                                             memory_by_pp_rank, param_count_per_rank,
                                             train_state_bytes)
from earl_megatron.plan.presets import PRESETS
from earl_megatron.plan.specs import ClusterSpec, Recompute, Stage, StageWorkload, TrainOptions
from earl_megatron.plan.tensor_table import num_parameters

QWEN_TINY = ModelConfig.tiny(add_qkv_bias=True)   # 4 layers, h 64, f 128, 8 heads, 4 groups

# Per-rank parameter counts of a live Megatron-Core 0.16.1 GPTModel (local spec, RMSNorm,
# SwiGLU, qkv bias) built on 4 gloo ranks, read as sum(p.numel()) on every rank (2026-11).
MEASURED_4_RANKS = [
    # (tp, pp, tied, counts of ranks 0..3)
    (2, 2, True, [41344, 41344, 41408, 41408]),
    (2, 2, False, [41344, 41344, 41408, 41408]),
    (4, 1, True, [39616] * 4),
    (4, 1, False, [41664] * 4),
    (1, 4, True, [45312, 37120, 37120, 45376]),
    (1, 4, False, [45312, 37120, 37120, 45376]),
]


@pytest.mark.parametrize("tp,pp,tied,counts", MEASURED_4_RANKS)
def test_param_count_matches_measured_gptmodel(tp, pp, tied, counts):
    model = QWEN_TINY.with_(tie_word_embeddings=tied)
    layout = ParallelLayout(tp=tp, pp=pp, dp=4 // (tp * pp))
    got = [param_count_per_rank(model, layout, layout.coords(r).pp) for r in range(4)]
    assert got == counts


_LIVE = textwrap.dedent("""
    import datetime, json, os, torch, torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from earl_megatron.runtime.cpu_backend import cpu_backend
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)

    def build(layers, h, f, heads, groups, vocab, bias=False, tie=False, qk=False, kv=None):
        tc = TransformerConfig(num_layers=layers, hidden_size=h, ffn_hidden_size=f,
            num_attention_heads=heads, num_query_groups=groups, normalization="RMSNorm",
            gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            add_bias_linear=False, add_qkv_bias=bias, qk_layernorm=qk, kv_channels=kv,
            use_cpu_initialization=True,
            hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
            masked_softmax_fusion=False)
        return GPTModel(config=tc, transformer_layer_spec=get_gpt_layer_local_spec(
            normalization="RMSNorm", qk_layernorm=qk), vocab_size=vocab, max_sequence_length=512,
            share_embeddings_and_output_weights=tie, position_embedding_type="rope")

    def saved_bytes(model, seq):
        # Bytes of the distinct non-parameter storages autograd saves during one forward.
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen = {}
        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
            return t
        ids = torch.randint(0, 64, (1, seq))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, torch.arange(seq)[None], None)
        return sum(seen.values())

    out = {"params": {}, "layer_bytes": {}}
    for bias in (False, True):
        for tie in (False, True):
            m = build(4, 64, 128, 8, 4, 128, bias, tie)
            out["params"][f"{bias} {tie}"] = sum(p.numel() for p in m.parameters())
    with cpu_backend():
        model_parallel_cuda_manual_seed(1)
        for dims, seq in ACTIVATION_CASES:
            one, two = (saved_bytes(build(n, *dims[:5], qk=dims[5], kv=dims[6]), seq)
                        for n in (1, 2))
            out["layer_bytes"][f"{dims} {seq}"] = two - one
    print(json.dumps(out))
""")


# (h, f, heads, groups, vocab, qk_layernorm, kv_channels), tokens: Llama-like, Qwen3-like with
# a head_dim apart from h / heads (12 != 64 / 8, 16 != 96 / 6), and that head_dim without norms
ACTIVATION_CASES = (((64, 128, 8, 4, 128, False, None), 64),
                    ((96, 200, 6, 2, 64, False, None), 100), ((64, 128, 8, 4, 128, False, 12), 64), ((64, 128, 8, 4, 128, True, 12), 64),
                    ((96, 200, 6, 2, 64, True, 16), 100))


def _run_live():
    pytest.importorskip("megatron.core")
    from earl_megatron.runtime.dist import free_port
    proc = subprocess.run([sys.executable, "-c", f"ACTIVATION_CASES = {ACTIVATION_CASES!r}\n"
                           + _LIVE], capture_output=True, text=True,
                          timeout=180, env={"PORT": str(free_port()), "OMP_NUM_THREADS": "1",
                                            "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def live():
    return _run_live()


def test_param_count_matches_live_gptmodel_tp1_pp1(live):
    for bias in (False, True):
        for tie in (False, True):
            model = ModelConfig.tiny(add_qkv_bias=bias, tie_word_embeddings=tie)
            assert live["params"][f"{bias} {tie}"] == param_count_per_rank(
                model, ParallelLayout(), 0) == num_parameters(model)


def test_cpu_activation_bytes_match_what_autograd_saves(live):
    """The local-spec (CPU) activation term equals the bytes autograd saves for one layer (the
    difference between a 2-layer and a 1-layer GPTModel forward), fp32, tp = cp = 1."""
    for dims, seq in ACTIVATION_CASES:
        h, f, heads, groups, vocab, qk, kv = dims
        model = ModelConfig(hidden_size=h, ffn_hidden_size=f, num_attention_heads=heads,
                            num_query_groups=groups, vocab_size=vocab, qk_layernorm=qk,
                            kv_channels=kv)
        predicted = layer_activation_bytes(model, ParallelLayout(), seq, seq, 4,
                                           fused_attention=False)
        assert live["layer_bytes"][f"{dims} {seq}"] == predicted, dims


@pytest.mark.parametrize("layout,measured", [(ParallelLayout(tp=2), 291_328),
                                             (ParallelLayout(tp=4), 201_216),
                                             (ParallelLayout(cp=2), 252_160)])
def test_cpu_activation_bytes_match_measured_tp_and_cp(layout, measured):
    """Per-rank saved bytes of one layer (2-layer minus 1-layer forward, tiny dims, a 64-token
    sequence, fp32) measured on 2-4 gloo ranks with saved-tensor hooks (2026-11), equal on every
    rank; cp=2 ran the project's provider (AllGatherKVAttention) on its zigzag half."""
    model = ModelConfig.tiny()
    assert layer_activation_bytes(model, layout, 64, 64, 4, fused_attention=False) == measured


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(PRESETS)), tied=st.booleans(),
       world=st.sampled_from([1, 2, 4, 8, 16, 32]), data=st.data())
def test_shards_sum_to_the_whole_model(name, tied, world, data):
    """tp ranks of a pp_stage split everything but the norms (Qwen3's q/k norms included) and
    the MoE router; pp_stages split the layers; ep x etp ranks split the experts."""
    model = PRESETS[name].with_(tie_word_embeddings=tied)
    layouts = enumerate_layouts(world, model, expert_tp="both")
    layout = data.draw(st.sampled_from(layouts))
    t, h, L = layout.tp, model.hidden_size, model.num_layers
    experts = [expert_param_count_per_rank(model, layout, r) for r in range(layout.pp)]
    total = sum(param_count_per_rank(model, layout, r) - e
                for r, e in zip(range(layout.pp), experts)) * t \
        + sum(experts) * layout.ep * layout.expert_tp
    norms = (2 * h + (2 * model.head_dim if model.qk_layernorm else 0)
             + (model.num_experts * h if model.is_moe else 0)) * L + h
    extra_output = model.vocab_size * h if (tied and layout.pp > 1) else 0
    assert total == num_parameters(model) + (t - 1) * norms + extra_output


def test_activation_bytes_by_hand():
    # fp32, tp1, one 64-token sequence. Fused (TE) path, per token: 4 B x (4h + q + 2kv + q + 4f)
    # = 4 x (256 + 64 + 64 + 64 + 512) = 3,840 B, plus 8 heads x 4 B of log-sum-exp.
    model = ModelConfig.tiny()
    assert layer_activation_bytes(model, ParallelLayout(), 64, 64, 4, fused_attention=True) \
        == 64 * (3_840 + 32)
    # Local spec: 4 B x (2 x (3h + 1) + 3q + q + 5f + 4d) = 4 x (386 + 256 + 640 + 32) = 5,256 B
    # per token; scores 64 x 64 x (8 heads x 4 B + a 1-byte mask) = 135,168 B.
    per_layer = layer_activation_bytes(model, ParallelLayout(), 64, 64, 4, fused_attention=False)
    assert per_layer == 64 * 5_256 + 135_168
    wl = StageWorkload.of(Stage.TRAIN, 64, 1, micro_batch_tokens=64)
    est = memory_breakdown(model, ParallelLayout(), wl, cluster=ClusterSpec.cpu(ranks=1))
    assert est.activations == 4 * per_layer                    # 4 layers, 1 micro-batch
    assert est.weights == 164_416 * 4
    assert est.grads == 164_416 * 4
    assert est.optimizer == 164_416 * 8                         # fp32 params: no master copy
    # logits: 64 tokens x 128 vocab x (2 x 4 B + 8 B): fp32 logits, their grad, two fp32 copies
    assert est.logits == 64 * 128 * 16
    assert est.total == sum(est.terms().values())


def test_optimizer_sharding_and_dtypes():
    model = ModelConfig.tiny(params_dtype="bfloat16")
    lay = ParallelLayout(tp=2, cp=2, dp=2)
    p = param_count_per_rank(model, lay, 0)
    wl = StageWorkload.of(Stage.TRAIN, 32, 4)
    est = memory_breakdown(model, lay, wl)
    assert est.weights == 2 * p
    assert est.grads == 4 * p
    assert est.optimizer == -(-12 * p // 4)                     # sharded over dp x cp = 4
    plain = memory_breakdown(model, lay, wl, TrainOptions(distributed_optimizer=False))
    assert plain.optimizer == 12 * p
    assert train_state_bytes(model, lay) == est.grads + est.optimizer


def test_kv_cache_and_stage_terms():
    model = ModelConfig.tiny()     # fp32, 4 groups x head dim 8
    lay = ParallelLayout(tp=2, dp=2)
    wl = StageWorkload.of(Stage.ROLLOUT, 100, 16, responses_in_flight=8)
    est = memory_breakdown(model, lay, wl)
    # 4 responses per replica x 100 tokens x 4 layers x 2 (k, v) x 2 groups x 8 x 4 B
    assert est.kv_cache == 4 * 100 * 4 * 2 * 2 * 8 * 4
    assert est.grads == est.optimizer == 0
    lp = memory_breakdown(model, lay, wl.with_(stage=Stage.LOGPROB))
    assert lp.kv_cache == 0 and lp.grads == 0 and lp.logits > 0


def test_ends_live_on_the_right_pp_stage():
    model = ModelConfig.tiny()
    lay = ParallelLayout(pp=2, dp=2)
    wl = StageWorkload.of(Stage.TRAIN, 64, 8, micro_batch_tokens=64)
    first, last = memory_by_pp_rank(model, lay, wl)
    assert first.logits == 0 and last.logits > 0
    # 1F1B: pp_stage 0 holds 2 micro-batches in flight, pp_stage 1 holds 1.
    assert first.activations == 2 * last.activations


def test_recompute_lowers_activations():
    model = PRESETS["llama3-8b"]
    lay = ParallelLayout(tp=8)
    wl = StageWorkload.of(Stage.TRAIN, 8192, 8)
    cl = ClusterSpec.h100_80gb()
    acts = [memory_breakdown(model, lay, wl, TrainOptions(recompute=r), cluster=cl).activations
            for r in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)]
    assert acts[0] >= acts[1] > acts[2]
    # Unfused attention: every one of the 32 layers stores the softmax output (8192 x 8192 per
    # head, 32/8 heads per tp rank, 2 B) and a 1-byte mask, K and V repeated to the 4 local
    # heads and Q (3 x 512 per token); selective recompute keeps instead Megatron's checkpoint
    # inputs (roped q and k: 512 + 128, the fused qkv output: 768, an int32 mask type) and
    # rebuilds the core attention of one layer at a time in the backward.
    cpu = ClusterSpec.cpu(ranks=8)
    sel = [memory_breakdown(model, lay, wl, TrainOptions(recompute=r), cluster=cpu).activations
           for r in (Recompute.NONE, Recompute.SELECTIVE)]
    s, scores = 8192, 8192 * 8192 * (4 * 2 + 1)
    dropped = s * 2 * (3 * 512) + scores
    kept = s * 2 * ((512 + 128) + 768) + 4
    assert sel[0] - sel[1] == 32 * (dropped - kept) - dropped


@settings(max_examples=60, deadline=None)
@given(stage=st.sampled_from(list(Stage)), ctx=st.integers(1, 20000),
       grow=st.integers(0, 20000), seqs=st.integers(1, 64), inflight=st.integers(1, 64),
       mb=st.sampled_from([256, 1024, 4096]), fused=st.booleans(),
       recompute=st.sampled_from(list(Recompute)), data=st.data())
def test_memory_grows_with_the_workload(stage, ctx, grow, seqs, inflight, mb, fused, recompute,
                                        data):
    model = ModelConfig.tiny(num_layers=8)
    layout = data.draw(st.sampled_from(enumerate_layouts(8, model)))
    cl = ClusterSpec.cpu(ranks=8).with_(fused_attention=fused)
    opts = TrainOptions(recompute=recompute)
    base = StageWorkload.of(stage, ctx, seqs, responses_in_flight=inflight,
                            micro_batch_tokens=mb)
    m0 = memory_breakdown(model, layout, base, opts, cluster=cl)
    for bigger in (base.with_(contexts=((ctx + grow, seqs),)),
                   base.with_(responses_in_flight=inflight + grow),
                   base.with_(micro_batch_tokens=mb * 2)):
        m1 = memory_breakdown(model, layout, bigger, opts, cluster=cl)
        assert m1.total >= m0.total, (m0.describe(), m1.describe())
