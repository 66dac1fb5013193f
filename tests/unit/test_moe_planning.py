"""Planning for mixture-of-experts models: memory per rank under EP, active-parameter compute,
the token all-to-all's price, and the selector's EP choices (dense models never get ep > 1)."""

import math

import pytest

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.memory_model import (expert_param_count_per_rank, layer_activation_bytes,
                                             memory_breakdown, moe_layer_activation_bytes,
                                             param_count_per_rank)
from earl_megatron.plan.presets import PRESETS
from earl_megatron.plan.profile_table import ProfileTable
from earl_megatron.plan.selector import Selector, SelectorConfig
from earl_megatron.plan.specs import ClusterSpec, Stage, StageWorkload, TrainOptions
from earl_megatron.plan.tensor_table import num_parameters, tensor_table
from earl_megatron.plan.time_model import (alltoall_seconds, experts_touched_fraction,
                                           matmul_params, stage_time)

A3B = PRESETS["qwen3-30b-a3b"]
H100 = ClusterSpec.h100_80gb()                 # 1 node of 8
H100x2 = ClusterSpec.h100_80gb(nodes=2)
TINY = ModelConfig.tiny("qwen3_moe")           # 4 layers, h 64, 4 experts of width 32, top 2


def _wl(stage, ctx=4096, n=64):
    return StageWorkload.of(stage, ctx, n, responses_in_flight=n)


