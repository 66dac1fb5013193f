"""The memory model's weight, grad and optimizer bytes equal the real tensors of Megatron-Core.

ONE launch on 4 gloo ranks. For every layout of ``enumerate_layouts(4, tiny)`` and four tiny
models (llama and qwen2, i.e. without and with a qkv bias, each untied and tied), every rank
builds its pp_stage with ``build_on_layout(..., optimizer=OptimizerSpec(...))``, runs one
``train_step`` (so Adam's state exists) and reads, from the live objects:

- weights: sum of ``numel * element_size`` over ``module.parameters()`` (shared tensors once);
- grads: ``numel_unpadded * element_size`` of the DDP grad buffers (Megatron's
  ``_ParamAndGradBuffer``; ``numel`` adds the bucket padding, which the model ignores);
- optimizer: the bytes of every state tensor of every param of the torch Adam inside Megatron's
  optimizer (``exp_avg``, ``exp_avg_sq`` and torch's scalar ``step``).

Asserted on every rank, against ``earl_megatron.plan.memory_model`` for this rank's pp_stage:

plain optimizer (``use_distributed_optimizer=False``, ``TrainOptions(distributed_optimizer=
False)``): weights, grads and the Adam moments (exp_avg + exp_avg_sq) are EQUAL to the model;
torch's ``step`` scalars add 4 B per parameter tensor, which the model omits (asserted as such).

LoRA (the tiny llama, rank 4, on two layouts and both optimizers): the same assertions, with
the trained parameters (the adapters, ``requires_grad``) in place of every parameter: the grad
buffers and Adam's moments hold the adapters only, as the model counts.

distributed optimizer (on two of the models): the moments of a dp x cp group together equal
the model's unsharded 8 B/param exactly; one rank's moments differ from the model's
``ceil(8 * params / (dp*cp))`` because Megatron shards the padded buffer (each param's start
aligned to 64 elements, each bucket's end to lcm(dp*cp, 128)). Measured (2026-11): at most 384 B
(0.12%) on the tiny model. The grad buffer's ``numel_unpadded`` then includes each param's
start alignment: equal to the model except for qwen2 at TP4, whose qkv bias has 32 elements per
rank (padded to 64): 4 layers x 32 elements = 512 B more. The test asserts these
bounds; the memory model documents bucket padding as ignored.

Wall time: ~30 s of CPU over the 4 ranks; the launch itself (4 x ~2.5 s of imports) dominates
on a quiet machine and grows several-fold when the 2 cores are oversubscribed.
"""

import math

import pytest

from earl_megatron.testing.multiproc import run_distributed

