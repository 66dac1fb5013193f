"""A LoRA run from a checkpoint (``run.init`` plus ``model.lora``) and its KL reference, the
policy's own base with the adapters off: one 2-rank launch.

Models (trainer/model_pair.py ``build_model_pair``), tiny Llama (vocab 32) written as an HF
directory from seeded weights, rank 4, alpha 8, all four targets, on tp2:

- the LoRA policy built from the HF directory gives the logits of the un-adapted model loaded
  from it (today's reference, ``load_policy``) bit for bit, and so does one built from a
  Megatron checkpoint of that full model (fresh adapters: A seeded, B zero);
- with every B set nonzero the policy's logits move; ``reference_in`` gives the un-adapted
  model's logits bit for bit again, from the policy object itself (no second model); the next
  ``policy_in`` gives the adapted logits bit for bit;
- a checkpoint that holds adapters is refused as ``run.init`` (resuming is run.resume).

The trainer (``tiny_connect_four`` with ``run.init`` the HF directory, static tp2 layouts, KL in
the loss): 2 iterations with ``model.lora.rank=4`` against 1 without LoRA from the same
checkpoint: iteration 0 (B zero) records the same rewards, lengths, loss and KL (0) as the full
model; iteration 1's KL to the base is positive (the adapters trained and the reference ran
without them). A warm start with LoRA and KL off (``sft.steps=2``): the warm start trains the
adapters and leaves the checkpoint's base bit-identical (the calculator's traces, on a vocab-64
HF directory, as tests/distributed/test_warm_start.py).
"""

import json
from pathlib import Path

import pytest

from earl_megatron.testing.configs import tiny_connect_four
from earl_megatron.testing.multiproc import run_distributed

LORA = {"rank": 4, "alpha": 8}
LAYOUT = {"mode": "static", "rollout": "tp2", "logprob": "tp2", "train": "tp2"}
CALC_MODEL = {"vocab_size": 64, "num_attention_heads": 4, "num_query_groups": 2}
TRACES = Path(__file__).resolve().parents[1] / "data" / "calculator_traces.jsonl"


def _write_hf(out, **model):
    import torch.distributed as dist

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.weights.hf_io import write_hf_dir
    from earl_megatron.weights.hf_mapping import to_hf, to_hf_config

    cfg = ModelConfig.tiny(**model)
    if dist.get_rank() == 0:
        write_hf_dir(out, to_hf(cfg, reference_weights(cfg, seed=7)), to_hf_config(cfg))
    dist.barrier()
    return out


def _models(root, hf):
    import torch
    import torch.distributed as dist

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.models.lora import LoraSpec, lora_layers
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime.build import OptimizerSpec
    from earl_megatron.runtime.checkpoint import save_checkpoint
    from earl_megatron.runtime.io_errors import CheckpointError
    from earl_megatron.testing.logits import megatron_logits
    from earl_megatron.trainer.model_pair import build_model_pair
    from earl_megatron.weights.convert import load_policy

    cfg = ModelConfig.tiny(vocab_size=32, lora=LoraSpec(**LORA))
    lay = ParallelLayout.parse("tp2", world_size=dist.get_world_size(), model=cfg)
    tokens = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(3))

    def logits(mol):
        got = megatron_logits(mol, tokens)
        return None if got is None else got[1]

    def same(a, b):   # the logits live on one rank (last pp stage, tp rank 0)
        return a is None and b is None or torch.equal(a, b)

    out = {}
    plain = load_policy(hf, lay, ddp=False)   # today's reference: the un-adapted model
    base = logits(plain)
    full_ckpt = save_checkpoint(plain, f"{root}/full_ckpt", 0, {"iteration": 0})
    pair = build_model_pair(cfg, lay, lay, optimizer=OptimizerSpec(), seed=5, init=hf)
    out["policy_cfg_lora"] = pair.policy.cfg.lora == cfg.lora
    out["hf_init_equal"] = same(logits(pair.policy_in(lay)), base)
    from_mcore = build_model_pair(cfg, lay, None, optimizer=OptimizerSpec(), seed=5,
                                  init=str(full_ckpt))
    out["mcore_init_equal"] = same(logits(from_mcore.policy_in(lay)), base)
    out["mcore_no_reference"] = from_mcore.reference is None

    for name, m in lora_layers(pair.policy.model).items():
        gen = torch.Generator().manual_seed(len(name))
        m.load_full(b=0.05 * torch.randn(m.out_features, LORA["rank"], generator=gen))
    adapted = logits(pair.policy_in(lay))
    ref = pair.reference_in(lay)
    out["reference_is_policy"] = ref is pair.policy and pair.reference is pair.policy
    out["reference_equal"] = same(logits(ref), base)
    out["adapters_back"] = same(logits(pair.policy_in(lay)), adapted)
    if adapted is not None:
        out["adapters_move"] = (adapted - base).abs().max().item()

    lora_ckpt = save_checkpoint(pair.policy, f"{root}/lora_ckpt", 0, {"iteration": 0})
    try:
        build_model_pair(cfg, lay, None, optimizer=OptimizerSpec(), seed=5,
                         init=str(lora_ckpt))
        out["lora_ckpt_refused"] = "loaded"
    except CheckpointError as e:
        out["lora_ckpt_refused"] = str(e)
    return out


