"""Megatron-Core's MoE GPTModel on every expert layout is what the tensor table says it is.

One 4-rank launch over the tiny qwen3_moe (4 experts, top 2) on DP4, EP2, EP4, EP2xTP2 (sequence
parallel), EP2xTP2xETP1 and EP2xPP2:

- each rank's parameters are exactly ``tensor_table.held_on(layout, rank)`` under
  ``name_on`` names, with the local shapes of ``row.local_rows`` (expert rows split by the
  expert-TP rank, only its ep rank's experts);
- built without Megatron's random init (the switcher's and loaders' path), every parameter
  carries the same attributes as with it (``allreduce=False`` on experts when ep > 1: DDP
  reduces them over the expert-dp group);
- with the same full weights loaded, the eval forward's logits equal DP4's on every layout.
"""

from earl_megatron.testing.multiproc import run_distributed

WORLD = 4
LAYOUTS = ["dp4", "ep2", "ep4", "ep2xtp2", "ep2xtp2xetp1", "ep2xpp2"]


def _attrs(module) -> dict:
    import torch

    return {n: {k: ("<tensor>" if isinstance(v, torch.Tensor) else v)
                for k, v in sorted(vars(p).items())}
            for n, p in module.named_parameters()}


def _job():
    import torch
    import torch.distributed as dist

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.plan.tensor_table import tensor_table
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.testing.logits import megatron_logits

    cfg = ModelConfig.tiny("qwen3_moe")
    table, rank = tensor_table(cfg), dist.get_rank()
    full = reference_weights(cfg, seed=7)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    out = {}
    with cpu_backend():
        for name in LAYOUTS:
            lay = ParallelLayout.parse(name, WORLD, cfg)
            want = {table.name_on(r, lay): tuple(
                sum(b - a for a, b in r.local_rows(lay, rank)) if d == (r.split_dim or 0)
                else s for d, s in enumerate(r.shape)) for r in table.held_on(lay, rank)}
            attrs = {}
            for init in (True, False):
                m = build_on_layout(cfg, lay, weights=full, ddp=True, init=init)
                attrs[init] = _attrs(m.module())
            have = {n: tuple(p.shape) for n, p in m.module().named_parameters()}
            m.module().eval()
            res = megatron_logits(m, ids)
            out[name] = dict(want=want, have=have, attrs=attrs,
                             logits=None if res is None else res[1].clone())
    groups.destroy_groups()
    return out


def test_moe_model_matches_the_table_on_every_expert_layout():
    import torch

    results = run_distributed(_job, WORLD, timeout=300, collective_timeout_s=60)
    ref = results[0]["dp4"]["logits"]
    assert ref is not None
    for rank, per in enumerate(results):
        for name in LAYOUTS:
            r = per[name]
            assert r["have"] == r["want"], (rank, name)
            assert r["attrs"][True] == r["attrs"][False], (rank, name)
            for n, at in r["attrs"][False].items():
                ep = "ep" in name and name != "dp4"
                assert at.get("allreduce", True) == (not ep or "experts" not in n), (rank, name, n)
            if r["logits"] is not None:
                torch.testing.assert_close(r["logits"], ref, rtol=0, atol=1e-5,
                                           msg=f"{name} rank {rank}")
    assert sum(per[n]["logits"] is not None for per in results for n in LAYOUTS) >= len(LAYOUTS)