def test_expert_bytes_divide_by_ep_exactly():
    table = tensor_table(A3B)
    experts = table.expert_elements()
    dense = num_parameters(A3B) - experts
    assert experts == 48 * 128 * 3 * 2048 * 768
    for ep in (1, 2, 4, 8):
        lay = ParallelLayout(dp=8, ep=ep)
        assert expert_param_count_per_rank(A3B, lay, 0) * ep == experts
        assert param_count_per_rank(A3B, lay, 0) == dense + experts // ep
        est = memory_breakdown(A3B, lay, _wl(Stage.LOGPROB), cluster=H100)
        assert est.weights == 2 * (dense + experts // ep)          # bf16
    # expert TP: etp splits the experts, tp the rest (the router stays whole, like a norm)
    tp2 = ParallelLayout(tp=2, dp=4, ep=4)
    tp2_etp1 = ParallelLayout(tp=2, dp=4, ep=4, etp=1)
    assert expert_param_count_per_rank(A3B, tp2, 0) * 8 == experts
    assert expert_param_count_per_rank(A3B, tp2_etp1, 0) * 4 == experts
    router = 48 * 128 * 2048
    norms = 48 * (2 * 2048 + 2 * 128) + 2048
    split = dense - router - norms
    assert param_count_per_rank(A3B, tp2, 0) == router + norms + split // 2 + experts // 8


def test_train_state_shards_experts_over_edp():
    opts = TrainOptions()                      # distributed optimizer, bf16: 12 B/param
    for lay in (ParallelLayout(dp=8), ParallelLayout(dp=8, ep=8), ParallelLayout(dp=8, ep=2),
                ParallelLayout(tp=2, dp=4, ep=4, etp=1)):
        est = memory_breakdown(A3B, lay, _wl(Stage.TRAIN, 1024, 8), opts, cluster=H100)
        p = param_count_per_rank(A3B, lay, 0)
        e = expert_param_count_per_rank(A3B, lay, 0)
        assert est.grads == 4 * p
        assert est.optimizer == math.ceil((p - e) * 12 / lay.dp) + math.ceil(e * 12 / lay.edp)
    # pure DP8 and EP8 both hold 1/8 of the state: DP8 shards every expert 8 ways, EP8 keeps
    # whole experts (edp = 1), one eighth of them
    dp8, ep8 = (memory_breakdown(A3B, ParallelLayout(dp=8, ep=ep), _wl(Stage.TRAIN, 1024, 8),
                                 opts, cluster=H100) for ep in (1, 8))
    assert abs(dp8.optimizer - ep8.optimizer) <= 2
    assert dp8.grads == 4 * num_parameters(A3B) and ep8.grads < dp8.grads / 5


def test_moe_activations_by_hand():
    # tiny MoE, fp32, tp1, one 64-token sequence: the router keeps fp32 logits and softmax (2E)
    # and top-k probs per token; each of the 2 routed copies its permuted input and expert
    # output (2h) and SwiGLU at width 32 (5 x 32 unfused, 4 x 32 fused)
    lay = ParallelLayout(dp=4)
    router = 64 * 4 * (2 * 4 + 2)
    assert moe_layer_activation_bytes(TINY, lay, 64, 4, fused_attention=False) == \
        router + 64 * 2 * 4 * (2 * 64 + 5 * 32)
    assert moe_layer_activation_bytes(TINY, lay, 64, 4, fused_attention=True) == \
        router + 64 * 2 * 4 * (2 * 64 + 4 * 32)
    # the layer: attention as for the dense Qwen3 of the same shape, the MLP term replaced
    dense = TINY.with_(family="qwen3", num_experts=None, moe_ffn_hidden_size=None)
    for fused, mlp in ((False, 5 * 128), (True, 4 * 128)):
        attn_only = layer_activation_bytes(dense, lay, 64, 64, 4, fused_attention=fused) \
            - 64 * 4 * mlp
        assert layer_activation_bytes(TINY, lay, 64, 64, 4, fused_attention=fused) == \
            attn_only + moe_layer_activation_bytes(TINY, lay, 64, 4, fused_attention=fused)
    # tp2 runs under sequence parallelism: the MoE layer sees 32 tokens, gathered over etp=2
    tp2 = ParallelLayout(tp=2, dp=2)
    assert moe_layer_activation_bytes(TINY, tp2, 32, 4, fused_attention=True) == \
        32 * 4 * 10 + 32 * 2 * 2 * 4 * (2 * 64 + 4 * 16)


def test_compute_counts_active_parameters():
    h, d = 2048, 128
    attn = h * (32 * d + 2 * 4 * d) + 32 * d * h
    active_mlp = 128 * h + 8 * 3 * h * 768
    assert matmul_params(A3B) == 48 * (attn + active_mlp) + 151936 * h
    # = the tensor table's active elements less the embedding lookup and the norms
    norms = 48 * (2 * h + 2 * d) + h
    assert matmul_params(A3B) == tensor_table(A3B).active_elements() - 151936 * h - norms
    assert matmul_params(A3B) < 0.11 * num_parameters(A3B)
    wl = _wl(Stage.LOGPROB)
    t = stage_time(A3B, ParallelLayout(dp=8), wl, H100)
    attn_flops = 2 * 32 * d * 48 * wl.sum_sq_tokens
    assert math.isclose(t.compute, (2 * matmul_params(A3B) * wl.total_tokens + attn_flops)
                        / 8 / H100.achievable_flops)
    # compute does not depend on ep (the same tokens meet the same active experts)
    assert math.isclose(stage_time(A3B, ParallelLayout(dp=8, ep=8), wl, H100).compute,
                        t.compute)
    # decode reads only the experts a step touches: k/E of them for one token
    assert math.isclose(experts_touched_fraction(A3B, 1), 8 / 128)
    assert experts_touched_fraction(A3B, 64) > 0.98


def test_alltoall_is_zero_at_ep1_and_grows_with_tokens():
    for stage in Stage:
        assert stage_time(A3B, ParallelLayout(dp=8), _wl(stage), H100).ep_comm == 0.0
        assert stage_time(PRESETS["qwen3-8b"], ParallelLayout(dp=8), _wl(stage), H100) \
            .ep_comm == 0.0
    ep8 = ParallelLayout(dp=8, ep=8)
    for stage in Stage:
        small, big = (stage_time(A3B, ep8, _wl(stage, 2048, n), H100).ep_comm for n in (32, 64))
        assert 0 < small < big, stage
    # LOGPROB by hand: 2 all-to-alls (dispatch + combine) per layer, each rank sending
    # tokens x topk x h x 2 B, 7/8 of it to the 7 peers in its node over NVLink
    wl = _wl(Stage.LOGPROB, 4096, 64)          # 32,768 tokens per rank, one micro-batch each 8K
    t = stage_time(A3B, ep8, wl, H100)
    m = 4                                      # 32,768 tokens / 8,192 per micro-batch
    nbytes = 8192 * 8 * 2048 * 2
    one = 7 / 8 * nbytes / H100.intra_node_bandwidth + 7 * H100.intra_node_latency_s
    assert math.isclose(alltoall_seconds(H100, ep8, nbytes), one)
    assert math.isclose(t.ep_comm, m * 2 * 48 * one)
    # TRAIN adds the backward's two
    train = stage_time(A3B, ep8, wl.with_(stage=Stage.TRAIN), H100)
    assert math.isclose(train.ep_comm, 2 * t.ep_comm)
    # across nodes: EP16 on 2 nodes sends half of every rank's bytes through the node's NIC,
    # shared by its 8 ranks
    ep16 = ParallelLayout(dp=16, ep=16)
    cross = alltoall_seconds(H100x2, ep16, nbytes)
    assert math.isclose(cross, 8 * 8 * nbytes / 16 / H100x2.inter_node_bandwidth
                        + 15 * H100x2.inter_node_latency_s)
    assert cross > 10 * one


def test_selector_picks_ep_where_ep1_cannot_fit():
    # data parallel only (no tp, cp, pp): DP8 holds all 128 experts (57 GiB of weights) and
    # its LOGPROB step does not fit 80 GB less the margin; an EP layout does
    sel = Selector(A3B, H100, config=SelectorConfig(max_tp=1, max_cp=1, max_pp=1))
    plan, _ = sel.plan(_wl(Stage.LOGPROB))
    assert ParallelLayout(dp=8) in plan.oom
    assert plan.layout.ep > 1
    assert f"EP{plan.layout.ep}: {128 // plan.layout.ep} of 128 experts per rank" in plan.reason
    assert "DP8 (EP1) would need" in plan.reason and "over the budget" in plan.reason
    # every EP and both expert-TP choices are candidates
    layouts = sel.valid_layouts(Stage.LOGPROB)
    assert {lay.ep for lay in layouts} == {1, 2, 4, 8}
    full = Selector(A3B, H100).valid_layouts(Stage.TRAIN)
    assert any(lay.etp == 1 and lay.tp > 1 for lay in full)
    assert any(lay.etp is None and lay.tp > 1 and lay.ep > 1 for lay in full)


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen2.5-7b"])
def test_dense_model_never_gets_ep(name):
    sel = Selector(PRESETS[name], H100)
    for stage in Stage:
        layouts = sel.valid_layouts(stage)
        assert layouts and all(lay.ep == 1 and lay.etp is None for lay in layouts)
        plan, _ = sel.plan(_wl(stage, 2048, 16))
        assert plan.layout.ep == 1 and "EP" not in plan.reason


def test_profile_table_keeps_ep_and_etp():
    lay = ParallelLayout(tp=2, dp=4, ep=4, etp=1)
    table = ProfileTable().record(Stage.TRAIN, lay, 2048, 8, 1.5) \
        .record(Stage.TRAIN, ParallelLayout(dp=8), 2048, 8, 2.0)
    data = table.to_json()
    assert data["entries"][0]["layout"] == {"tp": 1, "cp": 1, "pp": 1, "dp": 8}
    back = ProfileTable.from_json(data)
    assert back == table and lay in back.layouts(Stage.TRAIN)


def test_plan_layouts_tool_plans_moe_with_reasons():
    import importlib.util
    import io
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "plan_layouts.py"
    spec = importlib.util.spec_from_file_location("plan_layouts", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = io.StringIO()
    assert tool.main(["--model", "qwen3-30b-a3b", "--contexts", "2048", "--responses", "16",
                      "--stages", "rollout", "--reasons", "--max-tp", "1"], out=out) == 0
    text = out.getvalue()
    assert "30.53B parameters (3.35B active: 128 experts, top 8)" in text
    assert "2K x 16: EP" in text and "experts per rank" in text