WORLD = 4
SEQ, GLOBAL_BATCH = 16, 4       # smallest step that gives every dp rank one sample
MODELS = (("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True))
DIST_OPT_MODELS = (("llama", False), ("qwen2", True))   # both also with the dist. optimizer
# The tiny qwen3_moe (4 experts of width 32, top 2) on expert layouts, both optimizers: dense
# params sharded over dp x cp, expert params over the expert-dp group (two kinds of buffer)
MOE_LAYOUTS = ("dp4", "ep2", "ep4", "ep2xtp2", "ep2xtp2xetp1")
# The tiny llama with rank-4 adapters on all four linears (frozen base), both optimizers: the
# weights count base and adapters, grads and Adam state the adapters only (plan/lora_memory.py)
LORA_LAYOUTS = ("tp2xdp2", "pp2xdp2")   # the tp split, the pp split, dp sharding
ALIGN = 64                      # Megatron pads each param start to 64 elements (dist. optimizer)


def _adam_states(optimizer):
    """(moment bytes, step-scalar bytes, param tensors) of every torch optimizer inside."""
    opts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    moments = steps = tensors = 0
    for o in opts:
        for group in o.optimizer.param_groups:
            for p in group["params"]:
                state = o.optimizer.state.get(p, {})
                if not state:
                    continue
                tensors += 1
                for key, t in state.items():
                    nbytes = t.numel() * t.element_size()
                    if key in ("exp_avg", "exp_avg_sq"):
                        moments += nbytes
                    else:
                        steps += nbytes
    return moments, steps, tensors


def _measure_all(distributed_optimizer_models):
    """Worker: one row per (model, layout, optimizer kind) with predicted and real bytes."""
    import gc

    import torch
    import torch.distributed as dist

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.plan.layout import enumerate_layouts
    from earl_megatron.plan.memory_model import memory_by_pp_rank, param_count_per_rank
    from earl_megatron.plan.specs import Stage, StageWorkload, TrainOptions
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import OptimizerSpec, build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.step import local_microbatches, random_batch, train_step

    # Objects alive now (torch, megatron) never become garbage: freezing them spares the
    # gc.collect() in every destroy_groups() a walk over them (~0.6 s a call when loaded).
    gc.freeze()
    rank = dist.get_rank()
    rows = []
    batch = random_batch(GLOBAL_BATCH, SEQ, 128, seed=5)
    from earl_megatron.config.lora import LoraSpec
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.plan.lora_memory import trained_elements_on
    from earl_megatron.plan.memory_model import expert_param_count_per_rank

    cases = [(family, tied, ModelConfig.tiny(family, tie_word_embeddings=tied),
              enumerate_layouts(WORLD, ModelConfig.tiny(family, tie_word_embeddings=tied)),
              [False] + ([True] if (family, tied) in distributed_optimizer_models else []))
             for family, tied in MODELS]
    moe = ModelConfig.tiny("qwen3_moe")
    cases.append(("qwen3_moe", False, moe, [ParallelLayout.parse(x, WORLD, moe)
                                            for x in MOE_LAYOUTS], [False, True]))
    lora = ModelConfig.tiny("llama").with_(lora=LoraSpec(rank=4, alpha=8.0))
    cases.append(("llama_lora", False, lora, [ParallelLayout.parse(x, WORLD, lora)
                                              for x in LORA_LAYOUTS], [False, True]))
    with cpu_backend():
        for family, tied, cfg, layouts, kinds in cases:
            for lay in layouts:
                for dist_opt in kinds:
                    mol = build_on_layout(cfg, lay, optimizer=OptimizerSpec(
                        use_distributed_optimizer=dist_opt))
                    mbs_size = GLOBAL_BATCH // lay.dp        # one micro-batch per rank
                    mbs = local_microbatches(batch, lay, mol.coords, micro_batch_size=mbs_size,
                                             model=cfg)
                    train_step(mol, mbs, seq_len=SEQ, micro_batch_size=mbs_size)
                    module = mol.module()
                    weights = sum(p.numel() * p.element_size() for p in module.parameters())
                    n_params = sum(1 for _ in module.parameters())
                    n_trained = sum(1 for p in module.parameters() if p.requires_grad)
                    buffers = mol.model.buffers + mol.model.expert_parallel_buffers
                    grads = sum(b.numel_unpadded * b.grad_data.element_size() for b in buffers)
                    grads_padded = sum(b.numel * b.grad_data.element_size() for b in buffers)
                    moments, steps, state_tensors = _adam_states(mol.optimizer)
                    # the dp x cp group shares one pp_stage and tp slice: sum its shards
                    group_moments = torch.tensor([moments], dtype=torch.int64)
                    dist.all_reduce(group_moments, group=groups.dp_group(True))
                    # the memory model's estimate for this rank's pp_stage, and unsharded
                    pp_rank = mol.coords.pp
                    wl = StageWorkload.of(Stage.TRAIN, SEQ, GLOBAL_BATCH)
                    est = memory_by_pp_rank(cfg, lay, wl, TrainOptions(
                        distributed_optimizer=dist_opt))[pp_rank]
                    plain = memory_by_pp_rank(cfg, lay, wl, TrainOptions(
                        distributed_optimizer=False))[pp_rank]
                    rows.append(dict(
                        family=family, tied=tied, layout=str(lay), dist_opt=dist_opt,
                        rank=rank, pp_rank=pp_rank, n_params=n_params,
                        param_count=param_count_per_rank(cfg, lay, pp_rank),
                        n_trained=n_trained,
                        trained=(trained_elements_on(cfg, lay, pp_rank) if cfg.lora.enabled
                                 else param_count_per_rank(cfg, lay, pp_rank)),
                        weights=weights, grads=grads, grads_padded=grads_padded,
                        moments=moments, steps=steps, state_tensors=state_tensors,
                        group_moments=int(group_moments.item()),
                        shard=lay.dp * lay.cp if dist_opt else 1,
                        expert_params=expert_param_count_per_rank(cfg, lay, pp_rank),
                        model_weights=est.weights, model_grads=est.grads,
                        model_optimizer=est.optimizer, model_unsharded=plain.optimizer))
                    groups.destroy_groups()
    return rows


@pytest.fixture(scope="module")
def rows():
    # The distributed optimizer on two of the four models keeps the launch short; the timeout
    # is for a loaded machine (the launch takes ~30 s of CPU over its processes).
    per_rank = run_distributed(_measure_all, WORLD, DIST_OPT_MODELS, timeout=300)
    return [r for rank_rows in per_rank for r in rank_rows]


def test_covers_every_layout_and_model(rows):
    from earl_megatron.config.model import ModelConfig
    from earl_megatron.plan.layout import ParallelLayout, enumerate_layouts

    layouts = {str(lay) for lay in enumerate_layouts(WORLD, ModelConfig.tiny())}
    assert len(layouts) == 10
    plain = {(r["family"], r["tied"], r["layout"]) for r in rows if not r["dist_opt"]}
    moe = {("qwen3_moe", False, str(ParallelLayout.parse(x, WORLD, ModelConfig.tiny("qwen3_moe"))))
           for x in MOE_LAYOUTS}
    lora = {("llama_lora", False, str(ParallelLayout.parse(x, WORLD, ModelConfig.tiny())))
            for x in LORA_LAYOUTS}
    assert plain == {(f, t, lay) for f, t in MODELS for lay in layouts} | moe | lora
    assert {r["rank"] for r in rows} == set(range(WORLD))


def test_moe_expert_bytes_divide_by_ep(rows):
    # tiny qwen3_moe: 4 layers x 4 experts x 3 x 64 x 32 = 98,304 expert elements in all
    moe = [r for r in rows if r["family"] == "qwen3_moe" and not r["dist_opt"]]
    assert len(moe) == len(MOE_LAYOUTS) * WORLD
    for r in moe:
        ep, etp = {"DP4": (1, 1), "EP2xDP4": (2, 1), "EP4xDP4": (4, 1), "EP2xTP2xDP2": (2, 2),
                   "EP2xTP2xDP2xETP1": (2, 1)}[r["layout"]]
        assert r["expert_params"] * ep * etp == 98304, r


def test_weights_equal_parameter_bytes(rows):
    for r in rows:
        assert r["weights"] == r["model_weights"], r
        assert r["model_weights"] == 4 * r["param_count"], r         # fp32


def test_grads_equal_unpadded_grad_buffer_plain_optimizer(rows):
    for r in (r for r in rows if not r["dist_opt"]):
        assert r["grads"] == r["model_grads"], r
        assert r["grads_padded"] == r["grads"], r        # no padding without the dist. optimizer


def test_optimizer_moments_equal_adam_state_plain_optimizer(rows):
    for r in (r for r in rows if not r["dist_opt"]):
        assert r["moments"] == r["model_optimizer"] == 8 * r["trained"], r
        # torch's Adam keeps a float32 scalar "step" per trained tensor: not in the model
        assert r["state_tensors"] == r["n_trained"], r
        assert r["steps"] == 4 * r["n_trained"], r
        if r["family"] != "llama_lora":
            assert (r["trained"], r["n_trained"]) == (r["param_count"], r["n_params"]), r


def test_lora_trains_the_adapters_only(rows):
    lora = [r for r in rows if r["family"] == "llama_lora"]
    assert len(lora) == len(LORA_LAYOUTS) * 2 * WORLD
    for r in lora:
        # 8 adapter tensors (A, B of 4 linears) per layer: 4 layers over pp
        pp = 2 if "PP2" in r["layout"] else 1
        assert r["n_trained"] == 8 * 4 // pp, r
        # tiny, rank 4: 3,328 adapter elements per layer; on tp2 2,176, on tp4 1,600
        # (qkv 256 + 128, proj 64 + 256, fc1 256 + 256, fc2 128 + 256)
        tp = 4 if "TP4" in r["layout"] else 2 if "TP2" in r["layout"] else 1
        assert r["trained"] == {1: 3328, 2: 2176, 4: 1600}[tp] * 4 // pp, r


def test_moe_distributed_optimizer_shards_experts_over_edp(rows):
    """Dense params over dp x cp, expert params over edp: one rank's moments are the model's
    within the start alignment of its params and the end padding of its two buffers."""
    dist_rows = [r for r in rows if r["dist_opt"] and r["family"] == "qwen3_moe"]
    assert len(dist_rows) == len(MOE_LAYOUTS) * WORLD
    for r in dist_rows:
        slack = 8 * (ALIGN * r["n_params"] + 2 * math.lcm(WORLD, 128))
        assert abs(r["moments"] - r["model_optimizer"]) <= slack, r
        assert r["model_grads"] <= r["grads"] < r["model_grads"] + 4 * ALIGN * r["n_params"], r


def test_distributed_optimizer_shards_sum_to_model(rows):
    dist_rows = [r for r in rows if r["dist_opt"] and r["family"] != "qwen3_moe"]
    assert len(dist_rows) == (2 * 10 + len(LORA_LAYOUTS)) * WORLD
    for r in dist_rows:
        # the dp x cp group holds exactly one unsharded copy of the moments between them
        assert r["group_moments"] == r["model_unsharded"], r
        # one rank's shard is the model's 1/(dp*cp) within the alignment padding of its params
        slack = 8 * (ALIGN * r["n_params"] + math.lcm(r["shard"], 128))
        assert abs(r["moments"] - r["model_optimizer"]) <= slack, r
        # the unpadded grad buffer counts each param's start alignment, never less than params
        assert r["model_grads"] <= r["grads"] < r["model_grads"] + 4 * ALIGN * r["n_params"], r
        assert r["grads_padded"] % (4 * r["shard"]) == 0, r


if __name__ == "__main__":   # print every row, for a reader
    for r in sorted((r for rank_rows in run_distributed(_measure_all, WORLD, DIST_OPT_MODELS,
                                                        timeout=300) for r in rank_rows),
                    key=lambda r: (r["family"], r["tied"], r["layout"], r["dist_opt"],
                                   r["rank"])):
        print(f"{r['family']} tied={r['tied']} {r['layout']} dist_opt={r['dist_opt']} "
              f"rank {r['rank']} pp_rank {r['pp_rank']}: "
              f"weights {r['weights']}/{r['model_weights']} "
              f"grads {r['grads']}/{r['model_grads']} (padded {r['grads_padded']}) "
              f"moments {r['moments']}/{r['model_optimizer']} "
              f"group {r['group_moments']}/{r['model_unsharded']} step scalars {r['steps']}")
