"""Time model: collective formulas, link placement, FLOP counts and the terms' relations."""

import math

from hypothesis import given, settings, strategies as st

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout, enumerate_layouts
from earl_megatron.plan.presets import PRESETS
from earl_megatron.plan.specs import ClusterSpec, Recompute, Stage, StageWorkload, TrainOptions
from earl_megatron.plan.time_model import (Link, allgather_seconds, allreduce_seconds,
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