def _trainer(root, hf):
    import torch
    import torch.distributed as dist

    from earl_megatron.models.lora import lora_layers
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.checkpoint import load_checkpoint
    from earl_megatron.runtime.checkpoint_files import checkpoint_dir
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.train import run
    from earl_megatron.weights.convert import load_policy

    kl = {"kl_mode": "loss", "kl_coef": 0.1}
    lora = run(tiny_connect_four(f"{root}/lora", model={"lora": LORA}, layout=LAYOUT,
                                 algorithm=kl, run={"init": hf}))
    full = run(tiny_connect_four(f"{root}/full", layout=LAYOUT, algorithm=kl,
                                 run={"init": hf, "iterations": 1}))
    # the warm start needs traces: the calculator's (tests/data), its tokenizer's 64 ids
    with cpu_backend():
        calc_hf = _write_hf(f"{root}/hf64", **CALC_MODEL)
    warm_cfg = tiny_connect_four(
        f"{root}/warm", model={**CALC_MODEL, "lora": LORA}, layout=LAYOUT,
        env={"name": "calculator", "kwargs": {"system_prompt": "", "num_operands": 2},
             "eval_opponents": []},
        rollout={"tokenizer": "tool", "max_action_tokens": 16},
        sft={"steps": 2, "batch_size": 8, "data": str(TRACES), "lr": 1e-2, "log_every": 1},
        run={"init": calc_hf, "iterations": 1})
    run(warm_cfg)
    keys = ("reward", "win_rate", "loss", "kl", "mean_context", "max_context")
    out = {"it0": [{k: h.get(k) for k in keys} for h in (lora[0], full[0])],
           "kl1": lora[1].get("kl"), "iterations": [h["iteration"] for h in lora]}

    lay = ParallelLayout.parse("tp2", world_size=dist.get_world_size(), model=warm_cfg.model)
    with cpu_backend():
        plain = load_policy(calc_hf, lay, ddp=False)
        warmed = build_on_layout(warm_cfg.model.base, lay, ddp=False, seed=1)
        adapted = build_on_layout(warm_cfg.model, lay, ddp=False, seed=1)
        sft_ckpt = checkpoint_dir(f"{root}/warm/checkpoints/sft", 1)
        for m in (warmed, adapted):
            load_checkpoint(m, sft_ckpt)
    p, w = plain.model.state_dict(), warmed.model.state_dict()
    out["warm_base_unchanged"] = p.keys() == w.keys() and all(
        torch.equal(p[k], w[k]) for k in p if not k.endswith("_extra_state"))
    out["warm_adapters_trained"] = all(m.lora_b.abs().max().item() > 0
                                       for m in lora_layers(adapted.model).values())
    out["sft_steps"] = [json.loads(line)["step"] for line in
                        open(f"{root}/warm/sft.jsonl").read().splitlines()]
    return out


def _all(root):
    from earl_megatron.runtime.cpu_backend import cpu_backend

    with cpu_backend():
        hf = _write_hf(f"{root}/hf", vocab_size=32)
        models = _models(root, hf)
    return {"models": models, "trainer": _trainer(root, hf)}


@pytest.mark.timeout(900)
def test_lora_starts_from_a_checkpoint_and_its_reference_is_its_base(tmp_path):
    results = run_distributed(_all, 2, str(tmp_path), timeout=800)
    for r in results:
        m, t = r["models"], r["trainer"]
        assert m["policy_cfg_lora"] and m["hf_init_equal"] and m["mcore_init_equal"], m
        assert m["mcore_no_reference"] and m["reference_is_policy"], m
        assert m["reference_equal"] and m["adapters_back"], m
        assert "holds LoRA adapters" in m["lora_ckpt_refused"], m
        assert t["iterations"] == [0, 1], t
        assert t["it0"][0] == t["it0"][1] and t["it0"][0]["kl"] == 0.0, t
        assert t["kl1"] > 0, t
        assert t["warm_base_unchanged"] and t["warm_adapters_trained"], t
        assert t["sft_steps"] == [0, 1], t
    moved = [r["models"]["adapters_move"] for r in results if "adapters_move" in r["models"]]
    assert len(moved) == 1 and moved[0] > 1e-3, moved
