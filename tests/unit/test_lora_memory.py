"""The planner knows about LoRA (issue #46 item 2): plan/lora_memory.py, the memory model's LoRA
terms, the selector's smaller TRAIN layouts and ``earl plan --lora-rank``.

Every number is derived in a comment from the model's shapes. The tiny model (4 layers, hidden
64, ffn 128, 8 heads of 8, 4 KV groups: qkv 64 + 2 x 32 = 128 rows) with rank-4 adapters on all
four linears has per layer A + B elements:
qkv 4x64 + 128x4, proj 4x64 + 64x4, fc1 4x64 + 256x4, fc2 4x128 + 64x4 = 3,328; x 4 layers = 13,312
(docs/lora.md's measured count). On tp2 a rank keeps A whole and half of B for the column targets
(qkv, fc1) and half of A and B whole for the row targets (proj, fc2):
256 + 256 + 128 + 256 + 256 + 512 + 256 + 256 = 2,176 per layer, 8,704 in all (the DDP buffer
measured in docs/lora.md).
"""

import io

import pytest
from test_plan_layouts_cli import tool  # noqa: F401 - the fixture loading tools/plan_layouts.py

from earl_megatron.config.lora import LoraSpec
from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.activations import layer_activation_bytes, train_layer_bytes
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.lora_memory import adapter_activation_bytes, trained_elements_on
from earl_megatron.plan.memory_model import (memory_breakdown, memory_by_pp_rank,
                                             param_count_per_rank, train_state_bytes,
                                             train_state_split)
from earl_megatron.plan.presets import get_preset
from earl_megatron.plan.selector import NoLayoutFitsError, Selector, SelectorConfig
from earl_megatron.plan.specs import ClusterSpec, Recompute, Stage, StageWorkload, TrainOptions
from earl_megatron.plan.tensor_table import num_parameters

TINY = ModelConfig.tiny()
TINY_LORA = TINY.with_(lora=LoraSpec(rank=4, alpha=8.0))
PLAIN, DIST = TrainOptions(distributed_optimizer=False), TrainOptions()


def lay(text, world, model=TINY):
    return ParallelLayout.parse(text, world, model)


