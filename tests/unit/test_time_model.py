"""Time model: collective formulas, link placement, FLOP counts and the terms' relations."""

import math

from hypothesis import given, settings, strategies as st

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout, enumerate_layouts
from earl_megatron.plan.presets import PRESETS
from earl_megatron.plan.memory_model import memory_breakdown
from earl_megatron.plan.specs import (ClusterSpec, DecodeEngine, Recompute, Stage, StageWorkload,
                                     TrainOptions)
from earl_megatron.plan.time_model import (Link, allgather_seconds, allreduce_seconds,
                                           decode_tokens, rollout_running_batch,
                                           forward_flops, group_link, matmul_params, stage_time)

H100x2 = ClusterSpec.h100_80gb(nodes=2, inter_node_gbps=200)


def test_collective_formulas():
    link = Link(bandwidth=100e9, latency_s=0.0, crosses_nodes=False)
    assert math.isclose(allreduce_seconds(1e9, 8, link), 2 * 7 / 8 * 1e9 / 100e9)
    assert math.isclose(allgather_seconds(1e9, 4, link), 3 / 4 * 1e9 / 100e9)
    assert allreduce_seconds(1e9, 1, link) == 0.0
    slow = Link(bandwidth=100e9, latency_s=1e-3, crosses_nodes=True)
    assert math.isclose(allreduce_seconds(8, 2, slow), 8 / 100e9 + 2e-3)


def test_group_placement_follows_megatron_rank_order():
    # tp8 on 8-device nodes: every tp group is one node; each of the 8 dp groups spans both
    # nodes, so the node's 25 GB/s (200 Gbit/s) is shared 8 ways.
    lay = ParallelLayout(tp=8, dp=2)
    assert group_link(H100x2, lay, "tp") == Link(450e9, 1e-6, False)
    dp = group_link(H100x2, lay, "dp")
    assert dp.crosses_nodes and math.isclose(dp.bandwidth, 25e9 / 8)
    # tp16 spans both nodes: one crossing group per node gets the whole 25 GB/s.
    tp16 = group_link(H100x2, ParallelLayout(tp=16), "tp")
    assert tp16.crosses_nodes and math.isclose(tp16.bandwidth, 25e9)
    # tp2 x dp8: dp groups are ranks {0,2,..,14}: cross nodes; tp pairs stay inside.
    assert not group_link(H100x2, ParallelLayout(tp=2, dp=8), "tp").crosses_nodes


def test_flops_by_hand():
    model = ModelConfig.tiny()   # h 64, f 128, q = kv*2 = 64, vocab 128, 4 layers
    assert matmul_params(model) == 4 * (64 * 128 + 64 * 64 + 3 * 64 * 128) + 128 * 64
    wl = StageWorkload.of(Stage.LOGPROB, 10, 3)
    attn = 2 * 8 * 8 * 4 * 3 * 10 * 10       # 2 a d L x sum(s^2)
    assert forward_flops(model, wl, fused_attention=True) == 2 * matmul_params(model) * 30 + attn
    assert forward_flops(model, wl, fused_attention=False) == \
        2 * matmul_params(model) * 30 + 2 * attn


def test_train_is_three_forwards_and_recompute_adds_one():
    model = PRESETS["llama3-8b"]
    lay = ParallelLayout(tp=8)
    cl = ClusterSpec.h100_80gb()
    wl = StageWorkload.of(Stage.LOGPROB, 4096, 64)
    fwd = stage_time(model, lay, wl, cl).compute
    train = stage_time(model, lay, wl.with_(stage=Stage.TRAIN), cl)
    full = stage_time(model, lay, wl.with_(stage=Stage.TRAIN), cl,
                      TrainOptions(recompute=Recompute.FULL))
    assert math.isclose(train.compute, 3 * fwd)
    assert math.isclose(full.compute, 4 * fwd)
    assert train.dp_comm == 0.0 and train.tp_comm > 0      # dp = 1: no grad reduction
    # 64 x 4096 tokens on 8 ranks of 989 TFLOP/s at 45%: forward = flops / (8 x 445 TFLOP/s)
    assert math.isclose(fwd, forward_flops(model, wl, fused_attention=True) / 8 / (989e12 * 0.45))


def test_pipeline_bubble():
    model = PRESETS["llama3-8b"]
    cl = ClusterSpec.h100_80gb()
    wl = StageWorkload.of(Stage.TRAIN, 4096, 16, micro_batch_tokens=8192)
    t = stage_time(model, ParallelLayout(tp=2, pp=4), wl, cl)
    m = 16 * 4096 // 8192                     # 8 micro-batches per replica
    assert math.isclose(t.pp_bubble, t.compute * 3 / m)
    assert stage_time(model, ParallelLayout(tp=8), wl, cl).pp_bubble == 0.0


def test_decode_is_memory_bound_at_small_batch():
    model = PRESETS["qwen2.5-7b"]
    cl = ClusterSpec.h100_80gb()
    lay = ParallelLayout(tp=4, dp=2)
    small = StageWorkload.of(Stage.ROLLOUT, 4096, 2, responses_in_flight=2)
    t = stage_time(model, lay, small, cl)
    assert t.decode_memory > t.compute            # reading weights dominates one-token steps
    faster_hbm = stage_time(model, lay, small, cl.with_(hbm_bandwidth=2 * cl.hbm_bandwidth))
    assert faster_hbm.decode_memory < t.decode_memory
    assert t.dp_comm == 0.0 and t.optimizer_step == 0.0


