"""LoRA adapters on Megatron's parallel linears (models/lora.py): one 2-rank launch, two models.

Each model is built from the same full weights on a tp1 layout (dp2: every rank a whole model)
and on tp2, then adapted with the same spec and seed. Checked on every layout:

- with B = 0 (the init) the logits equal the base model's bit-exact;
- on tp1, one adapted linear's output is base(x) + B A x * alpha / rank by hand;
- every base parameter is frozen and gets no gradient; every adapter gets a nonzero one;

and across layouts, after B is set from one seeded full tensor: the adapters themselves, the
logits and the adapters' gradients (tp2 shards assembled) equal tp1's within 1e-5 (relative to the
largest entry of each gradient).

Llama adapts all four linears (tp2 without sequence parallelism: fc1's [gate; up] stride 2);
the tiny Qwen3-MoE adapts its attention (tp2 turns sequence parallelism on for MoE), and its
experts' linears are refused with the model left unchanged.
"""

from earl_megatron.testing.multiproc import run_distributed
from earl_megatron.testing.tiny_models import tiny_model

TOL = 1e-5
ALL = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
ATTENTION = ("linear_qkv", "linear_proj")


def _adapted_run(cfg, layout_name, targets):
    """Logits before / after adapting and after setting B, gradients, on one layout."""
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from earl_megatron.models.lora import LoraSpec, apply_lora, lora_layers
    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import build_on_layout

    lay = ParallelLayout.parse(layout_name, world_size=dist.get_world_size(), model=cfg)
    mol = build_on_layout(cfg, lay, weights=reference_weights(cfg, seed=7), ddp=False)
    model = mol.model
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    weight = torch.randn(2, 16, cfg.vocab_size, generator=gen)   # the loss: sum(logits * weight)
    positions = torch.arange(16).unsqueeze(0).expand_as(tokens)

    def logits():
        return gather_from_tensor_model_parallel_region(model(tokens, positions, None),
                                                        group=groups.tp_group())

    out = {"sp": any(getattr(m, "sequence_parallel", False) for m in model.modules())}
    with torch.no_grad():
        base = logits()
    if cfg.is_moe:   # the experts' linears are refused before anything changes
        try:
            apply_lora(model, LoraSpec(rank=4, alpha=8, targets=ALL), seed=11)
        except ValueError as e:
            out["refused"] = str(e)
        out["unchanged"] = not lora_layers(model) and all(p.requires_grad
                                                          for p in model.parameters())
    adapters = apply_lora(model, LoraSpec(rank=4, alpha=8, targets=targets), seed=11)
    with torch.no_grad():
        out["b0_exact"] = torch.equal(logits(), base)
    layers = lora_layers(model)
    for name, layer in layers.items():
        g = torch.Generator().manual_seed(len(name))
        layer.load_full(b=0.05 * torch.randn(layer.out_features, 4, generator=g))
    if lay.tp == 1:   # the update is B A x * alpha / rank (peft's LoRA), by hand on one linear
        layer = next(iter(layers.values()))
        x = torch.randn(5, 2, layer.in_features, generator=gen)
        with torch.no_grad():
            want = layer.base(x)[0] + x @ layer.lora_a.T @ layer.lora_b.T * (8 / 4)
            out["formula_diff"] = (layer(x)[0] - want).abs().max().item()
    full = logits()
    (full * weight).sum().backward()
    out["logits"] = full.detach()
    out["base_frozen"] = all(not p.requires_grad and p.grad is None
                             for n, p in model.named_parameters() if "lora_" not in n)
    out["adapters"] = sorted(adapters)
    out["adapter_grads_nonzero"] = all(p.grad is not None and p.grad.abs().sum() > 0
                                       for p in adapters.values())
    out["full"] = {f"{name}.{w}": (layer.gather_full(w, getattr(layer, w)),
                                   layer.gather_full(w, getattr(layer, w).grad))
                   for name, layer in layers.items() for w in ("lora_a", "lora_b")}
    out["max_logit_change"] = (full.detach() - base).abs().max().item()
    groups.destroy_groups()
    return out


def _check_all():
    import torch.distributed as dist

    from earl_megatron.runtime.cpu_backend import cpu_backend

    runs = {}
    with cpu_backend():
        for family, targets in (("llama", ALL), ("qwen3_moe", ATTENTION)):
            cfg = tiny_model(family, moe_aux_loss_coeff=0.0) if family == "qwen3_moe" \
                else tiny_model(family)
            for layout_name in ("dp2", "tp2"):
                runs[family, layout_name] = _adapted_run(cfg, layout_name, targets)
    return runs if dist.get_rank() == 0 else None


def test_lora_layers_tp2_equal_tp1():
    runs = run_distributed(_check_all, 2, timeout=300)[0]
    for (family, layout_name), run in runs.items():
        where = (family, layout_name)
        assert run["b0_exact"], where
        assert run["base_frozen"], where
        assert run["adapter_grads_nonzero"], where
        # the seeded B moves the logits well past the tolerance, so equality below means something
        assert run["max_logit_change"] > 100 * TOL, (where, run["max_logit_change"])
        assert run["sp"] == (family == "qwen3_moe" and layout_name == "tp2"), where
        if layout_name == "dp2":
            assert run["formula_diff"] < TOL, (where, run["formula_diff"])
    assert "expert" in runs["qwen3_moe", "dp2"]["refused"]
    assert runs["qwen3_moe", "tp2"]["unchanged"]
    for family, per_layer in (("llama", 4), ("qwen3_moe", 2)):
        tp1, tp2 = runs[family, "dp2"], runs[family, "tp2"]
        assert tp1["adapters"] == tp2["adapters"]
        assert len(tp1["adapters"]) == 4 * per_layer * 2   # 4 layers, A and B of each
        assert (tp1["logits"] - tp2["logits"]).abs().max().item() < TOL, family
        for name, (value, grad) in tp1["full"].items():
            value2, grad2 = tp2["full"][name]
            assert value.shape == value2.shape, name
            assert (value - value2).abs().max().item() < TOL, (family, name)
            # the loss sums 4096 weighted logits: gradients reach ~50 and differ by float32's
            # summation order (measured: at most 2.3e-5, 4.3e-7 of the largest), so relative
            diff = (grad - grad2).abs().max().item()
            assert diff < TOL * grad.abs().max().item(), (family, name, diff)