def test_adapters_are_the_only_trained_elements():
    assert trained_elements_on(TINY_LORA, lay("dp1", 1), 0) == 13312
    assert trained_elements_on(TINY_LORA, lay("tp2", 2), 0) == 8704
    # pp2: two layers per stage, 2 x 3,328
    assert [trained_elements_on(TINY_LORA, lay("pp2", 2), r) for r in (0, 1)] == [6656, 6656]
    # the weights term counts base and adapters: the base's elements plus the adapters'
    assert param_count_per_rank(TINY_LORA, lay("tp2", 2), 0) == \
        param_count_per_rank(TINY, lay("tp2", 2), 0) + 8704
    # grads (fp32 main_grad, 4 B) and Adam's two fp32 moments (8 B) for the adapters only
    assert train_state_split(TINY_LORA, lay("tp2", 2), 0, PLAIN) == (4 * 8704, 8 * 8704)
    # the distributed optimizer shards them over dp x cp: TP2xDP2 -> 8 x 8,704 / 2
    assert train_state_split(TINY_LORA, lay("tp2xdp2", 4), 0, DIST) == (4 * 8704, 34816)
    assert train_state_split(TINY_LORA, lay("cp2xdp2", 4), 0, DIST) == (4 * 13312, 8 * 13312 // 4)
    assert train_state_bytes(TINY_LORA, lay("pp2", 2), PLAIN) == 12 * 6656
    # the full fine-tune keeps every parameter's: 4 + 8 B each
    assert num_parameters(TINY) == 164416
    assert train_state_split(TINY, lay("dp1", 1), 0, PLAIN) == (4 * 164416, 8 * 164416)


def test_bf16_adapters_keep_an_fp32_master_copy():
    # adapters take the base's dtype (LoraLinear); Megatron's mixed-precision optimizer keeps a
    # 4 B fp32 master copy beside the two moments: 12 B per adapter element
    bf16 = TINY_LORA.with_(params_dtype="bfloat16")
    assert train_state_split(bf16, lay("dp1", 1), 0, PLAIN) == (4 * 13312, 12 * 13312)


def test_experts_are_never_adapted():
    moe = ModelConfig.tiny("qwen3_moe")
    moe_lora = moe.with_(lora=LoraSpec(rank=4, targets=("linear_qkv", "linear_proj")))
    # attention adapters only: (4x64 + 128x4) + (4x64 + 64x4) = 1,280 per layer, 5,120 in all;
    # no expert element trains, so the expert-dp sharding has nothing to shard
    layout = lay("ep2", 2, moe)
    assert trained_elements_on(moe_lora, layout, 0) == 5120
    assert train_state_split(moe_lora, layout, 0, DIST) == (4 * 5120, 8 * 5120 // 2)


def test_adapter_activations_by_target_and_split():
    one, two = lay("dp1", 1), lay("tp2", 2)
    # no dropout: B's input h = A x, r = 4 per token per target: 16 tokens x 4 targets x 4 x 4 B
    assert adapter_activation_bytes(TINY_LORA, one, 16, 4) == 16 * 4 * 4 * 4
    assert adapter_activation_bytes(TINY_LORA, two, 16, 4) == 16 * 4 * 4 * 4   # h is r-wide
    assert adapter_activation_bytes(TINY_LORA, lay("cp2", 2), 16, 4) == 8 * 4 * 4 * 4
    # dropout: the dropped input and its 1-byte mask, (4 + 1) B per input element:
    # qkv and fc1 see hidden 64, proj the context (64 / tp), fc2 the ffn (128 / tp)
    drop = TINY_LORA.with_(lora=LoraSpec(rank=4, dropout=0.1))
    assert adapter_activation_bytes(drop, one, 16, 4) == 1024 + 16 * 5 * (64 + 64 + 64 + 128)
    assert adapter_activation_bytes(drop, two, 16, 4) == 1024 + 16 * 5 * (64 + 64 + 32 + 64)
    # rank 0: nothing
    assert adapter_activation_bytes(TINY, one, 16, 4) == 0


def test_train_estimate_adds_the_adapters_and_drops_the_base_state():
    # on CPU both run Megatron's local layers (unfused attention)
    layout, wl = lay("tp2", 2), StageWorkload.of(Stage.TRAIN, 16, 2, micro_batch_tokens=16)
    cpu = dict(cluster=ClusterSpec.cpu(ranks=2))
    full = memory_by_pp_rank(TINY, layout, wl, PLAIN, **cpu)[0]
    lora = memory_by_pp_rank(TINY_LORA, layout, wl, PLAIN, **cpu)[0]
    assert lora.weights == full.weights + 4 * 8704
    assert (lora.grads, lora.optimizer) == (4 * 8704, 8 * 8704)
    # one micro-batch in flight, 4 layers, each + 16 tokens x 4 targets x r=4 x 4 B
    assert lora.activations == full.activations + 4 * 1024
    assert (lora.logits, lora.comm_buffers) == (full.logits, full.comm_buffers)
    # full recompute: only the layer input stays; the adapters' part is rebuilt with the layer
    rc = PLAIN.with_(recompute=Recompute.FULL)
    full_rc = memory_by_pp_rank(TINY, layout, wl, rc, **cpu)[0]
    lora_rc = memory_by_pp_rank(TINY_LORA, layout, wl, rc, **cpu)[0]
    assert lora_rc.activations == full_rc.activations + 1024
    # the other stages hold no grads or optimizer state either way: weights differ by adapters
    for stage in (Stage.LOGPROB, Stage.ROLLOUT):
        w = StageWorkload.of(stage, 16, 2, micro_batch_tokens=16)
        a, b = (memory_breakdown(m, layout, w, **cpu) for m in (TINY, TINY_LORA))
        assert b.total - a.total == 4 * 8704 and b.grads == b.optimizer == 0


def test_lora_layers_are_megatrons_local_ones_on_gpus_too():
    # models/provider.py te_layers: a LoRA model never builds TE's layers, so an H100 (fused
    # attention for a full fine-tune) runs its attention unfused, keeping the scores
    layout, wl = lay("tp2", 2), StageWorkload.of(Stage.TRAIN, 16, 2, micro_batch_tokens=16)
    gpu = dict(cluster=ClusterSpec.h100_80gb(nodes=1, devices_per_node=2))
    local = train_layer_bytes(TINY, layout, 16, 16, 4, fused_attention=False,
                              recompute=Recompute.NONE).stored
    te = train_layer_bytes(TINY, layout, 16, 16, 4, fused_attention=True,
                           recompute=Recompute.NONE).stored
    assert memory_by_pp_rank(TINY, layout, wl, PLAIN, **gpu)[0].activations == 4 * te
    assert memory_by_pp_rank(TINY_LORA, layout, wl, PLAIN, **gpu)[0].activations == \
        4 * (local + 1024)


# Qwen2.5-7B (bf16, 7,615,616,512 parameters), rank 16 on all four linears; per layer the adapter
# elements are 16 x (in + out) summed over the targets: qkv 3,584 + 4,608 (28 + 2 x 4 heads of
# 128), proj 3,584 + 3,584, fc1 3,584 + 37,888 ([gate; up]), fc2 18,944 + 3,584:
# 16 x 79,360 = 1,269,760; x 28 layers = 35,553,280 (0.47% of the base).
N7B, A7B = 7_615_616_512, 28 * 16 * 79_360
CTX = 2048   # TRAIN: 8 sequences of 2,048 tokens, micro-batches of 2,048, no recompute


def _seven_b():
    return get_preset("qwen2.5-7b"), get_preset("qwen2.5-7b").with_(lora=LoraSpec(rank=16))


def test_seven_b_train_fits_without_tensor_parallelism_with_lora():
    full, lora = _seven_b()
    assert A7B == 35_553_280
    assert trained_elements_on(lora, ParallelLayout.parse("dp8", 8, lora), 0) == A7B
    wl = StageWorkload.of(Stage.TRAIN, CTX, 8, micro_batch_tokens=CTX)
    config = SelectorConfig(max_cp=1, max_pp=1)        # tp x dp layouts, as a plain Megatron run
    node = ClusterSpec.h100_80gb(nodes=1)               # budget 0.9 x 80e9 = 72e9 B per GPU
    sel_full, sel_lora = Selector(full, node, config=config), Selector(lora, node, config=config)
    assert sel_full.budget_bytes == 72_000_000_000
    dp8 = ParallelLayout.parse("dp8", 8, full)
    f, lo = sel_full.memory(dp8, wl), sel_lora.memory(dp8, wl)
    # full fine-tune on DP8: bf16 weights 2 B, fp32 grads 4 B, optimizer (fp32 master + two
    # moments) 12 B / 8 ranks per parameter: 57.1e9 B before a single activation
    assert (f.weights, f.grads, f.optimizer) == (2 * N7B, 4 * N7B, 12 * N7B // 8)
    assert f.weights + f.grads + f.optimizer == 57_117_123_840
    # LoRA on DP8: the base's weights plus the adapters', and state for the adapters only
    assert (lo.weights, lo.grads, lo.optimizer) == (2 * (N7B + A7B), 4 * A7B, 12 * A7B // 8)
    # activations, 28 layers: the full fine-tune runs TE's layers (fused attention), LoRA
    # Megatron's local ones (unfused: the scores too) plus its adapters' CTX x 4 targets x r=16
    # x 2 B (plan/lora_memory.py)
    layer = {fused: layer_activation_bytes(full, dp8, CTX, CTX, 2, fused_attention=fused)
             for fused in (True, False)}
    assert (f.activations, lo.activations) == \
        (28 * layer[True], 28 * (layer[False] + CTX * 4 * 16 * 2))
    assert f.total == 75_356_185_856 > 72e9 > lo.total == 44_190_297_088
    # so the full fine-tune needs TP2 at least; LoRA takes DP8 (tp1) into its candidates
    plan_full, _ = sel_full.plan(wl)
    plan_lora, _ = sel_lora.plan(wl)
    assert [str(x) for x in plan_full.oom] == ["DP8"] and plan_full.layout.tp >= 2
    assert plan_lora.oom == ()
    # on ONE H100 the full fine-tune's state alone (2 + 4 + 12 B x 7.6e9 = 137e9 B) is over
    # the budget; LoRA's is 2 x 7.65e9 + 16 x 35.6e6 B, and TP1 fits (DP8's total plus the
    # unsharded optimizer's 7/8 of 12 x 35.6e6 B)
    one = ClusterSpec.h100_80gb(nodes=1, devices_per_node=1)
    with pytest.raises(NoLayoutFitsError):
        Selector(full, one).plan(wl)
    single, _ = Selector(lora, one).plan(wl)
    m = single.chosen.memory
    assert str(single.layout) == "TP1" and (m.grads, m.optimizer) == (4 * A7B, 12 * A7B)
    assert m.total == 44_563_606_528 <= 72e9


def test_earl_plan_lora_rank_prints_full_against_lora(tool):
    out = io.StringIO()
    argv = ["--model", "qwen2.5-7b", "--lora-rank", "16", "--stages", "train", "--contexts",
            str(CTX), "--responses", "8", "--micro-batch-tokens", str(CTX), "--recompute", "none"]
    assert tool.main(argv, out=out) == 0
    text = out.getvalue()
    assert "7.62B parameters" in text                      # the base's size
    assert "LoRA r=16 on linear_qkv,linear_proj,linear_fc1,linear_fc2: 35.55M adapter " \
           "parameters train (0.47% of the base)" in " ".join(text.split())
    row = next(ln for ln in text.splitlines() if ln.strip().startswith("2K") and ":" in ln)
    # the fewest devices: the full fine-tune neither 1 (137e9 B of state) nor 2 (TP2: 2 + 4 B
    # + 12 B unsharded per parameter / 2 = 68.5e9 B before activations) but 4; LoRA one GPU at
    # 44,563,606,528 B = 41.5 GiB (the test above)
    fewest_full, fewest_lora = row.split("G")[2:4]
    assert fewest_full.strip().startswith("4:") and fewest_lora.strip() == "1: TP1 42", row
    assert tool.device_counts(tool.build_parser().parse_args(["--nodes", "16"])) == \
        [1, 2, 4, 8, 16, 32, 64, 128]
    assert tool.device_counts(tool.build_parser().parse_args(["--nodes", "3"])) == \
        [1, 2, 4, 8, 16, 24]


def test_earl_plan_lora_flags_refuse_bad_input(tool):
    parse = tool.build_parser().parse_args
    assert tool.model_from_args(parse(["--model", "qwen2.5-7b"])).lora.rank == 0
    m = tool.model_from_args(parse(["--lora-rank", "8", "--lora-targets", "linear_qkv"]))
    assert (m.lora.rank, m.lora.targets) == (8, ("linear_qkv",))
    with pytest.raises(SystemExit, match="--lora-targets needs --lora-rank"):
        tool.model_from_args(parse(["--lora-targets", "linear_qkv"]))
    with pytest.raises(SystemExit, match=r"\['qkv'\] unknown; use any of"):
        tool.model_from_args(parse(["--lora-rank", "8", "--lora-targets", "qkv"]))
    with pytest.raises(SystemExit, match="model.lora.rank=-2: use a positive integer"):
        tool.model_from_args(parse(["--lora-rank", "-2"]))
    with pytest.raises(SystemExit, match="experts' linears"):
        tool.model_from_args(parse(["--model", "qwen3-30b-a3b", "--lora-rank", "8"]))
    text = io.StringIO()   # LoRA runs on a split (and on SGLang servers) since #46
    assert tool.main(["--lora-rank", "8", "--split", "auto"], out=text) == 0
    assert "split" in text.getvalue()