def test_cross_node_tp_is_slower_than_in_node():
    model = PRESETS["llama3-8b"]
    wl = StageWorkload.of(Stage.TRAIN, 4096, 32)
    in_node = stage_time(model, ParallelLayout(tp=8, dp=2), wl, H100x2)
    slow_nvlink = H100x2.with_(intra_node_bandwidth=H100x2.inter_node_bandwidth / 8)
    assert stage_time(model, ParallelLayout(tp=8, dp=2), wl, slow_nvlink).tp_comm > \
        in_node.tp_comm


@settings(max_examples=40, deadline=None)
@given(stage=st.sampled_from(list(Stage)), ctx=st.integers(1, 50000), seqs=st.integers(1, 300),
       inflight=st.integers(1, 300), nodes=st.sampled_from([1, 2, 4]), data=st.data())
def test_terms_are_finite_and_nonnegative(stage, ctx, seqs, inflight, nodes, data):
    model = PRESETS["qwen2.5-7b"]
    cl = ClusterSpec.h100_80gb(nodes=nodes)
    lay = data.draw(st.sampled_from(enumerate_layouts(cl.world_size, model)))
    wl = StageWorkload.of(stage, ctx, seqs, responses_in_flight=inflight)
    t = stage_time(model, lay, wl, cl)
    assert all(math.isfinite(v) and v >= 0 for v in t.terms().values()), t.describe()
    assert t.compute > 0
    if lay.tp == 1:
        assert t.tp_comm == 0.0
    if lay.cp == 1:
        assert t.cp_comm == 0.0
    if lay.pp == 1:
        assert t.pp_comm == t.pp_bubble == 0.0


def _tokens_per_gpu_s(model, cl, tp, ctx, per_replica):
    """Generated tokens per GPU-second of TP``tp`` with ``per_replica`` responses per replica."""
    lay = ParallelLayout(tp=tp, dp=cl.world_size // tp)
    wl = StageWorkload.of(Stage.ROLLOUT, ctx, per_replica * lay.dp,
                          responses_in_flight=per_replica * lay.dp)
    t = stage_time(model, lay, wl, cl)
    return decode_tokens(wl) / t.total / cl.world_size, rollout_running_batch(model, lay, wl, cl)


def test_rollout_tp4_vs_tp8_has_the_measured_shape():
    """Qwen2.5-72B on 16 x 8 H100-80GB (the EARL paper's setting; it measured TP4 16-32% ahead
    at 1K-2K tokens with 8-64 responses, TP8 ahead at 16K-32K with 32 or more, TP4 short of
    memory at 32K x 128)."""
    model, cl = PRESETS["qwen2.5-72b"], ClusterSpec.h100_80gb(nodes=16)
    ratio = {}
    for ctx in (1024, 2048, 8192, 16384, 32768):
        for n in (8, 32, 64, 128):
            (tp4, kv4), (tp8, _) = (_tokens_per_gpu_s(model, cl, tp, ctx, n) for tp in (4, 8))
            ratio[(ctx, n)] = tp4 / tp8
            if ctx == 32768 and n == 128:
                assert kv4.running < 128 == kv4.requested     # short of memory: sequences wait
    for n in (8, 32, 64):                                     # short contexts, light load
        assert 1.1 < ratio[(1024, n)] < 1.4 and 1.1 < ratio[(2048, n)] < 1.4
    for ctx in (16384, 32768):                                # long contexts, heavy load
        assert ratio[(ctx, 32)] < 1 and ratio[(ctx, 128)] < 1
    # the crossover moves to fewer responses as the context grows
    crossover = {ctx: min((n for n in (8, 32, 64, 128) if ratio[(ctx, n)] < 1), default=None)
                 for ctx in (1024, 8192, 16384)}
    assert crossover[1024] is None and crossover[8192] > crossover[16384]


def test_paged_pool_bounds_the_running_batch_not_the_fit():
    model, cl = PRESETS["qwen2.5-72b"], ClusterSpec.h100_80gb(nodes=16)
    lay = ParallelLayout(tp=4, dp=32)
    wl = StageWorkload.of(Stage.ROLLOUT, 32768, 128 * 32, responses_in_flight=128 * 32)
    kv = rollout_running_batch(model, lay, wl, cl)
    assert kv.requested == 128 and 1 <= kv.running < 128
    mem = memory_breakdown(model, lay, wl, cluster=cl)
    assert mem.kv_cache < 128 * kv.bytes_per_sequence        # the pool, not every sequence
    assert mem.total <= int(cl.device_memory_bytes * cl.decode_engine.memory_fraction)
    # a static cache (the embedded engine) reserves every response: that does not fit
    static = cl.with_(decode_engine=DecodeEngine.embedded())
    assert memory_breakdown(model, lay, wl, cluster=static).kv_cache == 128 * kv.bytes_per_sequence
    # per replica: doubling dp halves what each replica is asked for
    assert wl.responses_per_replica(32) == 128 and wl.responses_per_replica(64) == 64
